"""The public entry points: GTPWrap and the helpers that act on a wrapped module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .compilation import gather_per_block
from .config.plan import blocks_on_gathered_weights, plan_parameters, plan_tensor_parallel
from .config.policy import PolicySpec, resolve_policy
from .core.additions import refuse_additions
from .core.build import cast_norm_statistics
from .core.meta_init import InitFn, check_meta, check_same_generators, materialize_meta
from .core.parameter import GTPParameter
from .errors import WrapError
from .finite import check_at_steps
from .io.optimizer_state import register_optimizer_hooks
from .io.state_dict import gather_whole, install_state_dict_hooks, local_offset
from .mesh import resolve_mesh
from .parallel.experts import dispatch_tokens, plan_experts
from .parallel.tensor import apply_tp_plan, take_tp_layouts
from .runtime.engine import GTPEngine, attach, engine_of, is_wrapped


def GTPWrap(  # noqa: N802 - the product's name, used like a class
    module: nn.Module,
    policy: PolicySpec = None,
    *,
    mesh: DeviceMesh | dist.ProcessGroup | None = None,
    expert_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    init_fn: InitFn | None = None,
) -> nn.Module:
    """Shard `module`'s large weights across the GTP group, in place, and return `module`.

    Args:
        module: any nn.Module, already on its device (cuda for NCCL, cpu for gloo).
        policy: a GTPPolicy, a mapping or OmegaConf config of its fields, a list of LayerRules
            (the rules of a default policy), a YAML file path, or None for the default (shard
            Linear, Embedding and MultiheadAttention weights of >= min_shard_numel elements).
        mesh: a 1-D DeviceMesh or ProcessGroup over the whole world (one GTP group; for
            GTP groups inside a larger world, a ("dp", "gtp") mesh), or a DeviceMesh with dims
            named from ("dp", "gtp", "tp"), in that order, "gtp" among them
            (`gtp_wrap.make_mesh` builds one). Default: the whole world is one GTP group.
            Weights that torch's tensor parallelism made DTensors (parallelize_module on
            mesh["tp"], before GTPWrap) are sharded over gtp from their tp-local tensors.
        expert_mesh: a DeviceMesh over the same world with dims named from ("edp", "ep",
            "egtp"), in that order (`make_mesh(ep=..., egtp=...)` returns one beside `mesh`):
            the expert stacks the policy's `group="egtp"` rules match are partitioned over ep
            and sharded over egtp, and the experts modules of its `expert_parallel` exchange
            their tokens over ep (see [Note: expert stacks over the expert mesh]). Default:
            the whole world is one egtp group.
        device: where a model built under `torch.device("meta")` is allocated: only this
            rank's shards, its replicated parameters and its buffers (default: the mesh's
            device type, else "cuda" where a GPU is present, else "cpu"). Every weight then
            gets the values the unwrapped model built with the same seed on the same device
            type has: each module's `reset_parameters()` and the root's `_init_weights(module)`
            are replayed in order, one module's weights staged whole at a time (see [Note:
            replaying the inits]). Seed every rank the same before building.
        init_fn: for a meta-device model, `init_fn(module, name, local, offset)` writes the
            values of each parameter and buffer into `local`, this rank's part of it, which
            starts at `offset` of the whole: instead of the replay, nothing staged.

    After wrapping, the module keeps its class, methods and parameter names; outside
    forward/backward its sharded parameters hold this rank's rows. Every use inside a forward
    or backward sees the full weight, and after `loss.backward()` every `.grad` is reduced.
    """
    if is_wrapped(module) or any(isinstance(p, GTPParameter) for p in module.parameters()):
        raise WrapError(
            f"{type(module).__name__} (or a submodule) is already wrapped by GTPWrap; wrap the "
            "unwrapped model once"
        )
    resolved = resolve_policy(policy)
    tp_plan = plan_tensor_parallel(module, resolved)
    on_meta = check_meta(module, has_tp=bool(tp_plan) or _has_dtensors(module))
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise WrapError(
            f"the parameters are on several devices {sorted(map(str, devices))}; move the "
            "model to one device before wrapping"
        )
    if on_meta:
        device = _target_device(device, mesh)
    elif init_fn is not None or device is not None:
        raise WrapError(
            "device= and init_fn= are for a model built on the meta device; this one is on "
            f"{devices.pop() if devices else 'no device'}: move it yourself, or build it under "
            'torch.device("meta")'
        )
    else:
        device = devices.pop() if devices else torch.device("cpu")
    experts = any(rule.group == "egtp" for rule in resolved.rules)
    gtp_mesh = resolve_mesh(mesh, device, expert_mesh, experts)
    apply_tp_plan(module, tp_plan, gtp_mesh)  # the policy's `tp` rules, checked first
    registered = [(m, dict(m._parameters)) for m in module.modules()]
    try:
        layouts = take_tp_layouts(module, gtp_mesh)  # DTensors of TP: local ones, and layouts
        global_numel = {k: layout.shape.numel() for k, layout in layouts.items()}
        plans = plan_parameters(module, resolved, global_numel)
        ep_layouts, experts_modules = plan_experts(module, plans, resolved, gtp_mesh)
        engine = GTPEngine(module, plans, resolved, gtp_mesh, device, layouts, ep_layouts)
    except BaseException as error:
        # The parameters go back as they were given; the styles torch's TP applied stay.
        for m, params in registered:
            m._parameters.clear()
            m._parameters.update(params)
        if tp_plan:
            error.add_note(
                "The policy's tp rules had already applied torch's tensor parallelism to the "
                "model: build the model again before wrapping it again."
            )
        raise
    if on_meta:
        try:
            if init_fn is None:  # the replay draws from them
                check_same_generators(engine.agreement, device)
            materialize_meta(
                module, engine.weights, gather_whole(engine), local_offset(engine), init_fn
            )
        except BaseException as error:
            error.add_note(
                "The model's parameters were already replaced by sharded ones: build the "
                "model again (on the meta device) before wrapping it again."
            )
            raise
        cast_norm_statistics(module, resolved, engine.precision)
    install_state_dict_hooks(module, engine)
    register_optimizer_hooks()
    attach(module, engine)
    if resolved.check_finite:
        check_at_steps(module)
    blocks = blocks_on_gathered_weights(module, resolved)
    if blocks:
        gather_per_block(module, blocks)
    dispatch_tokens(experts_modules, engine.comm)
    refuse_additions(module)
    return module


def _has_dtensors(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _target_device(device: torch.device | str | None, mesh: Any) -> torch.device:
    """Where a meta-device model goes: `device`, or the mesh's device type, or a GPU where
    there is one (the current one), or the CPU."""
    if device is None:
        kind = getattr(mesh, "device_type", None)
        kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(kind)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "meta":
        raise WrapError("device='meta': give the device the shards are allocated on")
    return device


__all__ = ["GTPWrap", "engine_of", "no_sync", "reset_stats", "stats"]


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate grads over micro-batches without all-reducing replicated grads.

    Sharded weight grads are still reduce-scattered each backward and accumulate in `.grad`;
    the first backward after the context ends all-reduces the accumulated replicated grads.
    """
    with engine_of(module).no_sync():
        yield


def stats(module: nn.Module) -> dict[str, Any]:
    """Gather and reduce counters since the last `reset_stats`: gathers, prefetched_gathers,
    blocking_gathers (and per pass kind), bytes_gathered, bytes_reduced, peak_gathered_bytes,
    weight_casts (re-casts of a kept compute copy and FP8 re-quantizations, each once per
    step and flat dtype),
    fp8_matmuls (FP8 GEMMs), expert_gathers and prefetched_expert_gathers (the gathers of
    expert stacks over egtp, and how many of them were issued ahead of their use),
    workspace_bytes: the copy-engine workspaces' memory
    (`collectives: copy_engine`; symmetric memory), and workspace_bytes_outside_allocator: the
    part of it that `torch.cuda.max_memory_allocated` does not count (all of it on torch
    2.11)."""
    engine = engine_of(module)
    s = engine.stats
    return {
        "gathers": s.gathers,
        "prefetched_gathers": s.prefetched_gathers,
        "blocking_gathers": s.blocking_gathers,
        "blocking_by_pass": dict(s.blocking_by_pass),
        "bytes_gathered": s.bytes_gathered,
        "bytes_reduced": s.bytes_reduced,
        "reduce_scatters": s.reduce_scatters,
        "peak_gathered_bytes": s.peak_gathered_bytes,
        "weight_casts": s.weight_casts,
        "fp8_matmuls": s.fp8_matmuls,
        "expert_gathers": s.expert_gathers,
        "prefetched_expert_gathers": s.prefetched_expert_gathers,
        "workspace_bytes": engine.comm.workspace_bytes(),
        "workspace_bytes_outside_allocator": engine.comm.workspace_bytes(outside_allocator=True),
    }


def reset_stats(module: nn.Module) -> None:
    """Zero the counters `stats` reports."""
    engine_of(module).reset_stats()
