"""Gathers: the full weight for each use of the current pass, prefetched along its chain, and
re-gathered in backward for what autograd saved (rematerialization).

The first use of a chain group issues the next group's gathers (`prefetch_depth` groups
ahead); only the chain head blocks. A use the chain did not expect marks the pass diverged: the
gathers in flight are drained (every rank issued the same ones, because they followed the same
chain) and the pass gathers synchronously and records anew. Autograd never keeps a gathered
weight between forward and backward: what it saves of one is packed as a `SavedWeightView`
and gathered again when backward unpacks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..core.parameter import GTPParameter
from ..core.weight import CastWeight, ShardedWeight, describe_group
from ..errors import ChainMismatchError
from ..precision.encoding import Precision
from .buffers import GatherBufferPool
from .chain import Gather, PassKind, PassState
from .part import Part, Shared
from .passes import SAME_ORDER


@dataclasses.dataclass(frozen=True)
class SavedWeightView:
    """What autograd keeps instead of a gathered weight: enough to re-gather it in backward."""

    weight: ShardedWeight
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int | torch.SymInt


@dataclasses.dataclass(frozen=True)
class BlockMembers:
    """The managed parameters of a block run on gathered weights, each once, in the block's
    order, and what each call needs of them: fixed when the block is set up, not per call."""

    params: tuple[GTPParameter, ...]
    weights: tuple[ShardedWeight | CastWeight, ...]
    sharded: tuple[ShardedWeight, ...]  # what a call gathers again in backward, in order
    position: dict[int, int]  # a sharded weight's index -> its place in `sharded`
    # Each parameter's own dtype, which autograd accumulates its gradient in.
    grad_dtypes: tuple[torch.dtype, ...]
    # What each use reads when no weight needs a gather (groups of one): the local copies,
    # fixed at wrap; else None.
    locals: tuple[torch.Tensor, ...] | None
    # Whether each use reads a gathered buffer through a view made for it (a weight sharded
    # over more than one rank), rather than a tensor that persists across calls.
    gathered: tuple[bool, ...]
    tp: bool  # whether any is a tensor-parallel weight, used as its DTensor

    @classmethod
    def of(cls, params: list[GTPParameter]) -> BlockMembers:
        weights = tuple(p.gtp_weight for p in params)
        sharded = tuple(w for w in weights if isinstance(w, ShardedWeight))
        position = {w.index: i for i, w in enumerate(sharded)}
        with torch._C.DisableTorchFunctionSubclass():  # the shard's dtype, not the use's
            grad_dtypes = tuple(p.dtype for p in params)
        local = all(w.axis.size == 1 for w in sharded)
        locals_ = tuple(w.local if isinstance(w, ShardedWeight) else w.cast for w in weights)
        gathered = tuple(isinstance(w, ShardedWeight) and w.axis.size > 1 for w in weights)
        tp = any(w.tp is not None for w in weights)
        return cls(tuple(params), weights, sharded, position, grad_dtypes,
                   locals_ if local else None, gathered, tp)  # fmt: skip


@dataclasses.dataclass
class BlockCall:
    """The sharded weights of one call of a block run on gathered weights, re-gathered together
    in backward.

    [Note: a block's weights come back together] Inside a block, how often and in what order
    autograd saves views of its weights can depend on the data: a mixture of experts saves a
    view for each expert that got tokens, and which those are differs between ranks. Gathering
    each saved view on its own in backward would then issue different gathers on different
    ranks. So the first view of the block unpacked in a backward gathers all of the block's
    weights, in the block's order, whichever it saved, and every later view in that backward is
    a view of those; they are held until as many views as forward saved are unpacked, or the
    backward ends. A second backward through the same graph (retain_graph) gathers them once
    again. Every rank then issues the same gathers, as FSDP2 does per block, as long as each
    rank's call saved some view of its weights. Two cases break that, and need the block's
    code to agree across ranks: a block on an empty batch on one rank (it saves nothing, its
    peers' gathers find no partner), and a checkpoint inside the block (its recompute in
    backward reads the parameters through per-use gathers, one per weight it touches: put the
    checkpoint around the whole block instead).
    """

    members: BlockMembers
    saved: int = 0  # views forward saved
    fulls: list[torch.Tensor] | None = None  # the weights gathered again, while views remain
    task: int = -1  # the backward (autograd graph task) that gathered `fulls`
    unpacked: int = 0  # views unpacked in that backward


@dataclasses.dataclass(frozen=True)
class SavedBlockView:
    """A saved view of a weight of a block call (see [Note: a block's weights come back
    together])."""

    call: BlockCall
    place: int
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int | torch.SymInt


@dataclasses.dataclass(frozen=True)
class SavedDTensorView:
    """What autograd keeps instead of a DTensor over a gathered weight (a tensor-parallel
    weight's, or a view of it): its local view's record and its own DTensor layout."""

    local: SavedWeightView | SavedBlockView
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    size: torch.Size
    stride: tuple[int, ...]


_CONTEXT = {kind: f"{kind.label}, " for kind in PassKind}  # for error descriptions
_SAVED_VIEWS = frozenset({SavedWeightView, SavedBlockView, SavedDTensorView})


def _is_whole(saved: SavedWeightView | SavedBlockView, full: torch.Tensor) -> bool:
    """Whether a saved view is the whole gathered weight `full`, laid out as it is."""
    return (
        saved.storage_offset == full.storage_offset()
        and saved.size == full.shape
        and saved.stride == full.stride()
    )


class Gatherer(Part):
    """Issues, prefetches and completes the gathers of one engine's passes."""

    def __init__(self, shared: Shared, precision: Precision, prefetch_depth: int) -> None:
        super().__init__(shared)
        self.precision = precision
        self.depth = prefetch_depth
        # Whether every weight is sharded over a group of one, which reads its local copy.
        self.local = all(w.axis.size == 1 for w in self.weights)
        # [Note: graphed buffers] Graphed regions gather into buffers of their own. A graph
        # keeps the addresses it was captured with, so handing one of its buffers to an eager
        # pass would let a replay overwrite it. Replays never overlap each other, so all
        # regions share one pool.
        self.eager = GatherBufferPool(self.device)
        self.graphed = GatherBufferPool(self.device)
        self.pool = self.eager
        self.experts = self.comm.mesh.egtp  # the axis expert stacks are sharded over
        self.block_call: BlockCall | None = None  # the block whose forward runs now, if any
        self._held: list[BlockCall] = []  # block calls holding weights gathered in backward
        self._recomputed: dict[int, torch.Tensor] = {}  # see `keep_recomputed`

    def gather(self, w: ShardedWeight, packed: bool = False) -> torch.Tensor:
        """The logical full weight of `w`, gathered for one use of the current pass (with
        `packed`, the gathered FP8 slots as they came, for the FP8 GEMM)."""
        if w.axis.size == 1:
            return w.local
        state = self.passes.stack[-1]
        if state.expects(w.index):
            position = state.cursor
            state.cursor += 1
            blocking = not state.inflight  # the chain head: its group is issued now
            if blocking:
                self._issue_group(state, state.chain.rest_of_group(position))  # type: ignore[union-attr]
            gather = state.inflight.popleft()
            while (group := state.next_to_prefetch(self.depth)) is not None:
                self._issue_group(state, group)
        else:
            if state.chain is not None and not state.diverged:
                state.diverged = True
                self.drain(state)
                self.passes.agree_to_diverge(state, w.index)
            elif self.comm.host_waits:
                self._agree_on_use(state, w)
            (gather,) = self._issue(state, [w])
            blocking = True
        state.recorded.append(w.index)
        return self._complete(gather, state, blocking, packed)

    def _agree_on_use(self, state: PassState, w: ShardedWeight) -> None:
        """Before a gather no chain planned (a pass recording its chain, or one that left it):
        every rank of the weight's group gathers this weight, or all raise.

        [Note: unplanned gathers agree first] Without a chain each use gathers its weight on
        its own, so a rank that took another branch (a layer skipped on one rank in the first
        step) pairs its gather with a peer's gather of another weight; where the two differ in
        size gloo aborts both processes before the pass-end check could name them. A small
        all-reduce of the weight's index comes first, the same size on every rank: where the
        indices differ every rank raises at once. Only where waits block the host (gloo),
        where the result is read back at once and a peer that never comes is watched; only
        for unplanned gathers, so steady steps never pay for it."""
        seen = torch.tensor([w.index, -w.index], device=self.device)
        which = self.passes.describe(state)
        what = f"the check that every rank gathers the same weight next in {which}"
        self.comm.wait(self.comm.all_reduce(seen, w.axis, what, dist.ReduceOp.MAX))
        highest, lowest = (int(v) for v in seen.tolist())
        lowest = -lowest
        if highest == lowest == w.index:
            return
        other = self.weights[highest if highest != w.index else lowest]
        raise ChainMismatchError(
            f"ranks gathered different weights at use #{len(state.recorded)} of "
            f"{which}: this rank '{w.fqn}', another '{other.fqn}'. {SAME_ORDER}"
        )

    def _issue_group(self, state: PassState, positions: range) -> None:
        """Issue the gathers of these consecutive chain positions as one collective."""
        order = state.chain.order  # type: ignore[union-attr]
        state.inflight.extend(self._issue(state, [self.weights[order[p]] for p in positions]))

    def _issue(self, state: PassState, weights: list[ShardedWeight]) -> list[Gather]:
        """Gather `weights` in one collective."""
        bufs, sends = [], []
        for w in weights:
            enc = w.encoding  # FP8 slots are dequantized when consumed
            geo = w.geometry
            buf = self.pool.reserve(geo.world * enc.send.numel(), enc.dtype, geo.rank, geo.world)
            buf.owner = w
            bufs.append(buf)
            sends.append(enc.send)
            self.stats.bytes_gathered += buf.nbytes
        context = _CONTEXT[state.kind]
        what = describe_group(weights, "all-gather of", weights[0].what_gather, context)
        axis = weights[0].axis  # a chain group's weights share it (Chain.build)
        outs, owns = [b.tensor for b in bufs], [b.own for b in bufs]
        pendings = self.comm.all_gather(axis, outs, owns, sends, what, context)
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, self.total_bytes())
        self.stats.gathers += len(weights)
        return [Gather(w, buf, pending) for w, buf, pending in zip(weights, bufs, pendings)]

    def _complete(
        self, gather: Gather, state: PassState, blocking: bool, packed: bool
    ) -> torch.Tensor:
        try:
            self.comm.wait(gather.pending)
        except BaseException:
            state.inflight.appendleft(gather)  # abandoned with the rest when the pass fails
            raise
        buf, w = gather.buffer, gather.weight
        geo = w.geometry
        if w.encoding.decodes and not packed:
            dtype = self.precision.compute_dtype(geo.dtype)
            out = self.pool.reserve(geo.gathered_numel, dtype, geo.rank, geo.world)
            out.owner = w
            w.encoding.decode_into(buf.tensor, out.tensor, geo)
            self.pool.hand_out(buf)
            buf = out
        self.pool.hand_out(buf)
        full = buf.tensor if packed else geo.full_view(buf.tensor)
        if blocking:
            self.stats.blocking_gathers += 1
            key = state.kind.value
            self.stats.blocking_by_pass[key] = self.stats.blocking_by_pass.get(key, 0) + 1
        else:
            self.stats.prefetched_gathers += 1
        if w.axis is self.experts:
            self.stats.expert_gathers += 1
            self.stats.prefetched_expert_gathers += not blocking
        return full

    def drain(self, state: PassState) -> None:
        """Complete the gathers still in flight so their buffers return to the pool (they
        were issued ahead, so they count as prefetched, though no use reads them)."""
        while state.inflight:
            gather = state.inflight.popleft()
            self.comm.wait(gather.pending)
            self.pool.hand_out(gather.buffer)
            self.stats.prefetched_gathers += 1

    def abandon(self, state: PassState) -> None:
        """Forget the gathers a failed pass left in flight, without waiting for them: after a
        collective failed (a peer gone, stuck or diverged) they may never complete, and
        waiting would take a second full `collective_timeout_s` before the error reached the
        user. Their buffers leave the pool they came from, eager or graphed (see
        `GatherBufferPool.forget`); a copy-engine gather is still stream-waited (`Comm.abandon`)."""
        while state.inflight:
            gather = state.inflight.popleft()
            self.comm.abandon(gather.pending)
            for pool in (self.eager, self.graphed):
                pool.forget(gather.buffer)

    # ---- backward rematerialize ---------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook of a forward pass: a view of a gathered weight is saved as
        what re-gathers it; anything else as itself."""
        if type(t) is DTensor:
            local = self.pack(t._local_tensor)
            if type(local) not in (SavedWeightView, SavedBlockView):
                return t
            return SavedDTensorView(local, t.device_mesh, t.placements, t.size(), t.stride())
        try:
            buf = self.pool.lookup(t)
        except (RuntimeError, NotImplementedError):  # no storage: sparse, a wrapper subclass
            return t
        if buf is None or buf.owner is None:
            return t
        call = self.block_call
        if call is not None and buf.owner.index in call.members.position:
            call.saved += 1
            place = call.members.position[buf.owner.index]
            return SavedBlockView(call, place, t.size(), t.stride(), t.storage_offset())
        return SavedWeightView(buf.owner, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) not in _SAVED_VIEWS:  # most of what a pass saves: as it was
            return saved
        if type(saved) is SavedDTensorView:
            return DTensor.from_local(
                self.unpack(saved.local), saved.mesh, saved.placements, run_check=False,
                shape=saved.size, stride=saved.stride,
            )  # fmt: skip
        if type(saved) is SavedBlockView:
            call = saved.call
            task = torch._C._current_graph_task_id()
            if call.fulls is None or call.task != task:
                self.ensure_backward()
                call.fulls = [self.gather(w) for w in call.members.sharded]
                call.task, call.unpacked = task, 0
                self._held.append(call)
            full = call.fulls[saved.place]
            call.unpacked += 1
            if call.unpacked >= call.saved:
                call.fulls = None  # the last view: the buffers go back with the views
            if _is_whole(saved, full):
                return full
            return full.as_strided(saved.size, saved.stride, saved.storage_offset)
        self.ensure_backward()
        full = self.gather(saved.weight)
        if _is_whole(saved, full):  # the weight itself, as most uses save it: no view op
            return full
        return full.as_strided(saved.size, saved.stride, saved.storage_offset)

    def keep_recomputed(self, w: ShardedWeight, full: torch.Tensor) -> None:
        """Keep the weight a checkpoint's recompute gathered for the engine's linear, for its
        input gradient.

        [Note: a recompute keeps its weight] A checkpointed region's forward runs again inside
        backward, just before its backward, to make what the region saves; the engine's linear
        saves its input only, so its backward would gather the weight a second time. The
        weight the recompute gathered is kept instead, until that backward takes it (or the
        pass ends), as autograd's own linear keeps the view it saves: one gather per weight in
        a checkpointed backward, not two. Outside a recompute nothing is kept."""
        self._recomputed[w.index] = full

    def take_recomputed(self, w: ShardedWeight) -> torch.Tensor | None:
        """For a backward of the engine's linear: the weight its recompute gathered, if any
        (see [Note: a recompute keeps its weight]), no longer kept."""
        return self._recomputed.pop(w.index, None)

    def release_held(self) -> None:
        """At the end of a pass: drop what block calls and recomputes still hold of their
        weights (views that this backward did not unpack, as with backward(inputs=...))."""
        for call in self._held:
            call.fulls = None
        self._held.clear()
        self._recomputed.clear()

    def total_bytes(self) -> int:
        """Memory held by the gather buffers of the model and of its graphed regions."""
        return self.eager.total_bytes + self.graphed.total_bytes
