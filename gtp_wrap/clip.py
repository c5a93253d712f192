"""Gradient clipping by the global norm over all shards, replicated parameters counted once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .runtime.engine import engine_of

_WHAT = "grad-norm all-reduce"


def clip_grad_norm_(
    module: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the grads of a wrapped module in place; return the total norm before clipping.

    The arguments are `torch.nn.utils.clip_grad_norm_`'s, with the module in place of its
    parameters; the norm is `grad_norm`'s. A collective: every rank calls it.
    """
    total, with_grad = _total_norm(module, float(norm_type), foreach)
    if error_if_nonfinite and not torch.isfinite(total):  # every rank sees the same total
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; set error_if_nonfinite=False to clip anyway"
        )
    with torch._C.DisableTorchFunctionSubclass():
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach)
    return total


def grad_norm(
    module: nn.Module, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The total norm of a wrapped module's gradients, over every rank's shards: what
    `torch.nn.utils.get_total_norm` gives for the unwrapped model's gradients (which over a
    sharded model's `.grad`s would be each rank's norm of its own rows). For logging; a
    collective: every rank calls it.

    Sharded grads are disjoint across the GTP group and identical across dp, so their part of
    the norm is reduced over the GTP group only; a tensor-parallel weight's (sharded by
    torch's TP) is disjoint across tp too, and reduced over it as well; replicated grads are
    the same on every rank and enter once. Expert stacks' grads are disjoint over egtp and ep,
    and reduced over both.
    """
    return _total_norm(module, float(norm_type), foreach)[0]


def _total_norm(
    module: nn.Module, norm_type: float, foreach: bool | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`grad_norm`, and the parameters that have a gradient."""
    engine = engine_of(module)
    mesh = engine.mesh
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    with torch._C.DisableTorchFunctionSubclass():
        experts = {id(w.param) for w in engine.weights if w.axis is mesh.egtp}
        sharded_ids = {id(w.param) for w in engine.weights} - experts
        split_by_tp = {id(w.param) for w in engine.weights if w.tp is not None and w.tp.sharded}
        split_by_tp |= {
            id(c.param) for c in engine.casts.cast_weights if c.tp is not None and c.tp.sharded
        }
        with_grad: list[torch.Tensor] = [p for p in module.parameters() if p.grad is not None]
        # By where their grads differ: over gtp and tp, over gtp, over tp, nowhere.
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for p in with_grad:
            if id(p) not in experts:
                parts[(id(p) not in sharded_ids) * 2 + (id(p) not in split_by_tp)].append(p)

        def powered(params: list[torch.Tensor]) -> torch.Tensor:
            # A rank's shard can be empty (fewer rows than ranks); it adds nothing to any norm,
            # and torch's infinity norm has no value for an empty tensor.
            grads = [g for g in (_grad(p) for p in params) if g.numel()]
            if not grads:
                return torch.zeros((), device=engine.device)
            norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
            norm = norm.to(engine.device, torch.float32)
            return norm if inf else norm.pow(norm_type)

        def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.maximum(a, b) if inf else a + b

        over_gtp = torch.stack([powered(parts[0]), powered(parts[1])])
        engine.comm.wait(engine.comm.all_reduce(over_gtp, mesh.gtp, _WHAT, op))
        over_tp = combine(over_gtp[0], powered(parts[2]))
        engine.comm.wait(engine.comm.all_reduce(over_tp, mesh.tp, _WHAT, op))
        total = combine(combine(over_tp, over_gtp[1]), powered(parts[3]))
        if experts:  # expert stacks' grads differ over egtp and ep, the same over edp
            over_experts = powered([p for p in with_grad if id(p) in experts])
            for axis in (mesh.egtp, mesh.ep):
                engine.comm.wait(engine.comm.all_reduce(over_experts, axis, _WHAT, op))
            total = combine(total, over_experts)
        if not inf:
            total = total.pow(1.0 / norm_type)
    return total, with_grad


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # filtered above
    return p.grad
