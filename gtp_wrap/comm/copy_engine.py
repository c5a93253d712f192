"""Gathers and reduce-scatters as memcpys over NVLink (the GPUs' copy engines), not NCCL kernels.

[Note: why copy engines] An NCCL collective is a kernel: it occupies SMs for as long as it runs, and
the GEMMs it overlaps run on what is left. On 2xH200 one layer's GEMMs ran 1.62x slower beside NCCL
all-gathers than alone, and 1.03x beside peer copies (benchmarks/contention.py), which the copy
engines carry without SMs. In the graphed 1.36B batch-1 step that slowdown cost ~8 ms: GEMM time per
step was 34.1 ms beside NCCL, 26.8 ms beside these collectives, 25.7 ms in the floor. (Not every
memcpy stays off the SMs: in that step the driver ran about 240 of them as small `memcpy128`
kernels, ~4 ms in all: the gathers' same-GPU copies, which `copy_kernels.py` now folds into the
cast.)

How. Every rank of the GTP group allocates one workspace in symmetric memory
(`torch.distributed._symmetric_memory`): each rank can address its peers' workspaces, and a
barrier is a tiny kernel on signal pads, so the whole collective is stream-ordered work that a
CUDA graph captures like any other. A collective runs in rounds on the instance's side stream
(the engine keeps one instance for gathers and one for reduce-scatters):

- all-gather (pull): write this rank's chunk into its own workspace, and into its own output
  unless it is there already (casting it, when the engine hands over the fp32 shard of a bf16
  gather); barrier (every chunk is there); copy each peer's chunk out of the peer's workspace
  into the output; barrier (no peer reads this workspace anymore, so the next round may
  overwrite it).
- reduce-scatter (push, then reduce): barrier (every rank is done reading its workspace);
  copy the part of each full gradient that a peer owns into that peer's workspace, at this
  rank's row; barrier (every part has arrived); reduce the rows of this rank's workspace with
  its own part of the gradient into its shard (on two ranks one SM kernel per piece).

The SM work (the double write, the reduction) runs as fused Triton kernels where it can
(`copy_kernels.py`).

A round carries as many bytes as the workspace holds; larger groups take more rounds, so the
workspace bounds the memory, not the largest weight. Work is ordered with the compute stream
through events: the side stream waits for what the compute stream queued before the issue, and
a consumer waits for the collective's event (`StreamWork.wait`), just as with NCCL's own
stream. The gradients a reduce-scatter reads are kept alive until that wait, so the allocator
never reuses them under a running copy (a gather's sends are shard slots, which outlive it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist

from ..errors import PolicyError
from . import copy_kernels

_ALIGN = 128  # bytes: every piece starts on this boundary in the workspace and in its tensor


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Bytes [start, start + nbytes) of tensor `index`, at `offset` in a round's workspace."""

    index: int
    start: int
    nbytes: int
    offset: int


def plan_rounds(sizes: list[int], capacity: int) -> list[list[_Piece]]:
    """Split tensors of `sizes` bytes into rounds of pieces that each fit `capacity` bytes.

    Pieces are packed in order; a tensor larger than what is left of a round is cut at an
    aligned boundary and continues in the next round.
    """
    if capacity < _ALIGN:
        raise ValueError(f"a round holds at least {_ALIGN} bytes, got capacity={capacity}")
    rounds: list[list[_Piece]] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            room = capacity - used
            if room < _ALIGN:
                rounds.append([])
                used, room = 0, capacity
            nbytes = min(size - start, room // _ALIGN * _ALIGN)
            rounds[-1].append(_Piece(index, start, nbytes, used))
            used += math.ceil(nbytes / _ALIGN) * _ALIGN
            start += nbytes
    return [r for r in rounds if r]


@functools.lru_cache(maxsize=1024)
def _plan(sizes: tuple[int, ...], capacity: int) -> list[list[_Piece]]:
    """`plan_rounds`, made once per group shape: a chain's groups are the same every step."""
    return plan_rounds(list(sizes), capacity)


def unsupported(device: torch.device) -> str | None:
    """Why this rank cannot run copy-engine collectives, or None when it can."""
    if device.type != "cuda":
        return (
            "collectives: copy_engine moves data between GPUs over NVLink; on "
            f"{device.type} use collectives: process_group"
        )
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return (
            "collectives: copy_engine needs torch.distributed._symmetric_memory, which this "
            f"torch build lacks ({e}); use collectives: process_group"
        )
    return None


class StreamWork:
    """A collective queued on a copy-engine stream; `wait` orders the device's current stream
    after it.

    Duck-types `dist.Work` for `Comm.wait`. Holds the tensors the collective reads until then.
    """

    def __init__(
        self, event: torch.cuda.Event, device: torch.device, keep: tuple[torch.Tensor, ...]
    ) -> None:
        self._event = event
        self._device = device
        self._keep = keep

    def wait(self) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        self._keep = ()
        return True


@dataclasses.dataclass(frozen=True)
class _Reduce:
    """This rank's part of one reduce-scatter piece, from the rows its peers pushed."""

    out: torch.Tensor
    own: torch.Tensor  # this rank's own part of the full gradient, where it is
    rows: torch.Tensor  # (rows, numel) strided view of the workspace
    average: bool

    def run(self) -> None:
        """One rounding, as NCCL's two-rank sum (and its exact halving for the mean); strided
        views, so no allocation."""
        if self.rows.shape[0] == 1:  # two ranks: the peer's row, and this rank's own part
            copy_kernels.sum_into(self.out, self.own, self.rows[0], self.average)
        elif self.average:
            torch.mean(self.rows, dim=0, out=self.out)
        else:
            torch.sum(self.rows, dim=0, out=self.out)


@dataclasses.dataclass(frozen=True)
class _WriteTwice:
    """This rank's part of a gather piece, cast into the workspace and into its own output."""

    src: torch.Tensor
    workspace: torch.Tensor
    own: torch.Tensor

    def run(self) -> None:
        copy_kernels.write_twice(self.src, self.workspace, self.own)


# A collective is planned as a list of steps, then queued: a (destination, source) copy, a
# reduction or a double write, or _BARRIER. Planning makes every view first, so an error raises
# before any barrier is queued: a rank that queued fewer barriers than its peers would pair
# every later barrier wrongly.
_BARRIER = None
_Step = tuple[torch.Tensor, torch.Tensor] | _Reduce | _WriteTwice | None


class CopyEngineCollectives:
    """All-gathers and reduce-scatters over one GTP group, through a symmetric workspace."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, nbytes: int, timeout_s: float
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.world = group.size()
        if self.world < 2:
            raise ValueError("copy-engine collectives need a group of two or more ranks")
        # A reduce-scatter's workspace holds one row per peer, and on more than two ranks one
        # for this rank's own part too, so that one reduction rounds once.
        self._rows = 1 if self.world == 2 else self.world
        nbytes = max(nbytes, self._rows * _ALIGN) // _ALIGN * _ALIGN
        try:
            before = torch.cuda.memory_allocated(device)
            self._local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            # Whether the caching allocator counts symmetric memory depends on the torch
            # version (2.11 did not): memory reports add what it leaves out.
            self.outside_allocator = torch.cuda.memory_allocated(device) - before < nbytes
            self._handle = symm_mem.rendezvous(self._local, group.group_name)
        except RuntimeError as e:
            raise PolicyError(
                "collectives: copy_engine needs CUDA symmetric memory between the GPUs of the "
                "GTP group (one host, peer access over NVLink); it could not be set up, so use "
                f"collectives: process_group. Cause: {e}"
            ) from e
        self.nbytes = nbytes
        self.rank = self._handle.rank
        self._device = device
        # [Note: barrier timeout] A barrier that waits longer than this traps on the GPU (torch's
        # symmetric memory has no softer way out): the process dies with a CUDA error, where NCCL's
        # watchdog would raise.
        self._timeout_ms = int(timeout_s * 1000)
        self._stream = torch.cuda.Stream(device)
        # Views of the workspaces, made once per (rank, offset, numel, dtype): a group's pieces
        # are the same every step.
        self._views: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}

    def _view(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rank, offset, numel, dtype)
        view = self._views.get(key)
        if view is None:
            size = dtype.itemsize
            view = self._handle.get_buffer(rank, (numel,), dtype, offset // size)
            self._views[key] = view
        return view

    def _queue(self, steps: list[_Step], keep: tuple[torch.Tensor, ...]) -> StreamWork:
        """Queue the planned steps on the copy-engine stream, after the device's current
        stream's queued work."""
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            for step in steps:
                if step is _BARRIER:
                    self._handle.barrier(channel=0, timeout_ms=self._timeout_ms)
                elif isinstance(step, tuple):
                    step[0].copy_(step[1])
                else:
                    step.run()
            event = torch.cuda.Event()
            event.record()
        return StreamWork(event, self._device, keep)

    def all_gather(self, outs: list[torch.Tensor], sends: list[torch.Tensor]) -> StreamWork:
        """Gather each rank's `sends[i]` into `outs[i]` (rank-major), all in one collective.

        A send may have another dtype than its output: it is cast on this stream, on its way
        into the workspace. A send may be this rank's part of its output (an in-place gather):
        then it is not copied there again. Sends must outlive the collective unmodified (the
        engine's are shard slots, which change only between passes, after every gather of the
        pass was waited for), so none is held here.
        """
        me, world = self.rank, self.world
        steps: list[_Step] = []
        owns = [out.view(world, -1)[me] for out in outs]
        for i, (own, send) in enumerate(zip(owns, sends)):
            if send.numel() != own.numel():
                raise ValueError(
                    f"all_gather: send {i} has {send.numel()} elements, its output "
                    f"{world} x {own.numel()}"
                )
        inplace = [own.data_ptr() == send.data_ptr() for own, send in zip(owns, sends)]
        sizes = tuple(own.numel() * own.element_size() for own in owns)
        for pieces in _plan(sizes, self.nbytes):
            for p in pieces:
                own = _bytes(owns[p.index], p)
                send = _elements_like(sends[p.index], own, p)
                workspace = self._view(me, p.offset, own.numel(), own.dtype)
                steps.append(
                    (workspace, send) if inplace[p.index] else _WriteTwice(send, workspace, own)
                )
            steps.append(_BARRIER)
            for p in pieces:
                chunks = outs[p.index].view(world, -1)
                for r in range(world):
                    if r != me:
                        dst = _bytes(chunks[r], p)
                        steps.append((dst, self._view(r, p.offset, dst.numel(), dst.dtype)))
            steps.append(_BARRIER)
        return self._queue(steps, keep=())

    def reduce_scatter(
        self, outs: list[torch.Tensor], fulls: list[torch.Tensor], average: bool
    ) -> StreamWork:
        """Sum (or average) each `fulls[i]` over the ranks and keep this rank's chunk in
        `outs[i]`, all in one collective.

        The row of source rank `src` in rank `dst`'s workspace is `(src - dst - 1) % world`;
        on more than two ranks, row `world - 1` holds this rank's own part.
        """
        me, world, nrows = self.rank, self.world, self._rows
        row = self.nbytes // nrows // _ALIGN * _ALIGN
        steps: list[_Step] = []
        sizes = tuple(o.numel() * o.element_size() for o in outs)
        for pieces in _plan(sizes, row):
            steps.append(_BARRIER)
            reductions = []
            for p in pieces:
                chunks = fulls[p.index].view(world, -1)
                out, own = _bytes(outs[p.index], p), _bytes(chunks[me], p)
                n, dtype = out.numel(), out.dtype
                for r in range(world):
                    if r != me:
                        src = _bytes(chunks[r], p)
                        at = (me - r - 1) % world * row + p.offset
                        steps.append((self._view(r, at, n, dtype), src))
                if nrows == world:
                    steps.append((self._view(me, (world - 1) * row + p.offset, n, dtype), own))
                first = p.offset // dtype.itemsize
                rows = self._local[: nrows * row].view(dtype).view(nrows, -1)
                reductions.append(_Reduce(out, own, rows[:, first : first + n], average))
            steps.append(_BARRIER)
            steps.extend(reductions)
        return self._queue(steps, keep=tuple(fulls))


def _bytes(t: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The elements of flat `t` that a piece's byte range covers."""
    size = t.element_size()
    return t.view(-1)[piece.start // size : (piece.start + piece.nbytes) // size]


def _elements_like(send: torch.Tensor, own: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The elements of flat `send` at the positions that `own`'s piece covers (a send of
    another dtype than its output is planned in the output's bytes)."""
    first = piece.start // own.element_size()
    return send.view(-1)[first : first + own.numel()]
