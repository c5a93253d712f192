"""State dicts: sharded weights as DTensors (so torch.distributed.checkpoint reshards them), and
full, unsharded exports that load into the unwrapped model.

A DTensor describes the logical, unpadded weight: the local block of every rank is exactly
torch.chunk's block along the shard dim, which is what the flat storage keeps.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from ..core.weight import CastWeight, ShardedWeight
from ..errors import WrapError
from ..runtime.engine import GTPEngine, engines_of


def dtensor_layout(
    engine: GTPEngine, w: ShardedWeight | CastWeight
) -> tuple[DeviceMesh, list[Placement], torch.Size]:
    """The mesh, placements and logical, unpadded shape of a managed weight's DTensor: a
    sharded weight's rows over gtp (of its tp block, where tensor parallelism split it), an
    expert stack's over the expert mesh (its experts over ep, its rows over egtp), or a
    tensor-parallel block GTP replicates (split over tp only, so one rank of each tp block
    writes it to a checkpoint)."""
    mesh, shape = engine.mesh, dtensor_shape(w)
    if type(w) is ShardedWeight and w.axis is mesh.egtp:
        assert mesh.expert_mesh is not None  # expert stacks exist only beside one
        return mesh.expert_mesh, mesh.expert_placements(w.geometry.dim), shape
    dim = w.geometry.dim if type(w) is ShardedWeight else None
    assert mesh.device_mesh is not None  # only distributed engines make DTensors
    return mesh.device_mesh, mesh.placements(dim, None if w.tp is None else w.tp.placement), shape


def to_dtensor(engine: GTPEngine, w: ShardedWeight | CastWeight, local: torch.Tensor) -> DTensor:
    """This rank's part of a managed weight (or of its optimizer state) as its DTensor (see
    `dtensor_layout`)."""
    device_mesh, placements, shape = dtensor_layout(engine, w)
    return DTensor.from_local(
        local,
        device_mesh,
        placements,
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def full_tensor(value: DTensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective of its mesh).

    [Note: a quiet redistribution] A weight sharded over gtp inside tensor parallelism lies as
    (_StridedShard, Shard) on the (gtp, tp) mesh, which DTensor makes whole by two all-gathers
    one after the other, and logs on every rank that this is suboptimal and "may give
    inconsistent results between ranks due to different reduction orders". An all-gather
    reduces nothing: the two give the exact tensor, and a checkpoint of a TP model is written
    rarely, so the warning is only noise in every rank's log, and is held back here."""
    level = _REDISTRIBUTE_LOG.level
    _REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    try:
        return value.full_tensor()
    finally:
        _REDISTRIBUTE_LOG.setLevel(level)


def gather_whole(engine: GTPEngine) -> Callable[[ShardedWeight], torch.Tensor]:
    """`gather(w)`: the whole logical tensor of a sharded weight, from every rank's part (a
    collective every rank calls in the same order; in one process, the weight itself)."""

    def gather(w: ShardedWeight) -> torch.Tensor:
        local = w.param.detach()
        if engine.mesh.device_mesh is None:
            return local.clone()
        whole = full_tensor(to_dtensor(engine, w, local))
        # Over a group of one DTensor hands back the local tensor itself: the whole weight
        # must be a tensor of its own, which the caller may write.
        same = whole.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        return whole.clone() if same else whole

    return gather


def local_box(
    engine: GTPEngine, w: ShardedWeight | CastWeight
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's part of a managed weight in its logical whole, as its
    DTensor places it (the whole weight in one process)."""
    if engine.mesh.device_mesh is None:
        shape = tuple(dtensor_shape(w))
        return (0,) * len(shape), shape
    device_mesh, placements, shape = dtensor_layout(engine, w)
    local, offset = compute_local_shape_and_global_offset(shape, device_mesh, placements)
    return tuple(offset), tuple(local)


def dtensor_shape(w: ShardedWeight | CastWeight) -> torch.Size:
    """The logical shape of a managed weight: over every tp rank, and an expert stack's over
    every ep rank."""
    if isinstance(w, ShardedWeight):
        return (w.tp or w.ep or w.geometry).shape
    assert w.tp is not None  # a replicated weight is managed beside tensor parallelism only
    return w.tp.shape


def local_offset(engine: GTPEngine) -> Callable[[ShardedWeight], tuple[int, ...]]:
    """`offset_of(w)`: where this rank's part of a sharded weight starts in the whole."""
    return lambda w: local_box(engine, w)[0]


# A sharded weight, or a tensor-parallel one GTP replicates: the weights whose state is a DTensor.
ManagedWeight = ShardedWeight | CastWeight


def install_state_dict_hooks(root: nn.Module, engine: GTPEngine) -> None:
    """Make `state_dict()` return DTensors and `load_state_dict` accept them or full tensors.

    The hooks sit on each module that owns a sharded weight (or a tensor-parallel replicated
    one, which is a DTensor over tp), not only on the root, so the state dict of any submodule
    (`model.backbone.state_dict()`) converts its weights too.
    """
    # A module registered under two names (a block reused in a ModuleList) is reached through
    # both FQNs: one entry per parameter name of each module.
    owned: dict[int, tuple[nn.Module, dict[str, ManagedWeight]]] = {}
    managed: list[tuple[tuple[str, ...], ManagedWeight]] = [(w.fqns, w) for w in engine.weights]
    managed += [((w.fqn,), w) for w in engine.casts.cast_weights if w.tp is not None]
    for fqns, w in managed:
        for fqn in fqns:
            path, _, name = fqn.rpartition(".")
            module = root.get_submodule(path)
            owned.setdefault(id(module), (module, {}))[1][name] = w
    for module, by_name in owned.values():
        weights = list(by_name.items())
        handle = module._register_state_dict_hook(functools.partial(_to_dtensors, engine, weights))
        # [Note: module hooks see logical weights] A module may convert its own state dict with
        # hooks (a fused QKV weight saved as separate Q, K, V copies and merged back on load).
        # Those hooks must see the weight's DTensor, not this rank's rows: the conversion runs
        # before the module's post-hooks, and the load pre-hook (registered last) after the
        # module's own, once they have put the logical weight back under its key.
        hooks = cast("OrderedDict[int, Any]", module._state_dict_hooks)  # typed as a dict
        hooks.move_to_end(handle.id, last=False)
        module._register_load_state_dict_pre_hook(
            functools.partial(_to_local, engine, module, weights)
        )


def _to_dtensors(
    engine: GTPEngine,
    weights: list[tuple[str, ManagedWeight]],
    module: nn.Module,
    sd: dict,
    prefix: str,
    _meta: Any,
) -> None:
    if engine.mesh.device_mesh is None:
        return
    for name, w in weights:
        if prefix + name in sd:
            with torch._C.DisableTorchFunctionSubclass():
                local = sd[prefix + name].detach()
            sd[prefix + name] = to_dtensor(engine, w, local)


def _to_local(
    engine: GTPEngine,
    module: nn.Module,
    weights: list[tuple[str, ManagedWeight]],
    sd: dict,
    prefix: str,
    meta: dict,
    *_: Any,
) -> None:
    loaded = [name for name, _ in weights if prefix + name in sd]
    if loaded and meta.get("assign_to_params_buffers", False):
        raise WrapError(
            f"load_state_dict(assign=True) into a wrapped module would replace its sharded "
            f"parameters ('{prefix}{loaded[0]}', ...) with plain tensors; load without "
            "assign (the values are copied into the shards), or load into the module before "
            "GTPWrap"
        )
    for name, w in weights:
        value = sd.get(prefix + name)
        if value is None:
            continue
        value = local_value(engine, w, value)
        param = module._parameters[name]
        if param is not None and _same_elements(value, param):
            # The in-place round trip (state_dict, dcp.load, load_state_dict) hands back the
            # shard itself, possibly with other strides along size-1 dims: copy_ would refuse
            # that overlap, so hand over the parameter, which copies onto itself as a no-op.
            value = param.detach()
        sd[prefix + name] = value


def local_value(engine: GTPEngine, w: ManagedWeight, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loaded value of `w`: the same DTensor's local block as it is, or
    the rows of the full tensor (a DTensor of another layout is made full first)."""
    if isinstance(value, DTensor):
        device_mesh, placements, _ = dtensor_layout(engine, w)
        if value.device_mesh == device_mesh and list(value.placements) == placements:
            return value.to_local()
        value = full_tensor(value)
    if isinstance(w, CastWeight):  # tensor-parallel, replicated over gtp
        assert w.tp is not None
        return w.tp.local_of(value) if value.shape == w.tp.shape else value
    lay = w.geometry
    if w.tp is not None and value.shape == w.tp.shape:
        value = w.tp.local_of(value)
    if w.ep is not None and value.shape == w.ep.shape:
        value = w.ep.local_of(value)
    return lay.local_rows_of(value) if value.shape == lay.shape else value


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of the very same elements."""
    return (
        a.shape == b.shape
        and a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and all(s == t for n, s, t in zip(a.shape, a.stride(), b.stride()) if n > 1)
    )


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as full, unsharded CPU tensors under the original FQNs.

    A collective: every rank must call it. Loads into the unwrapped model with load_state_dict.
    A wrapped module's ranks first meet at a check (through the store): a rank that calls it
    alone gets a CollectiveTimeoutError naming the ranks that did not, after the policy's
    collective_timeout_s, rather than waiting in DTensor's all-gathers for ever.
    """
    for engine in engines_of(module.parameters()):  # its own, or a wrapped model's it is in
        _meet_for_full_state_dict(engine)
    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = full_tensor(value)
        with torch._C.DisableTorchFunctionSubclass():
            out[key] = value.detach().to("cpu", copy=True)
    return out


def _meet_for_full_state_dict(engine: GTPEngine) -> None:
    """Every rank at the check before the gathers, none with a failure behind it: DTensor's
    gathers are not watched, so a rank that went in alone would wait in them for ever."""
    failure = engine.watch.failure
    if failure is not None:
        raise WrapError(
            f"full_state_dict after this rank's {failure['error']} ({failure['where']}): the "
            "ranks are no longer at the same checks; restart from the last checkpoint"
        )
    engine.agreement.exchange(
        "full_state_dict", [], "full_state_dict(model), which every rank must call"
    )
    peer = engine.watch.peer_failure()  # a peer that failed, its check key left behind
    if peer is not None:
        raise peer


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full, unsharded tensors (as `full_state_dict` returns) into a wrapped module."""
    module.load_state_dict(state_dict)
