"""One use of a managed parameter during a pass: what the torch function runs on, and the
autograd functions that carry its gradient back to the engine.

Every torch function that reads a managed parameter's values inside a pass comes here from
`GTPParameter.__torch_function__` (see [Note: interception] in core/parameter.py). An F.linear
of a sharded 2-D weight takes the engine's own linear (`ShardedLinear`) where the policy asks
for it; an in-place write is refused; any other use runs on the full weights, each wired so that
its gradient reaches the engine:

- `RouteGrad`: identity on a gathered weight; its backward hands the full weight gradient to the
  reduce-scatter (runtime/reduce.py) instead of to the shard.
- `CastGrad`: a replicated parameter read through its compute-dtype copy; the gradient is cast
  back and accumulates into the parameter as usual.
- `ShardedLinear`: F.linear on a gathered weight, with the weight gradient computed straight in
  the reduce dtype, and the weight re-gathered in backward for the input gradient (it saves
  the input only; fp32 weights take it too, for that).
- `RegionReplay`: a graphed region's forward and backward graphs, replayed (graphs/region.py).

[Note: fp32 weight gradients] With bf16 compute and fp32 reductions, autograd's own linear
backward writes the weight gradient in bf16 and the reduce-scatter then needs it in fp32: a cast
that reads and writes every gathered gradient once more (5.1 ms of a 76.6 ms graphed step at
1.36B, batch 1, 2xH200, `benchmarks/profile_gtp.py`). The GEMM can write fp32 itself (cuBLAS
accumulates in fp32 anyway), so uses that are F.linear take `ShardedLinear`: the forward is
F.linear as before, the input gradient is the same GEMM autograd runs, and the weight gradient
is one GEMM with an fp32 output: the bf16 products summed and rounded once in fp32, as
Megatron-LM's fp32 gradient accumulation keeps them. On CPU, where the GEMM has no output
dtype, the operands are upcast instead, which computes the same products. Uses that autograd's
linear handles differently (autocast to another dtype, a bias that is not 1-D) keep autograd's
linear (see `Uses.linear_weight`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.utils._pytree import tree_map_only

from ..core.parameter import GTPParameter, refuse_grad_of_shards, written_param
from ..core.weight import CastWeight, ShardedWeight
from ..errors import WrapError
from ..precision import fp8
from ..precision.encoding import Precision
from .casts import cast_together
from .gather import BlockCall, BlockMembers, Gatherer
from .passes import Passes
from .stats import Stats

_CONTAINERS = (list, tuple, dict)
_LINEAR = F.linear  # what F.linear is, even where a profiler wraps this module's F
_graph_task_id = torch._C._current_graph_task_id
_will_execute = torch._C._will_engine_execute_node
_is_wrapper = torch._C._functorch.is_functorch_wrapped_tensor


def _applied(fn: type[torch.autograd.Function], user: tuple[int, ...] = ()) -> Callable[..., Any]:
    """`fn.apply`, without the Python wrapper of `Function.apply` where it does nothing;
    `user`: the positions of arguments that come from the user's code.

    [Note: applying the engine's autograd functions] Every weight use applies one of the
    autograd functions below. `Function.apply`'s Python wrapper exists for functorch: with
    its transforms off it only unwraps dead functorch wrappers, one generator step per
    argument (7 for the engine's linear), before calling the C++ apply: about 2 us a call on
    CPU, of the engine's 14 us per use at a world of one. The engine's own tensors are never
    functorch wrappers, so with the transforms off the C++ apply is called directly; with
    them on, or where a user's argument (the linear's input or bias) outlived a transform (a
    dead wrapper), the wrapper runs as before. (With the linear's checks decided at wrap,
    the H200 host's time in `Uses.use` fell by 0.6-0.7 ms a step at 125M, batch 1, 87 uses:
    `benchmarks/step_phases.py`, `benchmarks/RESULTS.md`.)"""
    direct = super(torch.autograd.Function, fn).apply  # type: ignore[misc]  # the C++ apply
    wrapped = fn.apply
    active = torch._C._are_functorch_transforms_active

    def apply(*args: Any) -> Any:
        if active():
            return wrapped(*args)
        for i in user:
            if args[i] is not None and _is_wrapper(args[i]):
                return wrapped(*args)
        return direct(*args)

    return apply


def _holds_parameter(container: list | tuple | dict) -> bool:
    """Whether a managed parameter is in `container` (a shape holds none), nested or not."""
    items = container.values() if type(container) is dict else container
    return any(type(x) is GTPParameter or type(x) in _CONTAINERS for x in items)


class GradRuntime(Protocol):
    """What the backward of a use asks of its engine."""

    reduce_dtype: torch.dtype | None

    def ensure_backward(self) -> None: ...

    def gather(self, w: ShardedWeight, packed: bool = False) -> torch.Tensor: ...

    def keep_recomputed(self, w: ShardedWeight, full: torch.Tensor) -> None: ...

    def take_recomputed(self, w: ShardedWeight) -> torch.Tensor | None: ...

    def full_weight(self, p: torch.Tensor) -> torch.Tensor: ...

    def reduce_grad(self, w: ShardedWeight, grad: torch.Tensor, owned: bool = False) -> None: ...

    accumulated: frozenset[int]  # weights whose block gradients autograd accumulates itself

    def reduce_grads(
        self,
        grads: list[tuple[ShardedWeight, torch.Tensor]],
        accumulated: list[tuple[ShardedWeight, torch.Tensor]],
    ) -> None: ...


class Uses:
    """Runs the intercepted uses of one engine's parameters."""

    def __init__(
        self,
        runtime: GradRuntime,
        passes: Passes,
        gatherer: Gatherer,
        stats: Stats,
        precision: Precision,
    ) -> None:
        self.runtime = runtime  # what the uses' autograd functions call back in backward
        self.passes = passes
        self.gatherer = gatherer
        self.stats = stats
        self.own_linear = precision.own_linear
        # What an input must be for the engine's linear, per 2-D sharded weight without tensor
        # parallelism (the weights it may take, fixed at wrap), by the weight's id: (the
        # weight, its in_features, its compute dtype).
        self.linear_inputs: dict[int, tuple[ShardedWeight, int, torch.dtype]] = {
            id(w): (w, w.geometry.shape[1], w.meta.dtype)
            for w in gatherer.weights
            if len(w.geometry.shape) == 2 and w.tp is None
        }

    def use(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `func` with each managed parameter among its args replaced by the weight it
        uses: the gathered full weight, or a replicated parameter's compute-dtype copy."""
        if not self.passes.stack:
            self.runtime.ensure_backward()  # a checkpoint recompute: uses inside backward
        w = self.linear_weight(func, args, kwargs) if self.own_linear else None
        if w is not None:
            return self._linear(w, *args, **kwargs)
        if func is torch.autograd.grad:  # inside a forward (a gradient penalty)
            refuse_grad_of_shards(args[1])
        p = written_param(func, args, kwargs)
        if p is not None:
            raise WrapError(
                f"{getattr(func, '__name__', func)} writes in place to '{p.gtp_weight.fqn}' "
                "during a forward or backward pass, where it reads as a temporary copy (the "
                "gathered weight, or its compute-dtype copy), so the write would be lost (e.g. "
                "nn.Embedding(max_norm=...) renormalizes its weight this way). Replicate that "
                "weight (a LayerRule with action 'replicate', without param_dtype) or change "
                "it outside passes, under torch.no_grad()"
            )
        full: dict[int, torch.Tensor] = {}

        def substitute(p: GTPParameter) -> torch.Tensor:
            if id(p) not in full:
                full[id(p)] = self.full_weight(p)
            return full[id(p)]

        def swap(a: Any) -> Any:
            if type(a) is GTPParameter:
                return substitute(a)
            if type(a) in _CONTAINERS and _holds_parameter(a):
                return tree_map_only(GTPParameter, substitute, a)
            return a  # a tensor, a number, a shape: no tree walk

        args = tuple(swap(a) for a in args)
        if kwargs:  # torch's functional wrappers pass weights by keyword (F.rms_norm)
            kwargs = {k: swap(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def begin_block(self, members: BlockMembers) -> tuple[list[torch.Tensor], BlockCall | None]:
        """The weight one use of each member sees, in order: a block's weights, gathered
        before its forward runs (see [Note: blocks on gathered weights], runtime/blocks.py),
        for the time of its forward, which `end_block` closes with what this returned second;
        what the forward saves of them is re-gathered together (see [Note: a block's weights
        come back together], runtime/gather.py). A pair of calls rather than a context
        manager: a block's forward runs once per block call, where contextlib costs five
        Python calls more."""
        if not self.passes.stack:
            self.runtime.ensure_backward()  # a checkpoint recompute: uses inside backward
        call = None
        if not torch.is_grad_enabled():
            weights = [self._weight_of(w) for w in members.weights]
        else:
            # A group of one saves its weights as they are; a checkpoint's recompute (inside
            # backward) hands what it saves to the checkpoint, not to the pass's hooks.
            if not self.gatherer.local and not self.passes.in_backward():
                call = BlockCall(members)
            weights = list(_block_weights(self, members, *members.params))
        outer, self.gatherer.block_call = self.gatherer.block_call, call
        if members.tp:
            weights = [_as_used(w, t) for w, t in zip(members.weights, weights)]
        return weights, outer

    def end_block(self, outer: BlockCall | None) -> None:
        """Close the block call `begin_block` opened; `outer`: what it returned second."""
        self.gatherer.block_call = outer

    def zeros_like_use(self, w: ShardedWeight) -> torch.Tensor:
        """A zero gradient of the (tp-local) weight a use of `w` reads."""
        return torch.zeros(w.geometry.shape, dtype=w.meta.dtype, device=self.gatherer.device)

    def _weight_of(self, w: ShardedWeight | CastWeight) -> torch.Tensor:
        """What one use of `w` reads: its gathered full weight, or its compute-dtype copy."""
        return self.gatherer.gather(w) if type(w) is ShardedWeight else w.cast  # type: ignore[union-attr]

    def full_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight one use of `p` sees, wired so that its gradient reaches `p`."""
        w = p.gtp_weight  # type: ignore[attr-defined]
        grad = torch.is_grad_enabled() and p.requires_grad
        if type(w) is not ShardedWeight:  # replicated, used in the compute dtype
            return _as_used(w, _cast_grad(p, w.cast) if grad else w.cast)
        full = self.gatherer.gather(w)
        return _as_used(w, _route_grad(p, full, self.runtime, w) if grad else full)

    def linear_weight(self, func: Callable, args: tuple, kwargs: dict) -> ShardedWeight | None:
        """The weight if this use is an F.linear that takes the engine's own linear: a sharded
        2-D weight, an input in the compute dtype, no bias or a 1-D one, and no autocast to
        another dtype (see [Note: fp32 weight gradients])."""
        if func is not _LINEAR or len(args) < 2:
            return None
        x, param = args[0], args[1]
        if type(param) is not GTPParameter or type(x) is GTPParameter:
            return None
        takes = self.linear_inputs.get(id(param.gtp_weight))
        # Under forward-mode AD autograd's linear is taken: it has a jvp.
        if takes is None or forward_ad._current_level >= 0:
            return None
        w, in_features, dtype = takes
        if x.dtype != dtype or x.dim() == 0 or x.shape[-1] != in_features:
            return None
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if bias is not None and bias.dim() != 1:
            return None
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype:
            return None
        if w.encoding.feeds_gemm:
            return w
        return w if torch.is_grad_enabled() and param.requires_grad else None

    def _linear(
        self,
        w: ShardedWeight,
        x: torch.Tensor,
        param: GTPParameter,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F.linear on the gathered weight through `ShardedLinear`; with fp8_matmul the
        gathered FP8 weight is fed straight to the FP8 GEMM."""
        if type(bias) is GTPParameter:
            bias = self.full_weight(bias)
        scale = None
        geo = w.geometry
        if w.encoding.feeds_gemm:
            full, scale = fp8.unpack_rows(self.gatherer.gather(w, packed=True), geo.world,
                                          geo.rows_per_rank, geo.row_numel)  # fmt: skip
            self.stats.fp8_matmuls += 1
        else:
            full = self.gatherer.gather(w)
        if torch.is_grad_enabled() and (
            x.requires_grad or param.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return _sharded_linear(x, param, full, bias, self.runtime, w, scale)
        assert scale is not None  # without autograd only FP8 GEMMs take this route
        return fp8.linear_forward(x, full, scale, geo, bias)


def _as_used(w: ShardedWeight | CastWeight, local: torch.Tensor) -> torch.Tensor:
    """What a module's op takes for the weight: the full (or cast) local tensor, or for a
    tensor-parallel weight its DTensor (see [Note: GTP over tensor parallelism])."""
    return local if w.tp is None else w.tp.wrap(local)


class BlockWeights(torch.autograd.Function):
    """The weights of a block run on gathered weights, one use each, as one autograd node: per
    block one node to make and run instead of one `RouteGrad` or `CastGrad` per weight. Its
    backward hands the gradient of each sharded weight this backward asks for to the
    reduce-scatter, or, with no peer to reduce with, returns it for autograd to accumulate (see
    [Note: a block's gradients in a group of one], runtime/reduce.py), and returns each
    replicated one's, each cast to its parameter's dtype (see [Note: a block's gradients are
    cast together]).

    [Note: unused weights of a block] Every rank gathers every weight of a block, whatever the
    block then uses, so a rank's forward cannot show that its ranks took different branches
    (a mixture of experts routing each rank to its own expert). Backward must still issue the
    same reduce-scatters on every rank: a weight the block left unused here gets a zero
    gradient, which is its true gradient on this rank. So after a backward that reaches the
    block, each of its weights has a `.grad`, zero where no rank used it (DDP's buckets do the
    same).

    [Note: a block's gradients are cast together] The gradients this node returns to autograd
    (replicated weights', and sharded ones' in a group of one) come out of the block in the compute
    dtype, and autograd would cast each to its parameter's dtype on its own: an allocation and a
    copy kernel per weight, whose host cost (about 30 µs each under the profiler on an H200 host, 84
    a step at 125M: `benchmarks/RESULTS.md`) was the largest part of what a compiled step spent
    beyond the floor's. They are cast here instead, by one multi-tensor copy per block call into
    tensors of their parameters' dtypes (and their own layouts), so autograd finds nothing to cast
    and takes each as `.grad` (or adds it) as before: the same values, one launch. The gradients the
    reducer takes are cast likewise, a reduce group at a time, as it is issued
    (`GradReducer._issue`). A differentiable backward (create_graph) leaves the casts to autograd,
    which records them. (Views of one buffer per block instead of an allocation per gradient, cut by
    one unflatten call, made the node slower on the H200 host, not faster: 14 view ops for 7
    allocations, `benchmarks/RESULTS.md`.)
    """

    @staticmethod
    def forward(ctx, uses: Uses, members: BlockMembers, *params: GTPParameter):  # type: ignore[override]
        ctx.uses, ctx.members = uses, members
        ctx.set_materialize_grads(False)  # unused weights: zeros made only where needed
        # Outputs of this node must be tensors of their own, not the local copies or the
        # replicated weights' casts, which persist across calls: those are viewed; a gathered
        # weight is a fresh view of its buffer already (one view op fewer per weight).
        if members.locals is not None:
            out = [t.view_as(t) for t in members.locals]
        else:
            out = []
            for w, fresh in zip(members.weights, members.gathered):
                if fresh:
                    out.append(uses.gatherer.gather(w))  # type: ignore[arg-type]
                else:
                    t = uses._weight_of(w)
                    out.append(t.view_as(t))
        unfrozen = ctx.needs_input_grad[2:]  # which parameters require grad
        if not all(unfrozen):
            ctx.mark_non_differentiable(*(t for t, u in zip(out, unfrozen) if not u))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        uses: Uses = ctx.uses
        members: BlockMembers = ctx.members
        runtime = uses.runtime
        out: list[torch.Tensor | None] = [None, None]  # for `uses` and `members`
        runs = _will_run_all(ctx, first=2)
        # A differentiable backward (create_graph) hands every sharded one to the reducer.
        differentiable = torch.is_grad_enabled()
        accumulates = () if differentiable else runtime.accumulated
        sharded: list[tuple[ShardedWeight, torch.Tensor]] = []
        accumulated: list[tuple[ShardedWeight, torch.Tensor]] = []
        # Gradients autograd would cast one by one: (place in `out`, gradient, dtype).
        casts: list[tuple[int, torch.Tensor, torch.dtype]] = []
        for w, grad, run, dtype in zip(members.weights, grads, runs, members.grad_dtypes):
            if run is False:
                out.append(None)
                continue
            if type(w) is ShardedWeight:
                if grad is None:  # see [Note: unused weights of a block]
                    grad = uses.zeros_like_use(w)
                # `run` is None under autograd.grad(), which returns a gradient, never
                # accumulates it: the reducer writes `.grad` then, as for every use (a graphed
                # region's capture).
                if not (run and w.index in accumulates and w.region is None):
                    sharded.append((w, grad))
                    out.append(None)
                    continue
                accumulated.append((w, grad))  # [Note: a block's gradients in a group of one]
            if grad is not None and grad.dtype != dtype:
                casts.append((len(out), grad, dtype))
            out.append(grad)
        if len(casts) > 1 and not differentiable:  # [Note: a block's gradients are cast together]
            cast = cast_together([grad for _, grad, _ in casts], [dtype for _, _, dtype in casts])
            for (i, _, _), c in zip(casts, cast):
                out[i] = c
        runtime.reduce_grads(sharded, accumulated)
        return tuple(out)


_block_weights = _applied(BlockWeights)


class CastGrad(torch.autograd.Function):
    """A replicated parameter used through its compute-dtype copy; its gradient goes back as it
    came, which autograd casts to the parameter's dtype."""

    @staticmethod
    def forward(ctx, param, cast):  # type: ignore[override]
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


_cast_grad = _applied(CastGrad)


class RouteGrad(torch.autograd.Function):
    """Identity on the gathered weight whose backward sends the full grad to the reduce-scatter.

    The shard parameter is an input only so the output requires grad; no gradient flows to it
    through autograd: the reducer writes `.grad` itself when the reduce-scatter is finalized.
    """

    @staticmethod
    def forward(ctx, param, full, runtime, weight):  # type: ignore[override]
        ctx.runtime, ctx.weight = runtime, weight
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.runtime.reduce_grad(ctx.weight, grad)
        return None, None, None, None


_route_grad = _applied(RouteGrad)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad.T @ x (both 2-D, in the compute dtype) as a `dtype` tensor: rounded once when
    `dtype` is fp32 (the engine's route), else the compute-dtype product cast."""
    if grad.dtype == dtype:
        return grad.t() @ x
    if dtype != torch.float32:
        return (grad.t() @ x).to(dtype)
    if grad.is_cuda:
        return torch.mm(grad.t(), x, out_dtype=dtype)
    return grad.t().to(dtype) @ x.to(dtype)


def _will_run_all(ctx, first: int) -> list[bool | None]:
    """Whether this backward needs the gradient of each input from `first` on, up to its first
    input that is not a tensor (the node's edges cover its tensor inputs only, in order, so
    inputs before `first` must not be tensors; an input that is None needs no gradient, so
    its entry is False whatever edge it meets): False where it does not, None where it may and
    the engine cannot say, as under autograd.grad() for a leaf (a parameter), whose gradient
    autograd.grad() returns rather than accumulates. One call per node reads
    `ctx.needs_input_grad` and `ctx.next_functions` once: the engine's linear asks it on every
    backward of every use.

    [Note: needs_input_grad] `ctx.needs_input_grad` is fixed at forward time, while autograd's
    own nodes compute only what the running backward asks for: `autograd.grad(loss, x)` or
    `backward(inputs=[x])` must not reduce-scatter weight gradients. The engine knows which
    nodes it will run; asked about a leaf's node under autograd.grad() it raises, and then the
    gradient is computed, as before.
    """
    runs: list[bool | None] = []
    for needed, (node, _) in zip(ctx.needs_input_grad[first:], ctx.next_functions):
        if not needed:
            runs.append(False)
            continue
        try:
            runs.append(_will_execute(node))
        except RuntimeError:
            runs.append(None)
    return runs


class ShardedLinear(torch.autograd.Function):
    """F.linear with a gathered weight (with `scale`, the gathered FP8 rows and their scales,
    run as one FP8 GEMM); backward re-gathers the weight in the compute dtype for the input
    gradient and hands the weight gradient, in the reduce dtype, to the reduce-scatter."""

    @staticmethod
    def forward(ctx, x, param, w, bias, runtime, weight, scale):  # type: ignore[override]
        ctx.runtime, ctx.weight, ctx.param = runtime, weight, param
        ctx.save_for_backward(x)
        if scale is None and _graph_task_id() != -1:  # a checkpoint's recompute
            runtime.keep_recomputed(weight, w)
        if scale is None:
            return F.linear(x, w, bias)
        return fp8.linear_forward(x, w, scale, weight.geometry, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        runtime: GradRuntime = ctx.runtime
        weight: ShardedWeight = ctx.weight
        runtime.ensure_backward()
        kept = runtime.take_recomputed(weight)  # taken whatever runs: its buffer goes back
        # A 2-D input (a token-major batch, as a block's linears see it) needs no reshapes:
        # three view ops per use fewer.
        flat = x.dim() == 2
        g = grad if flat else grad.reshape(-1, weight.geometry.shape[0])
        dx = None
        # x, the parameter, the gathered weight, and the bias where it is a tensor
        runs = _will_run_all(ctx, first=0)
        if runs[0] is not False:  # the weight is re-gathered only when x needs it
            # With create_graph, dx stays differentiable in the weight, as autograd's is.
            if torch.is_grad_enabled():
                w = runtime.full_weight(ctx.param)
            else:
                w = runtime.gather(weight) if kept is None else kept
            dx = g @ w if flat else (g @ w).reshape(x.shape)
        if runs[1] is not False:
            dtype = runtime.reduce_dtype or g.dtype
            x2 = x if flat else x.reshape(-1, x.shape[-1])
            runtime.reduce_grad(weight, weight_grad(g, x2, dtype), owned=True)
        dbias = g.sum(0) if len(runs) > 3 and runs[3] is not False else None
        return dx, None, None, dbias, None, None, None


_sharded_linear = _applied(ShardedLinear, user=(0, 3))  # the input and the bias


class ReplayedRegion(Protocol):
    """A graphed region (graphs/region.py) as its replay sees it."""

    def replay_forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    def replay_backward(
        self, grads: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, ...]: ...


class RegionReplay(torch.autograd.Function):
    """A graphed region's forward graph replayed, and its backward graph in the model's
    backward; its inputs are the region's inputs, then its parameters."""

    @staticmethod
    def forward(ctx, region: ReplayedRegion, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.region = region
        return region.replay_forward(inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, *ctx.region.replay_backward(grads))
