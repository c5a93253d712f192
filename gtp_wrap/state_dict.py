"""State dicts: sharded weights as DTensors (so torch.distributed.checkpoint reshards them), and
full, unsharded exports that load into the unwrapped model.

A DTensor describes the logical, unpadded weight: the local block of every rank is exactly
torch.chunk's block along the shard dim, which is what the flat storage keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

if TYPE_CHECKING:
    from .engine import GTPEngine
    from .storage import ShardLayout


def _placements(engine: GTPEngine, dim: int) -> list:
    return [Replicate(), Shard(dim)] if engine.mesh.is_2d else [Shard(dim)]


def to_dtensor(engine: GTPEngine, lay: ShardLayout, local: torch.Tensor) -> DTensor:
    """A local block of a sharded weight (or of its optimizer state) as a DTensor of the logical,
    unpadded shape."""
    return DTensor.from_local(
        local,
        engine.mesh.device_mesh,
        _placements(engine, lay.dim),
        run_check=False,
        shape=lay.shape,
        stride=torch.empty(lay.shape, device="meta").stride(),
    )


def install_state_dict_hooks(root: nn.Module, engine: GTPEngine) -> None:
    """Make `state_dict()` return DTensors and `load_state_dict` accept them or full tensors."""

    def to_dtensors(module: nn.Module, sd: dict, prefix: str, _meta: Any) -> None:
        if engine.mesh.device_mesh is None:
            return
        for lay, fqns in zip(engine.layouts, engine.fqns):
            for fqn in fqns:
                if prefix + fqn in sd:
                    with torch._C.DisableTorchFunctionSubclass():
                        local = sd[prefix + fqn].detach()
                    sd[prefix + fqn] = to_dtensor(engine, lay, local)

    def to_local(sd: dict, prefix: str, *_: Any) -> None:
        for lay, fqns in zip(engine.layouts, engine.fqns):
            for fqn in fqns:
                value = sd.get(prefix + fqn)
                if value is None:
                    continue
                if isinstance(value, DTensor):
                    if list(value.placements) == _placements(engine, lay.dim):
                        value = value.to_local()
                    else:
                        value = value.full_tensor()
                if value.shape == lay.shape:
                    value = lay.local_rows_of(value)
                sd[prefix + fqn] = value

    root._register_state_dict_hook(to_dtensors)
    root._register_load_state_dict_pre_hook(to_local)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as full, unsharded CPU tensors under the original FQNs.

    A collective: every rank must call it. Loads into the unwrapped model with load_state_dict.
    """
    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        with torch._C.DisableTorchFunctionSubclass():
            out[key] = value.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full, unsharded tensors (as `full_state_dict` returns) into a wrapped module."""
    module.load_state_dict(state_dict)
