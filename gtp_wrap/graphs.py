"""CUDA-graph capture of a GTP training step, whole or by regions.

`graph_step(model, fn)` runs the first `warmup` calls of a step function eagerly, captures the
next call in a CUDA graph and replays it from then on, with the inputs copied into static
buffers. `graph_region(model, submodule, sample_args)` captures one submodule's forward and
backward as two graphs (as `torch.cuda.make_graphed_callables` does) for models whose other
parts cannot be captured; the rest of the step stays eager.

Note: why GTP's step can be captured at all. Everything the engine decides on the host (which
buffer a gather lands in, the chain, when a reduce-scatter is finalized, whether a shard needs
re-casting) is the same from the second step on, and the gather buffers stay put once
graph_step holds them (eager steps release them), so the capture records exactly the kernels and
collectives of a warm-up step, at the same addresses. The collectives run on NCCL's internal
stream, which forks from the capture stream with an event and is joined back by `Work.wait()`,
so it is captured with them; nothing may still be in flight when capture ends, which the engine
guarantees because every pass drains its gathers and every backward finalizes its last
reduce-scatter. What the host did once at capture and does not repeat on replay is redone by
the replay bookkeeping here: `.grad` attributes re-pointed at the graph's gradients, the
once-per-step cast marked stale for the next eager pass, counters advanced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .api import engine_of
from .chain import PassKind
from .engine import GTPEngine
from .errors import GraphCaptureError, GTPError
from .parameter import GTPParameter

_live_graphs: weakref.WeakSet[torch.cuda.CUDAGraph] = weakref.WeakSet()
# How torch and CUDA word a failure to capture (sync debug mode, capture-time checks).
_CAPTURE_FAILURES = ("synchroniz", "captur", "not permitted", "pinned")
_HOST_SYNC_HINT = (
    "a CUDA graph cannot contain host synchronizations (.item(), .tolist(), .cpu(), printing "
    "a CUDA tensor, nonzero / boolean-mask indexing and other data-dependent shapes) or "
    "optimizers built without capturable=True. Move that work out of the captured function, "
    "or capture only the parts that are static with gtp_wrap.graph_region"
)


def _require_cuda(engine: GTPEngine, what: str) -> None:
    if engine.device.type != "cuda" or not torch.cuda.is_available():
        raise GraphCaptureError(
            f"{what} needs a CUDA device, but the model is on '{engine.device}'. CUDA graphs "
            "do not exist on CPU: call the step function directly there"
        )


class _LastOp(TorchDispatchMode):
    """Remembers the last operator dispatched, to name the one a failed capture stopped at."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "unknown operation"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.name = str(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _refusing_host_syncs(what: str) -> Iterator[None]:
    """Run the body with host synchronizations raising GraphCaptureError, naming the operator.

    Note: the last warm-up step runs under this too, so a step that cannot be captured fails
    eagerly, before any capture: a capture abandoned half-way can leave NCCL unable to shut
    down cleanly.
    """
    op = _LastOp()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with op:
            yield
    except RuntimeError as e:
        if isinstance(e, GTPError) or not any(m in str(e) for m in _CAPTURE_FAILURES):
            raise  # not about capture: the user's own error, a chain mismatch, out of memory
        raise GraphCaptureError(
            f"{what} cannot be captured in a CUDA graph: it stopped at '{op.name}'. "
            f"{_HOST_SYNC_HINT}. Cause: {e}"
        ) from e
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _capture(
    engine: GTPEngine,
    graph: torch.cuda.CUDAGraph,
    fn: Callable[[], Any],
    what: str,
    pool: Any = None,
) -> Any:
    """Capture `fn()` into `graph`; turn a failure into a GraphCaptureError on every rank.

    Every rank reports its outcome through the store before any replay: a rank whose capture
    failed must not leave its peers replaying collectives it will never join.
    """
    error: Exception | None = None
    out = None
    try:
        # Entering the capture synchronizes the device on purpose: refuse syncs inside only.
        with torch.cuda.graph(graph, pool=pool), _refusing_host_syncs(what):
            out = fn()
    except Exception as e:
        error = e
        graph.reset()
    outcomes = engine.comm.exchange(f"capture-{what}", [int(error is None)])
    if isinstance(error, GTPError):
        raise error
    if error is not None:
        raise GraphCaptureError(f"capturing {what} failed: {error}") from error
    failed = [r for r, (ok,) in enumerate(outcomes) if not ok]
    if failed:
        graph.reset()
        raise GraphCaptureError(
            f"capturing {what} failed on rank(s) {failed} (see their error); no rank replays it"
        )
    _live_graphs.add(graph)
    return out


def release_graphs() -> None:
    """Free every CUDA graph gtp_wrap captured in this process; call it before
    `dist.destroy_process_group()`.

    Note: a captured NCCL collective holds on to its communicator, and NCCL waits for every
    graph using a communicator to be destroyed before destroying it, so shutting down with a
    graph still alive (a graphed step or region kept by a reference cycle, say) hangs. The
    released graphs cannot be replayed anymore.
    """
    for graph in list(_live_graphs):
        graph.reset()
    _live_graphs.clear()


def _describe(leaves: Sequence[Any]) -> list[Any]:
    """What must stay the same between replays: each tensor's shape, dtype, device and
    requires_grad; other values themselves."""
    return [
        (tuple(x.shape), x.dtype, str(x.device), "requires_grad" if x.requires_grad else "")
        if isinstance(x, torch.Tensor)
        else x
        for x in leaves
    ]


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[None]:
    """Eager warm-up runs on a side stream, as CUDA-graph capture expects of the first runs."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def _check_live(graph: torch.cuda.CUDAGraph, what: str) -> None:
    if graph not in _live_graphs:
        raise GraphCaptureError(
            f"{what} was released by gtp_wrap.release_graphs() and cannot be replayed; "
            "make a new one"
        )


class _Replay:
    """What the host must redo after each replay of captured GTP passes: what those passes did
    on the host once, at capture (counters, `.grad` attributes, the step number)."""

    def __init__(self, engine: GTPEngine, may_change_shards: bool) -> None:
        self.engine = engine
        self.may_change_shards = may_change_shards
        self._before = dataclasses.replace(
            engine.stats, blocking_by_pass=dict(engine.stats.blocking_by_pass)
        )
        self._step = engine.step
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.delta: dict[str, int] = {}
        self.blocking: dict[str, int] = {}
        self.steps = 0

    def captured(self, grads: dict[nn.Parameter, torch.Tensor]) -> _Replay:
        """Record what the capture changed; `grads` are re-pointed at after every replay."""
        before, after = self._before, self.engine.stats
        self.grads = grads
        self.delta = {
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(after)
            if isinstance(getattr(after, f.name), int) and f.name != "peak_gathered_bytes"
        }
        self.blocking = {
            k: v - before.blocking_by_pass.get(k, 0) for k, v in after.blocking_by_pass.items()
        }
        self.steps = self.engine.step - self._step
        return self

    def after_replay(self) -> None:
        for p, g in self.grads.items():
            p.grad = g
        s = self.engine.stats
        for name, d in self.delta.items():
            setattr(s, name, getattr(s, name) + d)
        for k, d in self.blocking.items():
            s.blocking_by_pass[k] = s.blocking_by_pass.get(k, 0) + d
        self.engine.step += self.steps
        if self.may_change_shards:
            # A captured optimizer step changes the shards without moving their version
            # counters: the next eager pass must re-cast.
            self.engine.invalidate_casts()


def _outside_passes(engine: GTPEngine, what: str) -> None:
    if engine._passes:
        raise GraphCaptureError(
            f"{what} was called inside a forward or backward of the wrapped model; call it "
            "between steps"
        )


class GraphedStep:
    """A training step function run eagerly for `warmup` calls, then captured and replayed
    (see `graph_step`)."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any], warmup: int) -> None:
        if warmup < 2:
            raise GraphCaptureError(
                f"warmup={warmup}: at least two eager steps must run before capture: the "
                "first records the chains, the second makes the gather buffers that "
                "prefetching needs, so that no gather buffer is allocated during capture"
            )
        self.engine = engine_of(model)
        _require_cuda(self.engine, "graph_step")
        self.engine.keep_buffers = True  # from the warm-up steps on, for the capture to reuse
        self.model = model
        self.fn = fn
        self.warmup = warmup
        self.calls = 0
        self.graph = torch.cuda.CUDAGraph()
        self._replay: _Replay | None = None  # set once captured
        self._static_in: list[Any] = []
        self._spec: Any = None
        self._signature: list[Any] = []
        self._static_out: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self._replay is None:
            if self.calls <= self.warmup:
                return self._eager(args, kwargs)
            self._replay = self._capture(args, kwargs)  # the capture call's inputs are static
        else:
            _check_live(self.graph, "this graphed step")
            self._load_inputs(args, kwargs)
        self.graph.replay()
        self._replay.after_replay()
        return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), self._static_out)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        # The last warm-up step refuses host synchronizations: see _refusing_host_syncs.
        checked = self.calls == self.warmup
        refuse = _refusing_host_syncs("the step") if checked else contextlib.nullcontext()
        with _side_stream(self.engine.device), refuse:
            return self.fn(*args, **kwargs)

    def _capture(self, args: tuple, kwargs: dict) -> _Replay:
        engine = self.engine
        _outside_passes(engine, "graph_step")
        leaves, self._spec = tree_flatten((args, kwargs))
        self._signature = _describe(leaves)
        self._static_in = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        # The captured backward writes fresh gradients (replays overwrite, never accumulate),
        # and the once-per-step cast of the shards must be part of the graph.
        stale = [name for name, p in self.model.named_parameters() if p.grad is not None]
        if stale:
            raise GraphCaptureError(
                f"'{stale[0]}' (and {len(stale) - 1} more) still has a gradient when the step "
                "is captured; a replayed step overwrites gradients rather than adding to them. "
                "Call zero_grad(set_to_none=True) between steps, and accumulate micro-batches "
                "inside the step function"
            )
        engine.invalidate_casts()
        replay = _Replay(engine, may_change_shards=True)
        static_args, static_kwargs = tree_unflatten(self._static_in, self._spec)
        self._static_out = _capture(
            engine, self.graph, lambda: self.fn(*static_args, **static_kwargs), "the step"
        )
        grads = {p: p.grad for p in self.model.parameters() if p.grad is not None}
        return replay.captured(grads)

    def _load_inputs(self, args: tuple, kwargs: dict) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        signature = _describe(leaves)
        if spec != self._spec or signature != self._signature:
            raise GraphCaptureError(
                f"the graphed step was captured for inputs {self._signature} but is called "
                f"with {signature}: a CUDA graph replays fixed tensor shapes, dtypes and "
                "non-tensor arguments. Keep them as captured (pad tensors to the captured "
                "shape), or make one graph_step per variant"
            )
        for static, new in zip(self._static_in, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(new, non_blocking=True)


def graph_step(model: nn.Module, fn: Callable[..., Any], *, warmup: int = 3) -> GraphedStep:
    """Capture a GTP training step in a CUDA graph and replay it on every later call.

    Args:
        model: a module wrapped by GTPWrap, on a CUDA device.
        fn: the step, called as `fn(*inputs)`: forward and `backward()` of the wrapped model,
            optionally the optimizer step (the optimizer built with `capturable=True`) and
            anything else with static shapes and no host synchronization. Its return value
            (tensors, possibly nested) is returned by every call.
        warmup: how many calls run eagerly first (each a real step, at least 2: the chains
            are recorded in the first and the gather buffers made in the second) before the
            next call is captured. The last of them refuses host synchronizations.

    Returns a callable taking the same inputs as `fn`. From the capture on, each call copies
    the tensor inputs into the graph's static inputs (shapes, dtypes and non-tensor values
    must stay those of the captured call), replays the graph, and returns copies of the outputs.
    Gradients are overwritten by each replay, as if `zero_grad(set_to_none=True)` had run
    before the step; accumulate over micro-batches inside `fn`. Python side effects in `fn`
    (counters, schedulers) happen once, at capture. Call `gtp_wrap.release_graphs()` before
    `dist.destroy_process_group()`: NCCL does not shut down while a graph uses it.
    """
    return GraphedStep(model, fn, warmup)


class _Region:
    """One submodule's forward and backward captured as two graphs sharing a memory pool.

    The region's passes run in their own engine scope (their own chains and gather buffers),
    so inside a replay no gather or reduce-scatter crosses the boundary: the model's eager
    passes skip the region's uses in their chains, and `fence` makes each replay wait for the
    collectives eager code still has in flight.
    """

    def __init__(
        self, engine: GTPEngine, module: nn.Module, sample_args: tuple, warmup: int, name: str
    ) -> None:
        self.engine, self.module, self.name = engine, module, name
        self.training = module.training
        self.signature = _describe(sample_args)
        self.static_in = [a.detach().clone().requires_grad_(a.requires_grad) for a in sample_args]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sharded = [
            p for p in self.params if isinstance(p, GTPParameter) and p._gtp_layout is not None
        ]
        self.wrt = [x for x in self.static_in if x.requires_grad] + self.params
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self._spec: Any = None
        self._replayed_in: object | None = None  # the model pass of the last forward replay
        before = {p: p.grad for p in self.params}
        # Warm-up and capture must leave no trace: their gradients are dropped and the model's
        # replicated grads are not all-reduced for them.
        try:
            with engine.scoped(name), engine.no_sync():
                self._warm_up(warmup)
                pool = torch.cuda.graph_pool_handle()
                for p in self.params:
                    p.grad = None
                fwd_replay = _Replay(engine, may_change_shards=False)
                self.static_out = _capture(
                    engine, self.fwd, self._forward, f"region {name} forward", pool
                )
                self.fwd_replay = fwd_replay.captured({})
                self.static_grad_out = [torch.zeros_like(o) for o in self.static_out]
                bwd_replay = _Replay(engine, may_change_shards=False)
                self.static_grad_in = _capture(
                    engine, self.bwd, self._backward, f"region {name} backward", pool
                )
                self.bwd_replay = bwd_replay.captured(
                    {p: p.grad for p in self.sharded if p.grad is not None}
                )
            # What the backward returns for each input of _RegionReplay (after the region):
            # the graph's gradient of an input or replicated parameter; None for sharded
            # weights (their reduce-scatter is in the graph) and inputs without gradients.
            by_input = dict(zip(map(id, self.wrt), self.static_grad_in))
            sharded = set(map(id, self.sharded))
            self.grad_of_input = [
                None if id(t) in sharded else by_input.get(id(t))
                for t in (*self.static_in, *self.params)
            ]
        finally:
            for p, g in before.items():
                p.grad = g
        self._claim_weights()

    def _claim_weights(self) -> None:
        """Register the weights this region gathers: their gradients must come from its
        replays alone (the engine refuses a reduce of one outside the region)."""
        kinds = (PassKind.FORWARD, PassKind.BACKWARD)
        chains = [self.engine._chains.get((kind, self.name, None)) for kind in kinds]
        used = {index for chain in chains if chain is not None for index in chain.order}
        for index in sorted(used):
            other = self.engine.region_weights.get(index)
            if other is not None:
                fqn = self.engine.layouts[index].fqn
                raise GraphCaptureError(
                    f"'{fqn}' is used by graphed regions {other} and {self.name}; each region's "
                    "weights must be its own (graph a module that holds both uses)"
                )
        self.engine.region_weights.update(dict.fromkeys(used, self.name))

    def _forward(self) -> list[torch.Tensor]:
        """The region's forward as one pass of its scope; returns its outputs flattened."""
        converted = self.engine._pre_forward(self.module, tuple(self.static_in), {})
        args = converted[0] if converted is not None else self.static_in
        out = None
        try:
            out = self.module(*args)
        finally:
            self.engine._post_forward(self.module, args, out)
        leaves, self._spec = tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            raise GraphCaptureError(
                f"graph_region: {type(self.module).__name__} must return tensors that require "
                "grad (a tensor or a nest of them); capture a module whose outputs all do"
            )
        return leaves

    def _backward(self) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(
            self.static_out, self.wrt, self.static_grad_out, allow_unused=True
        )

    def _warm_up(self, steps: int) -> None:
        with _side_stream(self.engine.device):
            for i in range(steps):
                last = i == steps - 1  # refuses host synchronizations: see graph_step
                with _refusing_host_syncs(self.name) if last else contextlib.nullcontext():
                    out = self._forward()
                    grads = [torch.zeros_like(o) for o in out]
                    torch.autograd.grad(out, self.wrt, grads, allow_unused=True)

    def __call__(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if (
            kwargs
            or not engine._passes
            or not torch.is_grad_enabled()
            or self.module.training != self.training
        ):
            return original(*args, **kwargs)  # evals and standalone calls run eagerly
        _check_live(self.fwd, f"graph_region {self.name}")
        if _describe(args) != self.signature:
            raise GraphCaptureError(
                f"graph_region {self.name} was captured for inputs {self.signature} but is "
                f"called with {_describe(args)}: pass tensors shaped, typed and flagged "
                "(requires_grad) like the sample_args it was captured with"
            )
        # A second replay in one forward would overwrite the activations the first one saved
        # inside the graph for its backward.
        if self._replayed_in is engine._passes[-1]:
            raise GraphCaptureError(
                f"graph_region {self.name} ({type(self.module).__name__}) was called twice in "
                "one forward; a graphed region runs once per step. Graph it only if it is "
                "called once, or leave it eager"
            )
        self._replayed_in = engine._passes[-1]
        with torch._C.DisableTorchFunctionSubclass():  # parameters as plain tensors here
            outs = _RegionReplay.apply(self, *args, *self.params)
        return tree_unflatten(list(outs), self._spec)


class _RegionReplay(torch.autograd.Function):
    """Replays a region's forward graph, and its backward graph in the model's backward."""

    @staticmethod
    def forward(ctx, region: _Region, *inputs: torch.Tensor):  # type: ignore[override]
        ctx.region = region
        region.engine.fence()
        for static, x in zip(region.static_in, inputs):
            static.detach().copy_(x)
        region.fwd.replay()
        region.fwd_replay.after_replay()
        return tuple(o.detach() for o in region.static_out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        region: _Region = ctx.region
        if any(p.grad is not None for p in region.sharded):
            raise GraphCaptureError(
                f"graph_region {region.name}: its weights already have gradients, and a replay "
                "overwrites them. Accumulating over backward passes is not supported in a "
                "graphed region: zero_grad(set_to_none=True) before each step"
            )
        engine = region.engine
        engine._ensure_backward()  # the model's backward pass, even if the region runs first
        engine.fence()
        for static, g in zip(region.static_grad_out, grads):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        region.bwd.replay()
        region.bwd_replay.after_replay()
        # The replay wrote the region's gradients: their hooks run when the model's backward
        # ends, with the others'.
        engine.mark_landed(p._gtp_layout.index for p in region.sharded if p._gtp_layout)
        return (None, *(None if g is None else g.clone() for g in region.grad_of_input))


_regions = itertools.count()


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def graph_region(
    model: nn.Module, module: nn.Module, sample_args: tuple, *, warmup: int = 3
) -> nn.Module:
    """Capture `module` (a part of the wrapped `model`) as CUDA graphs, now, and replay them
    whenever the model's training forward calls it; the rest of the step stays eager.

    For models with parts that cannot be captured (data-dependent shapes, host
    synchronizations): graph the static parts, as `torch.cuda.make_graphed_callables` does,
    with GTP's gathers and reduce-scatters of the region inside its graphs.

    Args:
        model: the module wrapped by GTPWrap, on a CUDA device.
        module: a submodule of `model`, called with positional tensor arguments and returning
            tensors that require grad; its weights must not be used outside it.
        sample_args: tensors shaped, typed and `requires_grad`-flagged like the real inputs.
        warmup: standalone forward + backward runs before capture (they leave no gradients).

    Returns `module`, whose forward now replays in training (grad enabled, same `training`
    flag as at capture) and runs eagerly otherwise. Each region runs once per step; its
    weights' gradients are overwritten by each backward (no accumulation across backwards).
    Call `gtp_wrap.release_graphs()` before `dist.destroy_process_group()`.
    """
    engine = engine_of(model)
    _require_cuda(engine, "graph_region")
    _outside_passes(engine, "graph_region")
    if not all(isinstance(a, torch.Tensor) for a in sample_args):
        raise GraphCaptureError("graph_region: sample_args must be a tuple of tensors")
    for other in model.modules():
        graphed = isinstance(other.forward, functools.partial) and isinstance(
            other.forward.func, _Region
        )
        if graphed and (other is module or _contains(other, module) or _contains(module, other)):
            raise GraphCaptureError(
                f"graph_region: {type(module).__name__} is, contains or lies inside a module "
                "that is graphed already; graph each module once, without nesting"
            )
    region = _Region(engine, module, tuple(sample_args), warmup, f"region{next(_regions)}")
    module.forward = functools.partial(region, module.forward)  # type: ignore[method-assign]
    return module
