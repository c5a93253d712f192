"""Weight gradients: reduce-scattered over the group their weight is sharded over (gtp, or egtp
for expert stacks) in groups, averaged over its replicas (dp, or edp), landed in each shard's
`.grad`, and handed to users' hooks; the sharded sibling of runtime/replicated.py.

Each use's full weight gradient joins the collecting group; a group is issued as one
reduce-scatter once it holds `group_numel` elements, and finalized when the next group is issued
(so its collective runs under that group's backward compute) or when backward ends. With dp,
finalizing a group issues its dp all-reduces and lands the group before it, whose all-reduces
have run meanwhile: a group goes collecting -> reducing -> averaging -> landed, each hand-off at
the next group's issue, and the end of backward lands them all. Each weight's `GradState`
(core/weight.py) is advanced here and nowhere else.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..comm.comm import Pending
from ..core.weight import GradState, ShardedWeight, describe_group
from ..errors import GraphCaptureError
from .casts import cast_together
from .part import Part, Shared


@dataclasses.dataclass
class PendingGrad:
    """One weight gradient in a reduce-scatter group."""

    weight: ShardedWeight
    out: torch.Tensor  # the slot-sized result: the new gradient itself, or a staging buffer
    direct: bool  # whether `out` becomes the parameter's grad (it had none yet)


@dataclasses.dataclass
class ReduceGroup:
    """Weight gradients reduce-scattered as one collective, grouped the way gathers are."""

    grads: list[PendingGrad] = dataclasses.field(default_factory=list)
    fulls: list[torch.Tensor] = dataclasses.field(default_factory=list)  # inputs, until issued
    numel: int = 0
    pending: Pending | None = None
    averaging: list[Pending] = dataclasses.field(default_factory=list)  # its dp all-reduces


class GradReducer(Part):
    """Reduce-scatters, finalizes and lands the weight gradients of one engine."""

    def __init__(self, shared: Shared, group_numel: int, reduce_dtype: torch.dtype | None) -> None:
        super().__init__(shared)
        self.group_numel = group_numel
        # An expert stack's gradient summed every ep rank's tokens already (see [Note: expert
        # stacks over the expert mesh]): under a mean it is divided by ep once more.
        average = self.comm.grad_op == dist.ReduceOp.AVG
        self.scale = {w.index: 1 / w.ep.size for w in self.weights if average and w.ep}
        self.unit_sizes = collections.Counter(w.unit for w in self.weights if w.unit is not None)
        self.reduce_dtype = reduce_dtype
        # Weights whose gradients have no peer to reduce with (a group of one, no dp): each
        # lands at once (`_land_unreduced`), fixed at wrap.
        self.unreduced = frozenset(
            w.index
            for w in self.weights
            if w.axis.size == 1 and w.replicas.size == 1 and w.geometry.dim == 0
        )
        # Of those, the ones autograd may accumulate itself after a block's backward (see
        # [Note: a block's gradients in a group of one]): no expert-stack scale to apply, and a
        # reduce dtype that changes nothing when rounded to first (the use's or the shard's).
        self.accumulated = frozenset(
            w.index
            for w in self.weights
            if w.index in self.unreduced
            and w.index not in self.scale
            and reduce_dtype in (None, w.meta.dtype, w.geometry.dtype)
        )
        self._collecting = ReduceGroup()  # gradients not yet issued
        self._reducing: ReduceGroup | None = None  # issued, not yet finalized
        self._averaging: ReduceGroup | None = None  # reduced, its dp all-reduces in flight
        # Weights whose `.grad` this backward wrote, in the order they first landed: a weight
        # used twice may land, take another gradient and land again, but its hooks run once.
        self._landed: dict[ShardedWeight, None] = {}
        # Staging buffers by (numel, dtype); graphed regions keep theirs apart, as gathers do
        # (see [Note: graphed buffers]).
        self.eager: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.graphed: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.staging = self.eager

    def reduce_grad(self, w: ShardedWeight, grad: torch.Tensor, owned: bool = False) -> None:
        """Collect one use's full weight gradient for its group's reduce-scatter. `owned`: the
        caller made `grad` and holds no other reference to it (the engine's linear's GEMM
        output), so a gradient with no peer may become `.grad` itself, uncopied."""
        self.ensure_backward()
        if w.region is not None and self.passes.scope is None:
            raise GraphCaptureError(
                f"'{w.fqn}' is used inside graphed region {w.region} and also outside it, where "
                "its gradient would race the region's replay: graph a module that holds every "
                "use of its weights, or leave it eager"
            )
        geo = w.geometry
        with torch._C.DisableTorchFunctionSubclass():
            dtype = self.reduce_dtype or grad.dtype
            scale = self.scale.get(w.index)
            if scale is not None:
                grad, owned = grad.to(dtype) * scale, True
            if w.index in self.unreduced:
                self._land_unreduced(w, grad, dtype, owned)
                return
            group = self._collecting
            if group.grads and group.grads[-1].weight.axis is not w.axis:
                self._issue()  # a group's gradients share their collective's group
                group = self._collecting
            # A weight used twice has a second gradient; only the first may become `.grad`.
            direct = (
                dtype == geo.dtype
                and w.param.grad is None
                and w.grad_state is not GradState.PENDING
            )
            full = grad  # cast with its group's, as the group is issued (see `_issue`)
            # [Note: unflattened grads] A weight split into equal row blocks along dim 0 is
            # reduce-scattered as it is, into a new gradient of the shard's own shape: every
            # process-group backend splits the first dim, so neither side needs a view op
            # (two per weight per step). The copy-engine collectives take flat buffers.
            shaped = (
                direct
                and geo.even_rows
                and full.is_contiguous()
                and self.comm.reduce_copies is None
            )
            if shaped:
                out = torch.empty(geo.local_shape, dtype=dtype, device=self.device)
            else:
                out = (
                    torch.empty(geo.slot_numel, dtype=dtype, device=self.device)
                    if direct
                    else self._take_staging(geo.slot_numel, dtype)
                )
                full = geo.padded_rows_view(full)
            w.grad_collected()
            group.grads.append(PendingGrad(w, out, direct))
            group.fulls.append(full)
            group.numel += full.numel()
            self.stats.bytes_reduced += full.numel() * dtype.itemsize
            if group.numel >= self.group_numel and self._unit_complete(group, w):
                self._issue()

    def reduce_grads(
        self,
        grads: list[tuple[ShardedWeight, torch.Tensor]],
        accumulated: list[tuple[ShardedWeight, torch.Tensor]],
    ) -> None:
        """A block's gradients: `reduce_grad` for each of `grads`, in order; `accumulated`
        are those that autograd itself accumulates into `.grad` once the block's node returns
        them (see [Note: a block's gradients in a group of one]), counted and advanced here.

        [Note: a block's gradients in a group of one] A gradient with no peer to reduce with (a
        group of one, no dp) is its shard's gradient as it is, cast to the shard's dtype. The
        block's autograd node returns those gradients for its parameters, cast to their dtype
        together (see [Note: a block's gradients are cast together], runtime/uses.py), and autograd
        accumulates each into `.grad` (taking it as it is when there is none yet), in C++: no Python
        work per weight but this bookkeeping, where a landing of our own cost a split, a view and a
        `.grad` write per weight (118 µs of Python per block call in a backward on an H200 host,
        `benchmarks/RESULTS.md`). The values are `_land_unreduced`'s (the same cast, with a reduce
        dtype that rounding to first changes nothing for) for a weight used once in the backward. A
        weight used several times has its fp32 gradients summed as plain torch sums them: autograd
        adds the uses that reach the parameter before accumulating, and a use outside blocks lands
        through the reducer, so the order of the additions (and the last bits of the sum) can differ
        from the reducer's one-by-one landing. Autograd runs no hook of ours early: users' hooks on
        sharded parameters are the reducer's (see [Note: hooks on shards]), run when backward
        ends."""
        if accumulated:
            self.ensure_backward()
            self._landed_now(accumulated, self.reduce_dtype)
        for w, g in grads:
            self.reduce_grad(w, g)

    def _unit_complete(self, group: ReduceGroup, w: ShardedWeight) -> bool:
        """Whether the group may close after `w`: not between the expert stacks of one layer,
        which are reduce-scattered as one collective, as they are gathered (Chain.build)."""
        if w.unit is None:
            return True
        return sum(g.weight.unit == w.unit for g in group.grads) >= self.unit_sizes[w.unit]

    def _land_unreduced(
        self, w: ShardedWeight, grad: torch.Tensor, dtype: torch.dtype, owned: bool
    ) -> None:
        """A gradient with no peer to reduce with (a group of one, no dp) is the shard's
        gradient as it is, rounded to the reduce dtype: it lands at once, with no collective
        and no staging copy (nor any copy, when `owned` and in the shard's dtype)."""
        param = w.param
        self._landed_now(((w, grad),), dtype)
        current = param.grad
        if current is not None:
            current.add_(grad.to(dtype).reshape(current.shape))
            return
        geo_dtype = w.geometry.dtype
        if grad.dtype == dtype == geo_dtype and owned and grad.is_contiguous():
            new = grad
        elif grad.dtype == dtype == geo_dtype:  # autograd's tensor: someone else may hold it
            new = grad.clone(memory_format=torch.contiguous_format)
        else:
            new = grad.to(dtype).to(geo_dtype, memory_format=torch.contiguous_format)
        param.grad = new.view(param.shape)

    def _landed_now(
        self, grads: Iterable[tuple[ShardedWeight, torch.Tensor]], dtype: torch.dtype | None
    ) -> None:
        """Count and advance gradients that land with no collective, one per weight (a
        block's together), each `dtype` (None: its own) on the wire it did not take."""
        landed = self._landed
        n = nbytes = 0
        for w, g in grads:
            w.grad_landed_at_once()
            landed[w] = None
            n += 1
            nbytes += g.numel() * (dtype or g.dtype).itemsize
        self.stats.bytes_reduced += nbytes
        self.stats.reduce_scatters += n  # as a group's are counted, though none is issued

    def _issue(self) -> None:
        """Reduce-scatter the collected gradients as one collective; finalize the previous
        group, whose collective has had this group's backward compute to run under."""
        group, self._collecting = self._collecting, ReduceGroup()
        if not group.grads:
            return
        weights = [g.weight for g in group.grads]
        what = describe_group(
            weights, "reduce-scatter of the gradients of", weights[0].what_reduce, ""
        )
        outs = [g.out for g in group.grads]
        # [Note: a group's gradients are cast together] A gradient joins its group as it came
        # (a bf16 linear's weight gradient) and the group's are cast into the reduce dtype here,
        # by one multi-tensor copy: one launch per collective, not one per weight, and the
        # fp32 copies exist only from the collective's issue on (the group held them from the
        # first gradient's arrival before).
        fulls = group.fulls
        late = [i for i, f in enumerate(fulls) if f.dtype != outs[i].dtype]
        if late:
            cast = cast_together([fulls[i] for i in late], [outs[i].dtype for i in late])
            for i, c in zip(late, cast):
                fulls[i] = c
        group.pending = self.comm.reduce_scatter(weights[0].axis, outs, fulls, what)
        group.fulls = []  # the collective holds its inputs until it completes
        self.stats.reduce_scatters += len(weights)
        prev, self._reducing = self._reducing, group
        if prev is not None:
            self._finalize(prev)

    def _take_staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self.staging.setdefault((numel, dtype), [])
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def _finalize(self, group: ReduceGroup) -> None:
        """Complete a group's reduce-scatter; with dp, issue its dp all-reduces and land the
        group before it (whose all-reduces had this group's reduce-scatter to run under), else
        land it."""
        self.comm.wait(group.pending)  # type: ignore[arg-type]
        replicas = group.grads[0].weight.replicas  # shared, as the axis is
        if replicas.size == 1:
            self._land(group)
            return
        group.averaging = [self.comm.all_reduce(g.out, replicas, g.weight.what_dp)
                           for g in group.grads]  # fmt: skip
        prev, self._averaging = self._averaging, group
        if prev is not None:
            self._land(prev)

    def _land(self, group: ReduceGroup) -> None:
        """Write each gradient of a group, reduced over gtp and dp, into its shard's grad."""
        for pending in group.averaging:
            self.comm.wait(pending)
        for g in group.grads:
            w = g.weight
            param = w.param
            geo = w.geometry
            local = g.out if g.out.shape == geo.local_shape else geo.local_of_slot(g.out)
            w.grad_landed()
            if w.grad_state is GradState.LANDED:  # its last pending gradient
                self._landed[w] = None
            if g.direct:
                param.grad = local
                continue
            if param.grad is None:
                param.grad = local.to(w.geometry.dtype, copy=True)
            else:
                param.grad.add_(local)
            self.staging[(w.geometry.slot_numel, g.out.dtype)].append(g.out)

    def flush(self) -> None:
        """At the end of backward: issue what is still collecting and finalize everything."""
        with torch._C.DisableTorchFunctionSubclass():
            self._issue()
            if self._reducing is not None:
                self._finalize(self._reducing)
                self._reducing = None
            if self._averaging is not None:
                self._land(self._averaging)
                self._averaging = None

    def region_landed(self, weights: Iterable[ShardedWeight]) -> None:
        """A graphed region's replay wrote these weights' `.grad`."""
        for w in weights:
            w.region_grad_landed()
            self._landed[w] = None

    def end_backward(self, run_hooks: bool) -> None:
        """Return every landed weight to `NONE`, then run its users' hooks if asked (the
        model's own backward; a graphed region's warm-up and capture leave no trace)."""
        landed, self._landed = self._landed, {}
        ShardedWeight.backward_ended(landed)
        if not run_hooks:
            return
        # Still inside autograd's graph task, where a sharded parameter would read as its
        # gathered weight: the hooks see the shards, as outside backward.
        with torch._C.DisableTorchFunctionSubclass():
            for w in landed:
                if w.grad_hooks:
                    for hook in list(w.grad_hooks.values()):
                        hook(w.param)

    def abandon(self) -> None:
        """Forget a backward that raised: its collectives in flight and its pending grads.
        Every weight is reset, not only those of the groups: a collective that raised while
        being issued or finalized leaves its group in neither."""
        for group in (self._collecting, self._reducing, self._averaging):
            if group is not None:
                for pending in [group.pending, *group.averaging]:
                    if pending is not None:
                        self.comm.abandon(pending)
        for w in self.weights:
            w.abandon_grads()
        self._collecting, self._reducing, self._averaging = ReduceGroup(), None, None
        self._landed = {}

    def in_flight(self) -> list[Pending]:
        """The reduce-scatter and dp all-reduces in flight, if any (for a fence before a graph
        replay)."""
        out = []
        if self._reducing is not None and self._reducing.pending is not None:
            out.append(self._reducing.pending)
        if self._averaging is not None:
            out += self._averaging.averaging
        return out
