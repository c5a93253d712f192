"""The wrap-time build: from a module and its parameter plans to sharded weights in place.

In order: every rank checks that it plans what its peers plan (through the store, before any
collective); the sharded weights are laid out in flat storage; every rank starts from rank 0's
parameters and buffers (as DDP does); each rank copies its rows into the storage and registers
a `GTPParameter` viewing them wherever the original parameter was registered; with a compute
dtype, replicated floating-point parameters are registered as parameters read through a copy
in that dtype, except those of running-statistics norms under `norm_in_fp32` (without it, their
running statistics are cast to that dtype instead). The plans' decisions are kept for
`gtp_wrap.describe`. This is the part a meta-device init replaces.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm.agreement import Agreement, first_difference, stable_hash
from ..comm.comm import Comm
from ..config.plan import Decision, ParameterPlan, is_stat_norm
from ..config.policy import GTPPolicy
from ..errors import WrapError
from ..geometry import lay_out
from ..mesh import GTPMesh
from ..parallel.experts import EPLayout
from ..parallel.tensor import TPLayout
from ..precision import fp8
from ..precision.encoding import Packing, Precision, make_encodings
from .parameter import make_gtp_parameter, register_with_optimizers
from .storage import FlatStorage
from .weight import CastWeight, Runtime, ShardedWeight

# Policy fields that decide which collectives a step issues, in what order and on what dtypes:
# ranks that differ in one would pair unrelated collectives.
AGREED_FIELDS = (
    "prefetch_depth", "group_numel", "loss_reduction", "param_dtype", "reduce_dtype",
    "gather_dtype", "fp8_matmul", "collectives", "norm_in_fp32", "gather_per_block",
    "expert_parallel", "check_finite",
)  # fmt: skip

# The parameters wrapping replaced (by id): an optimizer built before GTPWrap holds these, gets
# no gradients for them, and would silently train nothing but what was left in place.
_replaced: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
# Optimizers checked, with how many parameters they held then (add_param_group adds more).
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_check_installed = False


# Optimizers whose step reads a whole parameter at once (a factored second moment and the
# parameter's RMS, an orthogonalized matrix, dot products over all parameters): on a shard they
# would step each rank from its own rows alone, and the ranks' weights would drift apart.
_WHOLE_PARAMETER_OPTIMIZERS = (torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Muon)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    _checked[optimizer] = count
    whole = isinstance(optimizer, _WHOLE_PARAMETER_OPTIMIZERS)
    for group in optimizer.param_groups:
        for p in group["params"]:
            replaced = _replaced.get(id(p))
            if replaced is not None and replaced is p:
                raise WrapError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} "
                    "that GTPWrap replaced (it was built before wrapping), so it would not train "
                    "the wrapped weights; build the optimizer from model.parameters() after "
                    "GTPWrap"
                )
            if not (whole and p.requires_grad):
                continue
            w = getattr(p, "gtp_weight", None)
            if (isinstance(w, ShardedWeight) and w.axis.size > 1) or (
                isinstance(w, CastWeight) and w.tp is not None
            ):
                raise WrapError(
                    f"{type(optimizer).__name__} computes each step from whole parameters, but "
                    f"'{w.fqn}' is split over ranks: each rank would step it from its own rows and "
                    "the ranks' weights would drift apart. Use an optimizer that works element "
                    "by element (AdamW, Adam, SGD, RMSprop, Adagrad), gtp_wrap.optim.Muon for "
                    "Muon, or keep these weights whole (a LayerRule with action='replicate')"
                )


def install_process_hooks() -> None:
    """What wrapping changes process-wide, done at the first wrap rather than at import: the
    optimizers' multi-tensor kernels take GTP parameters, and an optimizer holding replaced
    parameters, or stepping sharded ones from whole parameters, is refused at its step."""
    global _check_installed
    register_with_optimizers()
    if not _check_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _check_installed = True


@dataclasses.dataclass
class Built:
    """What the build made."""

    weights: list[ShardedWeight]
    storage: FlatStorage
    packing: Packing | None
    cast_weights: list[CastWeight]
    replicated: list[nn.Parameter]  # as registered now (a cast parameter, or the original)
    replicated_names: list[str]
    decisions: tuple[Decision, ...]  # why each parameter is sharded or replicated, plan order


def check_ranks_agree(
    plans: list[ParameterPlan],
    policy: GTPPolicy,
    agreement: Agreement,
    layouts: dict[int, TPLayout],
) -> None:
    """Every rank must plan the same parameters the same way, with the same policy, checked
    before any collective (a tensor-parallel weight by its global shape: tp ranks' local
    blocks may differ by a row)."""
    fields = [f"{name}={getattr(policy, name)!r}" for name in AGREED_FIELDS]
    shapes = [layouts[id(p.param)].shape if id(p.param) in layouts else p.param.shape
              for p in plans]  # fmt: skip
    sigs = [stable_hash(field) for field in fields] + [
        stable_hash(f"{p.fqns[0]}|{tuple(shape)}|{p.param.dtype}|{p.shard_dim}|{p.expert}")
        for p, shape in zip(plans, shapes)
    ]
    diff = first_difference(
        agreement.exchange(
            "wrap", sigs, "the check that every rank wrapped the same model with the same policy"
        )
    )
    if diff is None:
        return
    pos, _ = diff
    if pos < len(fields):
        raise WrapError(
            f"ranks wrapped with different policies: this rank has GTPPolicy.{fields[pos]}, "
            "another rank a different value. Give every rank the same policy"
        )
    pos -= len(fields)
    here = plans[pos] if pos < len(plans) else None
    what = (
        f"'{here.fqns[0]}' (shape {tuple(here.param.shape)}, shard dim {here.shard_dim})"
        if here
        else "nothing"
    )
    raise WrapError(
        f"ranks disagree on parameter #{pos}: this rank has {what}. Build the same model "
        "with the same policy on every rank before wrapping"
    )


def build(
    root: nn.Module,
    plans: list[ParameterPlan],
    policy: GTPPolicy,
    precision: Precision,
    mesh: GTPMesh,
    comm: Comm,
    runtime: Runtime,
    device: torch.device,
    layouts: dict[int, TPLayout],
    ep_layouts: dict[int, EPLayout],
) -> Built:
    """Shard the planned weights of `root` in place (see the module docstring); `layouts`:
    the tensor-parallel layouts of parameters that were DTensors (parallel/tensor.py);
    `ep_layouts`: the expert stacks partitioned over ep (parallel/experts.py), of which this
    rank shards its experts."""
    sharded = [p for p in plans if p.shard_dim is not None]
    axes = [mesh.egtp if p.expert else mesh.gtp for p in sharded]
    eps = [ep_layouts.get(id(p.param)) for p in sharded]
    geometries, numels = lay_out(
        [
            (
                p.param.shape if ep is None else torch.Size([ep.count, *p.param.shape[1:]]),
                p.shard_dim,
                p.param.dtype,
                axis.rank,
                axis.size,
            )  # type: ignore[misc]
            for p, axis, ep in zip(sharded, axes, eps)
        ],  # fmt: skip
        align=policy.pad_for_alignment,
        block=fp8.BLOCK if precision.packed else 1,  # NVFP4's 16 divides it
    )
    copied = [geo for geo in geometries if precision.keeps_copy(geo)]
    storage = FlatStorage(numels, device, precision.param_dtype, copied)
    weights = [
        ShardedWeight(
            i,
            plan.fqns,
            geo,
            axis,
            mesh.replicas(axis),
            runtime,
            precision.compute_dtype(geo.dtype),
        )
        for i, (plan, geo, axis) in enumerate(zip(sharded, geometries, axes))
    ]
    slots = [storage.compute_slot(geo) for geo in geometries]
    encodings, packing = make_encodings(
        precision, geometries, [w.fqn for w in weights], slots, storage.params, device
    )
    on_meta = any(p.param.is_meta for p in plans)
    if on_meta:  # its values come later, from its inits (core/meta_init.py)
        _allocate_replicated_and_buffers(root, plans, device)
    else:
        _sync_from_rank0(root, plans, comm, layouts, mesh)
    for plan, w, encoding, ep, slot in zip(sharded, weights, encodings, eps, slots):
        w.tp, w.ep = layouts.get(id(plan.param)), ep
        w.unit = plan.fqns[0].rpartition(".")[0] if plan.expert else None
        if w.tp is not None:  # a pass's metadata queries answer as the DTensor would
            w.meta = torch.empty(w.tp.shape, dtype=w.meta.dtype, device="meta")
        geo = w.geometry
        flat = storage.params[geo.dtype]
        whole = plan.param.detach()
        with torch.no_grad():
            if not on_meta:
                geo.local_view(flat).copy_(
                    geo.local_rows_of(whole if ep is None else ep.local_of(whole))
                )
        _replace(plan, make_gtp_parameter(geo.local_view(flat), plan.param.requires_grad, w))
        w.encoding = encoding
        w.local = geo.local_of_slot(slot)
    replicated = [p for p in plans if p.shard_dim is None]
    cast_weights = []
    registered: list[nn.Parameter] = []
    dtype = precision.param_dtype
    for plan in replicated:
        param = plan.param
        layout = layouts.get(id(param))
        if layout is None and (
            dtype is None
            or plan.keep_dtype
            or not param.is_floating_point()
            or param.dtype == dtype
        ):
            registered.append(param)
            continue
        # Read through a copy in the compute dtype (made once per step, runtime/casts.py), so
        # the whole forward runs in one dtype; a tensor-parallel one also to be handed to its
        # module as a DTensor, in its own dtype where no other is asked for.
        cast_dtype = param.dtype if dtype is None or plan.keep_dtype else dtype
        cast = CastWeight(plan.fqns[0], param, cast_dtype, runtime)
        cast.tp = layout
        if layout is not None:
            cast.meta = torch.empty(layout.shape, dtype=cast_dtype, device="meta")
        new = make_gtp_parameter(param.detach(), param.requires_grad, cast)
        _replace(plan, new)
        cast_weights.append(cast)
        registered.append(new)
    if not on_meta:  # a meta build's statistics are cast after their init (api.py)
        cast_norm_statistics(root, policy, precision)
    names = [plan.fqns[0] for plan in replicated]
    # Plain data, so the originals the plans were made of (full parameters) are not kept alive.
    decisions = tuple(plan.decision() for plan in plans)
    return Built(weights, storage, packing, cast_weights, registered, names, decisions)


def cast_norm_statistics(root: nn.Module, policy: GTPPolicy, precision: Precision) -> None:
    """Under a param_dtype with `norm_in_fp32: false`, cast the floating running statistics of
    every running-statistics norm to it, in place, so they agree with its parameters cast to
    it. After their init: the unwrapped model initializes them in their own dtype."""
    dtype = precision.param_dtype
    if dtype is None or policy.norm_in_fp32:
        return
    for module in root.modules():
        if is_stat_norm(module):
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype)


def _allocate_replicated_and_buffers(
    root: nn.Module, plans: list[ParameterPlan], device: torch.device
) -> None:
    """A meta-device model's replicated parameters and its buffers, allocated (not yet
    initialized) on `device`, registered wherever the meta ones were (and in `plans`)."""
    for i, plan in enumerate(plans):
        if plan.shard_dim is None:
            param = nn.Parameter(
                torch.empty_like(plan.param, device=device), plan.param.requires_grad
            )
            _replace(plan, param)
            plans[i] = dataclasses.replace(plan, param=param)
    for module in root.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def _sync_from_rank0(
    root: nn.Module,
    plans: list[ParameterPlan],
    comm: Comm,
    layouts: dict[int, TPLayout],
    mesh: GTPMesh,
) -> None:
    """Start every rank from rank 0's parameters and buffers, as DDP does, so ranks that
    initialized with different seeds still train one model. A tensor-parallel parameter's
    local block differs between tp ranks: it comes from the first data rank of this rank's tp
    coordinate."""
    with torch.no_grad():
        for plan in plans:
            tp = id(plan.param) in layouts
            axis = mesh.data if tp else mesh.world
            what = f"broadcast of '{plan.fqns[0]}' from {'data ' if tp else ''}rank 0"
            comm.wait(comm.broadcast(plan.param.data, what, axis))
        for name, tensor in root.named_buffers():
            comm.wait(comm.broadcast(tensor, f"broadcast of '{name}' from rank 0"))


def _replace(plan: ParameterPlan, param: nn.Parameter) -> None:
    """Register `param` in place of the planned one wherever that was registered."""
    for module, name in plan.owners:
        module._parameters[name] = param
    _replaced[id(plan.param)] = plan.param
