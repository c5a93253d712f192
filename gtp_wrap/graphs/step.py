"""`graph_step`: a whole training step run eagerly for its warm-up calls, then captured in a
CUDA graph and replayed, with the inputs copied into static buffers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ..errors import GraphCaptureError
from ..runtime.engine import engine_of
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
        require_cuda(self.engine, "graph_step")
        self.engine.keep_buffers = True  # from the warm-up steps on, for the capture to reuse
        self.model = model
        self.fn = fn
        self.warmup = warmup
        self.calls = 0
        self.graph = torch.cuda.CUDAGraph()
        self._replay: Replay | None = None  # set once captured
        self._static_in: list[Any] = []
        self._spec: Any = None
        self._signature: list[Any] = []
        self._static_out: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self._replay is None:
            if self.calls <= self.warmup:
                return self._eager(args, kwargs)
            self._replay = self.capture(args, kwargs)  # the capture call's inputs are static
        else:
            check_live(self.graph, "this graphed step")
            self._load_inputs(args, kwargs)
        self.graph.replay()
        self._replay.after_replay()
        return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), self._static_out)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        # The last warm-up step refuses host synchronizations: see refusing_host_syncs.
        checked = self.calls == self.warmup
        refuse = refusing_host_syncs("the step") if checked else contextlib.nullcontext()
        with side_stream(self.engine.device), refuse:
            return self.fn(*args, **kwargs)

    def capture(self, args: tuple, kwargs: dict) -> Replay:
        engine = self.engine
        outside_passes(engine, "graph_step")
        leaves, self._spec = tree_flatten((args, kwargs))
        self._signature = describe(leaves)
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
        replay = Replay(engine, may_change_shards=True)
        static_args, static_kwargs = tree_unflatten(self._static_in, self._spec)
        self._static_out = capture(
            engine, self.graph, lambda: self.fn(*static_args, **static_kwargs), "the step"
        )
        grads = {p: p.grad for p in self.model.parameters() if p.grad is not None}
        return replay.captured(grads)

    def _load_inputs(self, args: tuple, kwargs: dict) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        signature = describe(leaves)
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
