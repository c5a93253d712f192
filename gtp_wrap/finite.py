"""Non-finite gradients named: which weights' reduced gradients hold NaN or Inf, checked once
per step at the optimizer step (GTPPolicy.check_finite) or on demand.

A NaN on one rank spreads through the reductions to every rank, but a sharded weight's bad rows
land on the ranks that own them only: the per-weight flags are all-reduced over the world, so
every rank sees the same weights as bad and takes the same decision (raise, or skip the step).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import NonFiniteError
from .runtime.engine import GTPEngine, engine_of

# The wrapped models whose policy asks for the check, with their parameters' ids.
_checked: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()
_hook_installed = False


def nonfinite_grads(model: nn.Module) -> list[str]:
    """The names of the parameters of a wrapped `model` whose gradients hold NaN or Inf on some
    rank (in `named_parameters` order; empty when all are finite). A collective: every rank
    calls it, and every rank gets the same list."""
    engine = engine_of(model)
    named = list(model.named_parameters())
    with torch._C.DisableTorchFunctionSubclass():
        grads = [(i, p.grad) for i, (_, p) in enumerate(named) if p.grad is not None]
        bad = torch.zeros(len(named), device=engine.device)
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for i, g in grads:
            by_dtype.setdefault(g.dtype, []).append((i, g))
        for group in by_dtype.values():
            norms = torch._foreach_norm([g for _, g in group])
            flags = (~torch.isfinite(torch.stack(norms))).float()
            bad[torch.tensor([i for i, _ in group], device=engine.device)] = flags
        what = "all-reduce of the non-finite gradient flags"
        engine.comm.wait(engine.comm.all_reduce(bad, engine.mesh.world, what, dist.ReduceOp.MAX))
        engine.finite_checked = engine.step
        return [named[i][0] for i in bad.nonzero().flatten().tolist()]


def check_at_steps(model: nn.Module) -> None:
    """Check `model`'s gradients at every optimizer step over its parameters (once per
    backward: a step whose gradients `nonfinite_grads` checked already is not checked again)."""
    global _hook_installed
    _checked[model] = frozenset(id(p) for p in model.parameters())
    if not _hook_installed:
        register_optimizer_step_pre_hook(_before_step)
        _hook_installed = True


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # a graph_step's capture: no host read there
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model, params in list(_checked.items()):
        engine: GTPEngine = engine_of(model)
        # Checked already for this backward (engine.step counts the model's backwards, when
        # it has sharded weights to count them by; without, every step is checked).
        if ids.isdisjoint(params) or engine.finite_checked == engine.step > 0:
            continue
        bad = nonfinite_grads(model)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise NonFiniteError(
                f"the gradient of '{bad[0]}'{more} holds NaN or Inf after backward {engine.step} "
                "(counting from 1): a loss or input went non-finite on some rank. The optimizer "
                "did not step; zero the gradients and go on, or lower the learning rate"
            )
