"""Collectives, with timeouts that name what was waited for.

Every collective is issued asynchronously and completed through `Comm.wait`, the one place that
turns a stuck collective into an error naming why (comm/watch.py: a peer that failed or
diverged within seconds, else CollectiveTimeoutError). On NCCL, `Work.wait()` only makes the
current stream wait (no host sync), and a timed wait would block the host, so the process
group's own timeout (its watchdog) applies there instead.

[Note: NCCL's stream is the side stream] The "side stream" of the design is NCCL's own. An async
collective runs on the process group's internal stream after waiting for the work already queued on
the current stream (so a gather never overwrites a buffer an earlier kernel still reads), and
`wait()` makes the current stream wait for it with an event. A prefetch issued before the current
use's GEMM is queued therefore runs under that GEMM, with no stream or event management of our own.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    GTPError,
    PeerFailedError,
    PeerLostError,
    PolicyError,
)
from ..mesh import GTPMesh, MeshAxis
from . import copy_engine
from .agreement import Agreement
from .copy_engine import CopyEngineCollectives, StreamWork
from .watch import Blocked, Watch, group_key, work_wait

_MIN_WORKSPACE = 16 << 20  # bytes of copy-engine workspace, whatever group_numel says


@dataclasses.dataclass
class Pending:
    """An issued collective (on gloo, a group's collectives) and a description of it for error
    messages: `what`, with `{context}` and `{step}` filled in only when something goes wrong
    (descriptions are made once per weight at wrap time, not per use). `where` is its group
    and `number` its first Work's number on that group, for comm/watch.py."""

    works: tuple[dist.Work | StreamWork, ...]
    what: str
    context: str = ""
    where: str = ""
    number: int = 0
    step: int = 0  # the step it was issued in

    def describe(self) -> str:
        return self.what.format(context=self.context, step=self.step)


# How gloo words a peer that is late or gone ("Operation timed out!", "Application timeout
# caused pair closure", "Connection closed by peer", "Broken pipe", "Connection refused").
_PEER_TROUBLE = ("timed out", "timeout", "peer", "pair closure", "broken pipe", "connection")


class Comm:
    """The collectives of one engine: gathers and reduce-scatters over the GTP group,
    all-reduces over the dp group and over the world. With `gather_copies` and
    `reduce_copies` set, gathers and reduce-scatters go through those instead of the process
    group."""

    def __init__(
        self, mesh: GTPMesh, timeout_s: float, average: bool, step: Callable[[], int], watch: Watch
    ) -> None:
        self.mesh = mesh
        self.watch = watch
        # Each role's process group as the watch numbers its collectives.
        axes = (mesh.gtp, mesh.dp, mesh.tp, mesh.data, mesh.world, mesh.egtp, mesh.ep, mesh.edp,
                mesh.replicated)  # fmt: skip
        self._where = {a.name: group_key(a.group) for a in axes if a.size > 1}
        self.gtp = mesh.gtp
        self.gather_copies: CopyEngineCollectives | None = None
        self.reduce_copies: CopyEngineCollectives | None = None
        # Gradient reductions average (the mean over data ranks, applied once per axis by the
        # collective itself: no extra scaling kernel) or sum, as the policy says.
        self.grad_op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        self._rs_opts = dist.ReduceScatterOptions()
        self._rs_opts.reduceOp = dist.ReduceOp(self.grad_op)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # Gloo differs twice. Its waits block the host, so they take our timeout. And a group
        # is issued there one collective per weight: a gloo Work keeps its outputs referenced
        # until dropped, and one Work shared by a group would keep every buffer of the group
        # looking in use (buffers.py waits for that reference to go) until its last weight is
        # used. On CPU the grouping saves nothing anyway.
        self._gloo = mesh.gtp.group is not None and dist.get_backend() == "gloo"
        self._step = step  # error messages name the step they happened in

    def use_copy_engine(self, agreement: Agreement, device: torch.device, group_numel: int) -> None:
        """Move gathers and reduce-scatters as copy-engine memcpys (policy `collectives:
        copy_engine`), through workspaces of their own.

        Every rank says first whether it can (through the store): setting up a workspace is a
        collective of its own, which a rank that cannot would leave its peers waiting in.

        [Note: two copy-engine streams] Gathers and reduce-scatters get a stream and a
        workspace each, so a backward gather, which a GEMM waits for, never queues behind a
        reduce-scatter, which only the next group's finalize waits for. (NCCL runs both on
        one stream.)
        """
        reason = copy_engine.unsupported(device)
        verdicts = agreement.exchange(
            "copy-engine", [int(reason is None)], "the check that every rank can use copy engines"
        )
        unable = [rank for rank, (ok,) in enumerate(verdicts) if not ok]
        if unable:
            raise PolicyError(
                reason
                or f"collectives: copy_engine cannot run on rank(s) {unable}: their devices "
                "have no CUDA symmetric memory; use collectives: process_group"
            )

        def make(nbytes: int) -> CopyEngineCollectives:
            return CopyEngineCollectives(
                self.gtp.group,  # type: ignore[arg-type]
                device,
                nbytes=max(nbytes, _MIN_WORKSPACE),
                timeout_s=self.timeout.total_seconds(),
            )

        # Sized so that, on two ranks, one round moves a group of up to 2 x group_numel
        # elements: this rank's half of its bf16 weights, the peer's half of its fp32
        # gradients.
        self.gather_copies = make(2 * group_numel)
        self.reduce_copies = make(4 * group_numel)

    @property
    def host_waits(self) -> bool:
        """Whether a wait blocks the host (gloo), where a value can be read back at once and a
        stuck wait is watched (comm/watch.py); NCCL's waits only order streams."""
        return self._gloo

    def all_gather(
        self,
        axis: MeshAxis,
        outs: list[torch.Tensor],
        owns: list[torch.Tensor],
        shards: list[torch.Tensor],
        what: str,
        context: str = "",
    ) -> list[Pending]:
        """Gather each shard into its output over `axis` (the weights' mesh role), all in one
        collective (one grouped NCCL launch); a shard of another dtype than its output is cast
        on the way, into the output's part of this rank (`owns`: views made once by the
        caller), and gathered in place. Copy-engine collectives, where set up, serve the gtp
        role.

        [Note: a Pending per output] Each output gets its own Pending, waited for by whoever uses
        that output: on NCCL a wait orders only the calling stream, so one wait for the group would
        not cover an output used later on another stream. On NCCL they share the group's one Work.
        (A GTP group of one gathers nothing: the engine reads its local copy instead.)
        """
        if self.gather_copies is not None and axis is self.mesh.gtp:  # casts on its own stream
            copies = self.gather_copies.all_gather(outs, shards)
            return [Pending((copies,), what, context) for _ in outs]
        # A group's shards are cast into their outputs by one multi-tensor copy: on a GPU one
        # kernel launch per collective, not one per weight.
        casts = [(own, s) for own, s in zip(owns, shards) if s.dtype != own.dtype]
        if casts:
            torch._foreach_copy_([own for own, _ in casts], [s for _, s in casts])
            shards = [own if s.dtype != own.dtype else s for own, s in zip(owns, shards)]
        # The ProcessGroup's own methods: the torch.distributed wrappers add ~25 us of Python
        # checks per call, paid on every weight use.
        group = axis.group
        assert group is not None  # a group of one gathers nothing
        if len(outs) > 1 and not self._gloo:
            work = group.allgather_into_tensor_coalesced(outs, shards)
            return self._issued(axis, (work,), what, context, outputs=len(outs))
        return [
            self._issued(axis, (group._allgather_base(out, shard),), what, context)[0]
            for out, shard in zip(outs, shards)
        ]

    def _issued(
        self,
        axis: MeshAxis,
        works: tuple[dist.Work, ...],
        what: str,
        context: str = "",
        outputs: int = 1,
    ) -> list[Pending]:
        """`outputs` Pendings of `works` just issued over `axis`; on gloo, whose waits block
        the host and are watched, numbered on its group and remembered for comm/watch.py."""
        if not self._gloo:
            return [Pending(works, what, context) for _ in range(outputs)]
        where, step = self._where[axis.name], self._step()
        number = self.watch.record(where, len(works), what, context, step)
        return [Pending(works, what, context, where, number, step) for _ in range(outputs)]

    def reduce_scatter(
        self, axis: MeshAxis, outs: list[torch.Tensor], fulls: list[torch.Tensor], what: str
    ) -> Pending:
        """Reduce each full tensor over `axis` and scatter it into its output, all in one
        collective."""
        if axis.size == 1:
            for out, full in zip(outs, fulls):
                out.copy_(full)
            return Pending((), what)
        if self.reduce_copies is not None and axis is self.mesh.gtp:
            average = self.grad_op == dist.ReduceOp.AVG
            return Pending((self.reduce_copies.reduce_scatter(outs, fulls, average),), what)
        group, opts = axis.group, self._rs_opts
        assert group is not None
        if len(outs) > 1 and not self._gloo:
            work = group.reduce_scatter_tensor_coalesced(outs, fulls, opts)
            return self._issued(axis, (work,), what)[0]
        works = tuple(group._reduce_scatter_base(o, f, opts) for o, f in zip(outs, fulls))
        return self._issued(axis, works, what)[0]

    def workspace_bytes(self, outside_allocator: bool = False) -> int:
        """Memory of the copy-engine workspaces (symmetric memory); with `outside_allocator`,
        only what `torch.cuda.max_memory_allocated` does not count."""
        copies = (c for c in (self.gather_copies, self.reduce_copies) if c is not None)
        return sum(c.nbytes for c in copies if c.outside_allocator or not outside_allocator)

    def all_reduce(self, t: torch.Tensor, axis: MeshAxis, what: str, op: Any = None) -> Pending:
        """Reduce `t` over one mesh axis; by default with the gradient reduction (mean or sum)."""
        if axis.size == 1:
            return Pending((), what)
        op = self.grad_op if op is None else op
        work = dist.all_reduce(t, op=op, group=axis.group, async_op=True)
        return self._issued(axis, (work,), what)[0]

    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        recvs: list[int] | None,
        sends: list[int] | None,
        axis: MeshAxis,
        what: str,
    ) -> Pending:
        """Rows of `inp` in blocks of `sends` to each rank of `axis`, `recvs` from each into
        `out` (None: equal blocks)."""
        work = dist.all_to_all_single(out, inp, recvs, sends, group=axis.group, async_op=True)
        return self._issued(axis, (work,), what)[0]  # type: ignore[arg-type]

    def broadcast(self, t: torch.Tensor, what: str, axis: MeshAxis | None = None) -> Pending:
        """The `t` of the first rank of `axis` (default: the world) on every rank of it."""
        axis = axis or self.mesh.world
        if axis.size == 1:
            return Pending((), what)
        src = 0 if axis.group is None else dist.get_global_rank(axis.group, 0)
        work = dist.broadcast(t, src=src, group=axis.group, async_op=True)
        return self._issued(axis, (work,), what)[0]

    def wait(self, pending: Pending, consume: bool = True) -> None:
        """Make the current stream (on gloo, the host) wait for `pending`; `consume`: for its
        consumer, after which it is dropped (a finished Work still references its tensors)."""
        works = pending.works
        if consume:
            pending.works = ()
        if not self._gloo:  # a stream wait: nothing blocks the host, nothing to watch
            for work in works:
                work.wait()
            return
        for i, work in enumerate(works):
            self._wait_one(work, pending, pending.number + i)

    def _wait_one(self, work: dist.Work | StreamWork, pending: Pending, number: int) -> None:
        if isinstance(work, StreamWork):
            work.wait()
            return

        def blocked() -> Blocked:
            return self.watch.blocked("collective", pending.where, number, pending.describe())

        def timed_out(seconds: float) -> CollectiveTimeoutError:
            return CollectiveTimeoutError(
                f"{pending.describe()} did not complete within {seconds:g}s: a peer rank is "
                "missing or stuck (raise GTPPolicy.collective_timeout_s if the peers are just "
                "slow)"
            )

        try:
            self.watch.wait(work_wait(work), blocked, timed_out)
        except RuntimeError as e:
            if isinstance(e, GTPError):
                raise
            raise wait_failure(e, pending.describe(), self.watch.peer_failure()) from e

    def abandon(self, pending: Pending) -> None:
        """Drop a collective no one will consume. A copy-engine collective is still waited for
        (a stream wait, no host sync): its inputs are freed with it and must not be reused
        under its copies. NCCL's Work guards its own inputs; gloo's wait would block on what
        may never come."""
        if any(isinstance(work, StreamWork) for work in pending.works):
            self.wait(pending)


def wait_failure(
    error: RuntimeError, what: str, peer_failure: PeerFailedError | None = None
) -> CollectiveError | CollectiveTimeoutError:
    """The error to raise for a gloo wait that failed with `error`: a dead peer shows as a
    broken connection (named by its posted failure, where it posted one); any other failure is
    this rank's own (a bad buffer), and blaming a peer would misname it."""
    if not any(k in str(error).lower() for k in _PEER_TROUBLE):
        return CollectiveError(f"{what} failed: {error}")
    if peer_failure is not None:
        return PeerFailedError(f"{what} failed: {peer_failure}")
    if any(k in str(error).lower() for k in ("timed out", "timeout")):
        return CollectiveTimeoutError(
            f"{what} failed: a peer rank did not answer in time (it is stuck, or gone without "
            f"closing its connection). Cause: {error}"
        )
    return PeerLostError(
        f"{what} failed: a peer rank closed its connection (it exited or crashed; its own log "
        f"says why). Cause: {error}"
    )
