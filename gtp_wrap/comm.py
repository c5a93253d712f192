"""Collectives and cross-rank agreement checks, with timeouts that name what was waited for.

Every collective is issued asynchronously and completed through `Comm.wait`, the one place that
turns a stuck collective into a CollectiveTimeoutError. On NCCL, `Work.wait()` only makes the
current stream wait (no host sync), and a timed wait would block the host, so the process
group's own timeout (its watchdog) applies there instead.

Note: the "side stream" of the design is NCCL's own. An async collective runs on the process
group's internal stream after waiting for the work already queued on the current stream (so a
gather never overwrites a buffer an earlier kernel still reads), and `wait()` makes the current
stream wait for it with an event. A prefetch issued before the current use's GEMM is queued
therefore runs under that GEMM, with no stream or event management of our own.
"""

from __future__ import annotations

import dataclasses
import datetime
import zlib
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from .copy_engine import CopyEngineCollectives, StreamWork
from .errors import CollectiveError, CollectiveTimeoutError
from .mesh import GTPMesh


@dataclasses.dataclass
class Pending:
    """An issued collective (on gloo, a group's collectives) and a description of it for error
    messages."""

    works: tuple[dist.Work | StreamWork, ...]
    what: str


# How gloo words a peer that is late or gone ("Operation timed out!", "Application timeout
# caused pair closure", "Connection closed by peer", "Broken pipe", "Connection refused").
_PEER_TROUBLE = ("timed out", "timeout", "peer", "pair closure", "broken pipe", "connection")


class Comm:
    """The collectives of one engine: gathers and reduce-scatters over the GTP group,
    all-reduces over the dp group and over the world. With `gather_copies` and
    `reduce_copies` set, gathers and reduce-scatters go through those instead of the process
    group."""

    def __init__(self, mesh: GTPMesh, timeout_s: float, tag: str, average: bool) -> None:
        self.mesh = mesh
        self.gather_copies: CopyEngineCollectives | None = None
        self.reduce_copies: CopyEngineCollectives | None = None
        # Gradient reductions average (the mean over data ranks, applied once per axis by the
        # collective itself: no extra scaling kernel) or sum, as the policy says.
        self.grad_op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        self._rs_opts = dist.ReduceScatterOptions()
        self._rs_opts.reduceOp = self.grad_op
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._tag = tag
        self._exchanges = 0
        self._previous = ""  # the purpose/number of the last exchange, whose key to delete next
        # Gloo differs twice. Its waits block the host, so they take our timeout. And a group
        # is issued there one collective per weight: a gloo Work keeps its outputs referenced
        # until dropped, and one Work shared by a group would keep every buffer of the group
        # looking in use (buffers.py waits for that reference to go) until its last weight is
        # used. On CPU the grouping saves nothing anyway.
        self._gloo = mesh.gtp_group is not None and dist.get_backend() == "gloo"
        self._axes = {
            "dp": (mesh.dp_group, mesh.dp_size),
            "gtp": (mesh.gtp_group, mesh.gtp_size),
            "world": (None, mesh.world_size),  # None: the default group
        }
        # Error messages name the step; descriptions are made once per weight at wrap time
        # with a `{step}` field that is filled in only when something goes wrong.
        self.step: Callable[[], int] = lambda: 0

    def all_gather(
        self, outs: list[torch.Tensor], shards: list[torch.Tensor], what: str
    ) -> list[Pending]:
        """Gather each shard into its output, all in one collective (one grouped NCCL launch);
        a shard of another dtype than its output is cast on the way.

        Note: each output gets its own Pending, waited for by whoever uses that output: on NCCL
        a wait orders only the calling stream, so one wait for the group would not cover an
        output used later on another stream. On NCCL they share the group's one Work. (A GTP
        group of one gathers nothing: the engine reads its local copy instead.)
        """
        if self.gather_copies is not None:  # casts on its own stream
            copies = self.gather_copies.all_gather(outs, shards)
            return [Pending((copies,), what) for _ in outs]
        shards = [self._in_place(out, shard) for out, shard in zip(outs, shards)]
        # The ProcessGroup's own methods: the torch.distributed wrappers add ~25 us of Python
        # checks per call, paid on every weight use.
        group = self.mesh.gtp_group
        if len(outs) > 1 and not self._gloo:
            work = group.allgather_into_tensor_coalesced(outs, shards)
            return [Pending((work,), what) for _ in outs]
        return [Pending((work,), what) for work in map(group._allgather_base, outs, shards)]

    def _in_place(self, out: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """A shard of another dtype than its gather, cast into this rank's part of the output,
        which the process group then gathers in place (NCCL and gloo allow it)."""
        if shard.dtype == out.dtype:
            return shard
        own = out.view(self.mesh.gtp_size, -1)[self.mesh.gtp_rank]
        own.copy_(shard)
        return own

    def reduce_scatter(
        self, outs: list[torch.Tensor], fulls: list[torch.Tensor], what: str
    ) -> Pending:
        """Reduce each full tensor and scatter it into its output, all in one collective."""
        if self.mesh.gtp_size == 1:
            for out, full in zip(outs, fulls):
                out.copy_(full)
            return Pending((), what)
        if self.reduce_copies is not None:
            average = self.grad_op == dist.ReduceOp.AVG
            return Pending((self.reduce_copies.reduce_scatter(outs, fulls, average),), what)
        group, opts = self.mesh.gtp_group, self._rs_opts
        if len(outs) > 1 and not self._gloo:
            return Pending((group.reduce_scatter_tensor_coalesced(outs, fulls, opts),), what)
        return Pending(
            tuple(group._reduce_scatter_base(o, f, opts) for o, f in zip(outs, fulls)), what
        )

    def workspace_bytes(self, outside_allocator: bool = False) -> int:
        """Memory of the copy-engine workspaces (symmetric memory); with `outside_allocator`,
        only what `torch.cuda.max_memory_allocated` does not count."""
        copies = (c for c in (self.gather_copies, self.reduce_copies) if c is not None)
        return sum(c.nbytes for c in copies if c.outside_allocator or not outside_allocator)

    def all_reduce(
        self, t: torch.Tensor, axis: Literal["dp", "gtp", "world"], what: str, op: Any = None
    ) -> Pending:
        """Reduce `t` over one mesh axis; by default with the gradient reduction (mean or sum)."""
        group, size = self._axes[axis]
        if size == 1:
            return Pending((), what)
        work = dist.all_reduce(t, op=self.grad_op if op is None else op, group=group, async_op=True)
        return Pending((work,), what)

    def broadcast(self, t: torch.Tensor, what: str) -> Pending:
        """Rank 0's `t` on every rank."""
        if self.mesh.world_size == 1:
            return Pending((), what)
        return Pending((dist.broadcast(t, src=0, async_op=True),), what)

    def wait(self, pending: Pending, consume: bool = True) -> None:
        """Make the current stream (on gloo, the host) wait for `pending`; `consume`: for its
        consumer, after which it is dropped (a finished Work still references its tensors)."""
        works = pending.works
        if consume:
            pending.works = ()
        for work in works:
            self._wait_one(work, pending.what)

    def _wait_one(self, work: dist.Work | StreamWork, what: str) -> None:
        if not self._gloo or isinstance(work, StreamWork):
            work.wait()
            return
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            what = what.format(step=self.step())
            # A late or dead peer shows as a timeout or a broken connection; any other failure
            # is this rank's own (a bad buffer), and "timeout" would misname it.
            if not any(k in str(e).lower() for k in _PEER_TROUBLE):
                raise CollectiveError(f"{what} failed: {e}") from e
            raise CollectiveTimeoutError(
                f"{what} did not complete within {self.timeout.total_seconds():g}s: a "
                "peer rank is missing, crashed or used its weights in another order "
                f"(raise GTPPolicy.collective_timeout_s if the peers are just slow). Cause: {e}"
            ) from e

    def abandon(self, pending: Pending) -> None:
        """Drop a collective no one will consume. A copy-engine collective is still waited for
        (a stream wait, no host sync): its inputs are freed with it and must not be reused
        under its copies. NCCL's Work guards its own inputs; gloo's wait would block on what
        may never come."""
        if any(isinstance(work, StreamWork) for work in pending.works):
            self.wait(pending)

    def exchange(self, purpose: str, values: list[int]) -> list[list[int]]:
        """Every world rank's `values`, through the store rather than a collective.

        Note: agreement checks run exactly when ranks may have diverged. A collective issued for
        the check could pair with a peer's stray gather and hang or mix data; the rendezvous
        store is a separate channel, so a missing peer ends in a timeout, never a mix-up.
        """
        if self.mesh.world_size == 1:
            return [values]
        self._exchanges += 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"gtp_wrap/{self._tag}/{purpose}/{self._exchanges}"
        store.set(f"{prefix}/{dist.get_rank()}", ",".join(map(str, values)))
        keys = [f"{prefix}/{r}" for r in range(dist.get_world_size())]
        try:
            store.wait(keys, self.timeout)
        except RuntimeError as e:
            raise CollectiveTimeoutError(
                f"ranks did not all reach the '{purpose}' check within "
                f"{self.timeout.total_seconds():g}s: a peer rank is missing or stuck. Cause: {e}"
            ) from e
        out = []
        for key in keys:
            raw = store.get(key).decode()
            out.append([int(v) for v in raw.split(",")] if raw else [])
        # Every rank set this exchange's key after reading all of the previous one's, so no
        # one reads this rank's previous key anymore: the store keeps two exchanges, not all.
        if self._exchanges > 1:
            store.delete_key(f"gtp_wrap/{self._tag}/{self._previous}/{dist.get_rank()}")
        self._previous = f"{purpose}/{self._exchanges}"
        return out


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's hash() is salted per process)."""
    return zlib.crc32(text.encode())
