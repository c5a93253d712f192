"""Optimizer state of a wrapped model's weights in their logical layout: in
`optimizer.state_dict()` and torch's `get_state_dict` / `set_state_dict`, as in
`gtp_wrap.checkpoint`.

[Note: optimizer state in torch's state dicts] An optimizer keeps the state of a sharded
weight (AdamW's `exp_avg`, `exp_avg_sq`, Muon's momentum) as a plain tensor of this rank's
rows, under the same key on every rank. torch.distributed.checkpoint takes plain tensors under
equal keys for one replicated value and writes rank 0's: `dcp.save` of torch's
`get_state_dict(model, optimizer)` kept rank 0's moments for every rank without an error (and
its load at another world size failed on the shape). FSDP2 has no such gap because its
parameters are DTensors and so is their state. Here each optimizer gets two hooks of its own:
`state_dict()` gives the per-element state of managed weights as DTensors of the weight's
layout (as `model.state_dict()` gives the weights), and `load_state_dict` takes DTensors of any
layout, or full tensors, back to this rank's part. torch has no hook at an optimizer's
construction, so they are registered at its first step, from a process-wide step hook, and by
`gtp_wrap.checkpoint.load`; state an optimizer loaded before that (DTensors or full tensors,
kept as they came) is converted then. torch's `get_state_dict` and `set_state_dict` step an
optimizer without state first, so they find the hooks, except on one that made its state at
construction (Adagrad) and has neither stepped nor loaded through `gtp_wrap.checkpoint`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.weight import CastWeight, ShardedWeight
from ..errors import WrapError
from ..runtime.engine import GTPEngine
from .state_dict import ManagedWeight, local_value, to_dtensor

_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_registered = False


def register_optimizer_hooks() -> None:
    """At the first wrap: every optimizer gets the state-dict hooks at its first step."""
    global _registered
    if not _registered:
        _registered = True
        register_optimizer_step_pre_hook(hook_optimizer)


def logical_state(param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """`state` of `param` with its per-element tensors as DTensors of the weight's layout, where
    `param` is a managed weight of a distributed engine; otherwise as it is."""
    managed = _managed(param)
    if managed is None:
        return state
    engine, w = managed
    return {
        k: to_dtensor(engine, w, v) if _shards_with_weight(param, w, k, v) else v
        for k, v in state.items()
    }


def _managed(param: torch.Tensor) -> tuple[GTPEngine, ManagedWeight] | None:
    """A sharded weight's engine and weight, or a tensor-parallel replicated one's: the
    weights whose `model.state_dict()` entries are DTensors."""
    w = getattr(param, "gtp_weight", None)
    if not (type(w) is ShardedWeight or (type(w) is CastWeight and w.tp is not None)):
        return None
    engine = w.runtime
    if not isinstance(engine, GTPEngine) or engine.mesh.device_mesh is None:
        return None
    return engine, w


def _shards_with_weight(param: torch.Tensor, w: ManagedWeight, key: str, value: Any) -> bool:
    """Whether `value` is state per element of `param`, laid out as the weight is (False for a
    scalar such as `step`). Any other tensor is refused: it describes this rank's rows in a way
    no other layout can be made from, and saved under one key it would load as one rank's on
    every rank."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.shape == param.shape:  # an uneven rank's shard may hold one element, or none
        return True
    if value.dim() == 0:
        return False
    raise WrapError(
        f"the optimizer's '{key}' state of '{w.fqn}' has shape {tuple(value.shape)}, not the "
        f"parameter's {tuple(param.shape)}: state that is not per element (a factored second "
        "moment) holds statistics of this rank's rows alone, so it cannot be saved for another "
        "layout, nor under one key for all ranks. Use an optimizer whose state is per element, "
        "or keep this weight whole (a LayerRule with action='replicate')"
    )


def hook_optimizer(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Give `optimizer` the state-dict hooks, once: at its first step, or where gtp_wrap meets
    it before (`gtp_wrap.checkpoint.load`; Adagrad, whose state exists from construction, is
    never stepped by torch's `get_state_dict`)."""
    if optimizer in _hooked:
        return
    _hooked.add(optimizer)
    optimizer.register_state_dict_post_hook(_to_dtensors)
    optimizer.register_load_state_dict_pre_hook(_to_local)
    # What a load before this step left: DTensors, or full tensors of a managed weight.
    for param, state in list(optimizer.state.items()):
        if _managed(param) is not None:
            optimizer.state[param] = _local_state(param, state)


def _params_by_key(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[Any, Any]:
    """The optimizer's parameter for each key of `sd["state"]`: the keys of `sd`'s param
    groups, in order, name the optimizer's groups' parameters, as `load_state_dict` pairs
    them."""
    groups = sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        return {}  # load_state_dict refuses it, naming the groups
    keys = itertools.chain.from_iterable(g["params"] for g in groups)
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return dict(zip(keys, params))


def _to_dtensors(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    param_of = _params_by_key(optimizer, sd)
    for key, state in sd["state"].items():
        if key in param_of:  # an optimizer may keep state of its own under other keys
            sd["state"][key] = logical_state(param_of[key], state)


def _to_local(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    # A new dict: the caller's (a DCP load target, say) keeps its DTensors.
    param_of = _params_by_key(optimizer, sd)
    state = {
        key: _local_state(param_of[key], s) if key in param_of else s
        for key, s in sd["state"].items()
    }
    return {**sd, "state": state}


def _local_state(param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """`state` of `param` with DTensors, and full tensors of a managed weight, as this rank's
    part, in tensors of their own (not views into a full tensor that would stay alive)."""
    managed = _managed(param)
    out = {}
    for k, v in state.items():
        if managed is not None and isinstance(v, torch.Tensor) and v.dim() > 0:
            local = local_value(*managed, v)
            if local.untyped_storage().nbytes() != local.numel() * local.element_size():
                local = local.clone()
            v = local
        out[k] = v
    return out
