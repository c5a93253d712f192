"""`graph_region`: one submodule's forward and backward captured as two graphs (as
`torch.cuda.make_graphed_callables` does), for models whose other parts cannot be captured."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.parameter import GTPParameter
from ..core.weight import ShardedWeight
from ..errors import GraphCaptureError
from ..runtime.engine import GTPEngine, engine_of
from ..runtime.uses import RegionReplay
from .capture import (
    Replay,
    capture,
    check_live,
    describe,
    outside_passes,
    refusing_host_syncs,
    require_cuda,
    side_stream,
)


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
        self.signature = describe(sample_args)
        self.static_in = [a.detach().clone().requires_grad_(a.requires_grad) for a in sample_args]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.sharded = [
            p
            for p in self.params
            if isinstance(p, GTPParameter) and type(p.gtp_weight) is ShardedWeight
        ]
        self.weights = [p.gtp_weight for p in self.sharded]
        # The shards go to autograd.grad as gradient edges, which it takes as it takes tensors:
        # the region needs their uses' backward to run (it reads the reduce-scatter's result
        # from .grad), but refuses sharded parameters named as tensors, because a user's
        # autograd.grad would get nothing back for them.
        sharded = set(map(id, self.sharded))
        self.wrt = [x for x in self.static_in if x.requires_grad] + [
            get_gradient_edge(p) if id(p) in sharded else p for p in self.params
        ]
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
                fwd_replay = Replay(engine, may_change_shards=False)
                self.static_out = capture(
                    engine, self.fwd, self._forward, f"region {name} forward", pool
                )
                self.fwd_replay = fwd_replay.captured({})
                self.static_grad_out = [torch.zeros_like(o) for o in self.static_out]
                bwd_replay = Replay(engine, may_change_shards=False)
                self.static_grad_in = capture(
                    engine, self.bwd, self._backward, f"region {name} backward", pool
                )
                self.bwd_replay = bwd_replay.captured(
                    {p: p.grad for p in self.sharded if p.grad is not None}
                )
            # What the backward returns for each input of _RegionReplay (after the region):
            # the graph's gradient of an input or replicated parameter; None for sharded
            # weights (their reduce-scatter is in the graph) and inputs without gradients.
            by_input = dict(zip(map(id, self.wrt), self.static_grad_in))
            self.grad_of_input = [
                None if id(t) in sharded else by_input.get(id(t))
                for t in (*self.static_in, *self.params)
            ]
        finally:
            for p, g in before.items():
                p.grad = g
        engine.claim_region(name)

    def _forward(self) -> list[torch.Tensor]:
        """The region's forward as one pass of its scope; returns its outputs flattened."""
        converted = self.engine.open_forward(self.module, tuple(self.static_in), {})
        args = converted[0] if converted is not None else self.static_in
        try:
            out = self.module(*args)
        except BaseException as error:  # a failed capture is closed as failed, not recorded
            self.engine.end_forward(error)
            raise
        self.engine.end_forward(None)
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
        with side_stream(self.engine.device):
            for i in range(steps):
                last = i == steps - 1  # refuses host synchronizations: see graph_step
                with refusing_host_syncs(self.name) if last else contextlib.nullcontext():
                    out = self._forward()
                    grads = [torch.zeros_like(o) for o in out]
                    torch.autograd.grad(out, self.wrt, grads, allow_unused=True)

    def __call__(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if (
            kwargs
            or (current := engine.current_pass()) is None
            or not torch.is_grad_enabled()
            or self.module.training != self.training
        ):
            return original(*args, **kwargs)  # evals and standalone calls run eagerly
        check_live(self.fwd, f"graph_region {self.name}")
        if describe(args) != self.signature:
            raise GraphCaptureError(
                f"graph_region {self.name} was captured for inputs {self.signature} but is "
                f"called with {describe(args)}: pass tensors shaped, typed and flagged "
                "(requires_grad) like the sample_args it was captured with"
            )
        # A second replay in one forward would overwrite the activations the first one saved
        # inside the graph for its backward.
        if self._replayed_in is current:
            raise GraphCaptureError(
                f"graph_region {self.name} ({type(self.module).__name__}) was called twice in "
                "one forward; a graphed region runs once per step. Graph it only if it is "
                "called once, or leave it eager"
            )
        self._replayed_in = current
        with torch._C.DisableTorchFunctionSubclass():  # parameters as plain tensors here
            outs = RegionReplay.apply(self, *args, *self.params)
        return tree_unflatten(list(outs), self._spec)

    def replay_forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Replay the forward graph on `inputs` (the region's, then its parameters')."""
        self.engine.fence()
        for static, x in zip(self.static_in, inputs):
            static.detach().copy_(x)
        self.fwd.replay()
        self.fwd_replay.after_replay()
        return tuple(o.detach() for o in self.static_out)

    def replay_backward(self, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
        """Replay the backward graph for the outputs' `grads`; the inputs' gradients."""
        if any(p.grad is not None for p in self.sharded):
            raise GraphCaptureError(
                f"graph_region {self.name}: its weights already have gradients, and a replay "
                "overwrites them. Accumulating over backward passes is not supported in a "
                "graphed region: zero_grad(set_to_none=True) before each step"
            )
        engine = self.engine
        engine.ensure_backward()  # the model's backward pass, even if the region runs first
        engine.fence()
        for static, g in zip(self.static_grad_out, grads):
            if g is None:
                static.zero_()
            else:
                static.copy_(g)
        self.bwd.replay()
        self.bwd_replay.after_replay()
        # The replay wrote the region's gradients: their hooks run when the model's backward
        # ends, with the others'.
        engine.region_landed(self.weights)  # type: ignore[arg-type]
        return tuple(None if g is None else g.clone() for g in self.grad_of_input)


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
    require_cuda(engine, "graph_region")
    outside_passes(engine, "graph_region")
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
