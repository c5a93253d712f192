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
    parameters. Sharded grads are disjoint across the GTP group and identical across dp, so
    their part of the norm is reduced over the GTP group only; replicated grads are the same on
    every rank and enter once.
    """
    engine = engine_of(module)
    with torch._C.DisableTorchFunctionSubclass():
        params = [w.param for w in engine.weights]
        sharded_ids = {id(p) for p in params}
        sharded: list[torch.Tensor] = [p for p in params if p.grad is not None]
        replicated: list[torch.Tensor] = [
            p for p in module.parameters() if id(p) not in sharded_ids and p.grad is not None
        ]
        device = engine.device
        norm_type = float(norm_type)
        zero = torch.zeros((), device=device)
        local = (
            torch.nn.utils.get_total_norm([_grad(p) for p in sharded], norm_type, foreach=foreach)
            if sharded
            else zero
        )
        rest = (
            torch.nn.utils.get_total_norm(
                [_grad(p) for p in replicated], norm_type, foreach=foreach
            )
            if replicated
            else zero
        )
        local, rest = local.to(device, torch.float32), rest.to(device, torch.float32)
        gtp = engine.mesh.gtp  # sharded grads are disjoint over it, identical over dp
        if norm_type == float("inf"):
            engine.comm.wait(engine.comm.all_reduce(local, gtp, _WHAT, dist.ReduceOp.MAX))
            total = torch.maximum(local, rest)
        else:
            powered = local.pow(norm_type)
            engine.comm.wait(engine.comm.all_reduce(powered, gtp, _WHAT, dist.ReduceOp.SUM))
            total = (powered + rest.pow(norm_type)).pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):  # every rank sees the same total
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )
        torch.nn.utils.clip_grads_with_norm_(sharded + replicated, max_norm, total, foreach)
    return total


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # filtered above
    return p.grad
