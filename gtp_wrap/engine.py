"""The GTP runtime of one wrapped module, in the order data flows through it:

wrap (storage and parameters) -> forward gather along the chain, a group of weights per
collective -> compute -> backward rematerialize (saved weights are re-gathered, never kept) ->
reduce-scatter of the weight gradients, a group per collective -> finalize one group later into
`.grad` -> end-of-backward: last finalize, replicated all-reduce, chain freeze.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from . import copy_engine, fp8, fp8_triton
from .buffers import GatherBufferPool
from .chain import Chain, Gather, PassKind, PassState, first_difference
from .comm import Comm, Pending, stable_hash
from .errors import ChainMismatchError, GraphCaptureError, PolicyError, WrapError
from .linear import ShardedLinear
from .mesh import GTPMesh
from .parameter import GTPParameter, _OpenPasses, make_gtp_parameter, written_param
from .policy import GTPPolicy, ParameterPlan, policy_dtype
from .replicated import ReplicatedGrads
from .storage import FlatStorage, ShardLayout

_engine_ids = itertools.count()
_MIN_WORKSPACE = 16 << 20  # bytes of copy-engine workspace, whatever group_numel says
_CONTAINERS = (list, tuple, dict)
# Note: compute copies (replicated weights in the compute dtype, a kept shard copy, FP8 slots)
# are re-made when the parameters' version counters move, which every in-place update does,
# except fused optimizers (AdamW(fused=True) writes its parameters without moving them). So
# every optimizer step that holds an engine's parameters also marks its copies stale; a
# replayed CUDA graph, which runs no Python, marks them itself (graphs.py).
_live_engines: weakref.WeakSet[GTPEngine] = weakref.WeakSet()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in list(_live_engines):
        engine.invalidate_casts(stepped)


register_optimizer_step_post_hook(_after_optimizer_step)

# The parameters wrapping replaced (by id): an optimizer built before GTPWrap holds these, gets
# no gradients for them, and would silently train nothing but what was left in place.
_replaced: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()


# Optimizers checked, with how many parameters they held then (add_param_group adds more).
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if not _replaced or _checked.get(optimizer) == count:
        return
    _checked[optimizer] = count
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _replaced.get(id(p)) is p:
                raise WrapError(
                    f"{type(optimizer).__name__} holds a parameter of shape {tuple(p.shape)} "
                    "that GTPWrap replaced (it was built before wrapping), so it would not train "
                    "the wrapped weights; build the optimizer from model.parameters() after "
                    "GTPWrap"
                )


register_optimizer_step_pre_hook(_before_optimizer_step)


@dataclasses.dataclass
class Stats:
    """Counters since the last reset (see gtp_wrap.stats)."""

    gathers: int = 0
    prefetched_gathers: int = 0
    blocking_gathers: int = 0
    bytes_gathered: int = 0
    bytes_reduced: int = 0
    reduce_scatters: int = 0
    peak_gathered_bytes: int = 0  # memory held by gather buffers (high-water mark)
    weight_casts: int = 0  # re-casts of a kept compute copy / FP8 re-quantizations (per step)
    fp8_matmuls: int = 0  # uses that ran as FP8 GEMMs (fp8_matmul)
    blocking_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Buffers:
    """Where a kind of pass gathers weights and stages gradients (see `GTPEngine.__init__`)."""

    pool: GatherBufferPool
    staging: dict[tuple[int, torch.dtype], list[torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(frozen=True)
class SavedWeightView:
    """What autograd keeps instead of a gathered weight: enough to re-gather it in backward."""

    layout: ShardLayout
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int


@dataclasses.dataclass
class PendingGrad:
    """One weight gradient in a reduce-scatter group."""

    layout: ShardLayout
    out: torch.Tensor  # the slot-sized result: the new gradient itself, or a staging buffer
    direct: bool  # whether `out` becomes the parameter's grad (it had none yet)


@dataclasses.dataclass
class ReduceGroup:
    """Weight gradients reduce-scattered as one collective, the way gathers are grouped along
    the chain: collected until they reach `group_numel` elements, then issued, and finalized
    when the next group is issued (or at the end of backward)."""

    grads: list[PendingGrad] = dataclasses.field(default_factory=list)
    fulls: list[torch.Tensor] = dataclasses.field(default_factory=list)  # inputs, until issued
    numel: int = 0
    pending: Pending | None = None


class GTPEngine:
    """Owns the flat storage, the gather buffers, the chains and the hooks of one module."""

    def __init__(
        self,
        root: nn.Module,
        plans: list[ParameterPlan],
        policy: GTPPolicy,
        mesh: GTPMesh,
        mesh_device: torch.device,
    ) -> None:
        self.policy = policy
        self.mesh = mesh
        self.comm = Comm(
            mesh,
            policy.collective_timeout_s,
            tag=str(next(_engine_ids)),
            average=policy.loss_reduction == "mean",
        )
        self.stats = Stats()
        self.step = 0
        self.comm.step = lambda: self.step
        self.sync_replicated = True
        self._passes: list[PassState] = []
        # Chains per pass kind and scope: None for the model's own passes, a name for each
        # CUDA-graphed region, whose passes run standalone at capture and never mix with ours.
        self._chains: dict[tuple[PassKind, str | None, str | None], Chain] = {}  # PassState.key
        self._scope: str | None = None
        # Weights gathered inside graphed regions, by layout index: the region's name.
        self.region_weights: dict[int, str] = {}
        self._collecting = ReduceGroup()  # gradients not yet issued
        self._reducing: ReduceGroup | None = None  # issued, not yet finalized
        # Users' post-accumulate-grad hooks on sharded parameters, by layout index, and the
        # indices whose `.grad` this backward has written (see `add_grad_hook`).
        self._grad_hooks: dict[int, OrderedDict[int, Callable[[torch.Tensor], None]]] = {}
        self._landed: dict[int, None] = {}

        self._check_ranks_agree(plans)
        if policy.gather_dtype is not None:
            try:
                fp8.fp8_dtype()
            except TypeError as e:
                raise PolicyError(str(e)) from e
        # A GTP group of one gathers nothing, so it quantizes nothing either.
        self.fp8 = policy.gather_dtype is not None and mesh.gtp_size > 1
        self.fp8_matmul = self.fp8 and policy.fp8_matmul
        if self.fp8_matmul:
            fp8.check_gemm_device(mesh_device)
        if policy.collectives == "copy_engine" and mesh.gtp_size > 1:
            self._set_up_copy_engine(mesh_device)
        sharded = [p for p in plans if p.shard_dim is not None]
        self.device = mesh_device
        self.layouts = FlatStorage.assign_offsets(
            [(p.fqns[0], p.param.shape, p.shard_dim, p.param.dtype) for p in sharded],  # type: ignore[misc]
            rank=mesh.gtp_rank,
            world=mesh.gtp_size,
            align=policy.pad_for_alignment,
            block=fp8.BLOCK if self.fp8 else 1,
        )
        self.fqns = [p.fqns for p in sharded]
        self.param_dtype = policy_dtype(policy.param_dtype)
        self.reduce_dtype = policy_dtype(policy.reduce_dtype)
        # F.linear uses run through the engine's own linear (linear.py) where half-precision
        # compute meets fp32 reductions (the GEMM then writes fp32 weight gradients), and for
        # FP8 GEMMs.
        half = self.param_dtype in (torch.bfloat16, torch.float16)
        self._own_linear = self.fp8_matmul or (half and self.reduce_dtype == torch.float32)
        # Note: by default no param_dtype copy of the shards is kept: each gather casts 1/N of
        # its weight into its own part of the gather buffer (Comm does, on the stream that
        # moves the gather: copy-engine collectives thus keep the casts off the compute
        # stream, whose critical path they lengthened by 2.6 ms per graphed 1.36B step). On
        # 2xH200 (1.36B, batch 1-8) that
        # moved step time only within run-to-run noise, while the copy (compute_copy, cast once per
        # step) held 1.27 GiB per GPU and put peak memory above FSDP2's. FP8 gathers read
        # packed FP8 slots instead, and a group of one, which gathers nothing, keeps the copy
        # its local uses read.
        keep_copy = not self.fp8 and (policy.compute_copy or mesh.gtp_size == 1)
        cast = not self.fp8 and not keep_copy and self.param_dtype is not None
        self.storage = FlatStorage(
            self.layouts, self.device, self.param_dtype if keep_copy else None
        )
        # Per weight: whether its F.linear uses run as FP8 GEMMs, with one scale per row.
        self._fp8_gemm = [self.fp8_matmul and fp8.fits_gemm(lay) for lay in self.layouts]
        if self.fp8:
            self._fused_dequant = [
                fp8_triton.available(self.device, lay.slot_numel) for lay in self.layouts
            ]
            self.storage.enable_fp8(self.layouts, self._fp8_gemm)
            if self.fp8_matmul:
                fp8.warn_unfit(self.layouts, self._fp8_gemm)
        # Note: graphed regions gather and reduce into buffers of their own. A graph keeps the
        # addresses it was captured with, so handing one of its buffers to an eager pass (a
        # staging buffer with a reduce-scatter still pending, say) would let a replay overwrite
        # it. Replays never overlap each other, so all regions share one set.
        self._eager = _Buffers(GatherBufferPool(self.device))
        self._graphed = _Buffers(GatherBufferPool(self.device))
        self.pool, self._staging = self._eager.pool, self._eager.staging
        # Note: between eager steps the model's gather and staging buffers go back to the
        # allocator. Kept, they would sit under the optimizer step, where AdamW's temporaries
        # put the memory peak at small batch (0.2 GiB at 1.36B: an embedding-sized buffer and
        # a few layers'); on the GPU the caching allocator serves the next step's buffers from
        # the same cached blocks. A graph_step sets keep_buffers for good: from its warm-up on,
        # the buffers its capture will read must exist and stay.
        self.keep_buffers = False
        self._sync_from_rank0(root, plans)
        self.params = [self._shard(plan, lay) for plan, lay in zip(sharded, self.layouts)]
        self._gathered_numels = [lay.gathered_numel for lay in self.layouts]  # chain groups
        # Views used on every weight use, made once here rather than per use.
        self._slots = [lay.slot(self.storage.compute[lay.dtype]) for lay in self.layouts]
        # What each weight's gather sends (its slot, or its packed FP8 slot) and in what dtype
        # it gathers; a send of another dtype is cast on its way (Comm.all_gather).
        self._sends = list(self.storage.packed_slots) if self.fp8 else self._slots
        self._gather_dtypes = [
            torch.uint8 if self.fp8 else self.param_dtype if cast else slot.dtype
            for slot in self._slots
        ]
        self._local_compute = [
            lay.local_view(self.storage.compute[lay.dtype]) for lay in self.layouts
        ]
        # Error descriptions, made here rather than per use; Comm fills in the step.
        self._gather_what = {
            kind: [
                f"all-gather of '{lay.fqn}' ({kind.value} pass, step {{step}})"
                for lay in self.layouts
            ]
            for kind in PassKind
        }
        self._reduce_what = [
            f"reduce-scatter of the gradient of '{lay.fqn}' (step {{step}})" for lay in self.layouts
        ]
        self._dp_what = [f"dp all-reduce of the gradient of '{lay.fqn}'" for lay in self.layouts]
        replicated = [p.param for p in plans if p.shard_dim is None]
        if self.param_dtype is not None:
            replicated = [self._manage_replicated(plan) for plan in plans if plan.shard_dim is None]
        self.cast_params = [p for p in replicated if isinstance(p, GTPParameter)]
        _live_engines.add(self)
        names = [plan.fqns[0] for plan in plans if plan.shard_dim is None]
        self.replicated = ReplicatedGrads(replicated, names, self.comm)
        if mesh.world_size > 1:
            self.replicated.register(self)
        root.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        root.register_forward_hook(self._post_forward, always_call=True)
        self._hook_owners(root, plans)

    # ---- wrap ---------------------------------------------------------------------------

    # Policy fields that decide which collectives a step issues, in what order and on what
    # dtypes: ranks that differ in one would pair unrelated collectives.
    _AGREED_FIELDS = (
        "prefetch_depth", "group_numel", "loss_reduction", "param_dtype", "reduce_dtype",
        "gather_dtype", "fp8_matmul", "collectives",
    )  # fmt: skip

    def __deepcopy__(self, memo: dict) -> GTPEngine:
        raise WrapError(
            "a wrapped module cannot be deep-copied: its engine holds process groups, streams "
            "and collective state. For an EMA or teacher copy, deep-copy the module before "
            "GTPWrap and wrap the copy too, or load gtp_wrap.full_state_dict(model) into a "
            "fresh unwrapped model"
        )

    def _check_ranks_agree(self, plans: list[ParameterPlan]) -> None:
        """Every rank must plan the same parameters the same way, with the same policy, checked
        before any collective."""
        fields = [f"{name}={getattr(self.policy, name)!r}" for name in self._AGREED_FIELDS]
        sigs = [stable_hash(field) for field in fields] + [
            stable_hash(f"{p.fqns[0]}|{tuple(p.param.shape)}|{p.param.dtype}|{p.shard_dim}")
            for p in plans
        ]
        everyone = self.comm.exchange("wrap", sigs)
        diff = first_difference(everyone)
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

    def _set_up_copy_engine(self, device: torch.device) -> None:
        """Workspaces for the copy-engine collectives (policy `collectives: copy_engine`).

        Every rank says first whether it can (through the store): setting up a workspace is a
        collective of its own, which a rank that cannot would leave its peers waiting in.

        Note: gathers and reduce-scatters get a stream and a workspace each, so a backward
        gather, which a GEMM waits for, never queues behind a reduce-scatter, which only the
        next group's finalize waits for. (NCCL runs both on one stream.)
        """
        reason = copy_engine.unsupported(device)
        verdicts = self.comm.exchange("copy-engine", [int(reason is None)])
        unable = [rank for rank, (ok,) in enumerate(verdicts) if not ok]
        if unable:
            raise PolicyError(
                reason
                or f"collectives: copy_engine cannot run on rank(s) {unable}: their devices "
                "have no CUDA symmetric memory; use collectives: process_group"
            )
        group_numel = self.policy.group_numel

        def make(nbytes: int) -> copy_engine.CopyEngineCollectives:
            return copy_engine.CopyEngineCollectives(
                self.mesh.gtp_group,  # type: ignore[arg-type]
                device,
                nbytes=max(nbytes, _MIN_WORKSPACE),
                timeout_s=self.policy.collective_timeout_s,
            )

        # Sized so that, on two ranks, one round moves a group of up to 2 x group_numel
        # elements: this rank's half of its bf16 weights, the peer's half of its fp32
        # gradients.
        self.comm.gather_copies = make(2 * group_numel)
        self.comm.reduce_copies = make(4 * group_numel)

    def _shard(self, plan: ParameterPlan, lay: ShardLayout) -> GTPParameter:
        """Copy this rank's rows into the flat storage and register the shard view in place."""
        flat = self.storage.params[lay.dtype]
        with torch.no_grad():
            lay.local_view(flat).copy_(lay.local_rows_of(plan.param.detach()))
        param = make_gtp_parameter(
            lay.local_view(flat), plan.param.requires_grad, lay, self, self.param_dtype
        )
        _replace(plan, param)
        return param

    def _hook_owners(self, root: nn.Module, plans: list[ParameterPlan]) -> None:
        """A submodule called on its own (`model.embed(idx)` in generation code) opens a pass
        too, so its weights are gathered rather than silently used as local shards."""
        opened: list[bool] = []
        names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}

        def pre(module: nn.Module, args: Any, kwargs: dict) -> Any:
            # Inside backward (a checkpoint recompute) uses are intercepted already.
            opened.append(not self._passes and torch._C._current_graph_task_id() == -1)
            if not opened[-1]:
                return None
            return self._pre_forward(module, args, kwargs, opener=names[id(module)])

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if opened and opened.pop():
                self._post_forward(module, args, output)

        owners = {id(m): m for plan in plans for m, _ in plan.owners if m is not root}
        for module in owners.values():
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, always_call=True)

    def _sync_from_rank0(self, root: nn.Module, plans: list[ParameterPlan]) -> None:
        """Start every rank from rank 0's parameters and buffers, as DDP does, so ranks that
        initialized with different seeds still train one model."""
        named = [(plan.fqns[0], plan.param.data) for plan in plans]
        with torch.no_grad():
            for name, tensor in named + list(root.named_buffers()):
                what = f"broadcast of '{name}' from rank 0"
                self.comm.wait(self.comm.broadcast(tensor, what))

    def _manage_replicated(self, plan: ParameterPlan) -> nn.Parameter:
        """With a compute dtype, a replicated floating-point parameter is used through a copy in
        that dtype (made once per step), so the whole forward runs in one dtype."""
        if not plan.param.is_floating_point() or plan.param.dtype == self.param_dtype:
            return plan.param
        param = make_gtp_parameter(
            plan.param.detach(), plan.param.requires_grad, None, self, self.param_dtype
        )
        param._gtp_cast = torch.empty_like(param, dtype=self.param_dtype)
        param._gtp_cast_version = -1
        _replace(plan, param)
        return param

    def _refresh_casts(self) -> None:
        self.stats.weight_casts += self.storage.refresh_compute()
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for p in self.cast_params:
                if p._gtp_cast_version != p._version:
                    p._gtp_cast.copy_(p)
                    p._gtp_cast_version = p._version

    def invalidate_casts(self, stepped: set[int] | None = None) -> None:
        """Re-cast at the next pass the compute copies of the parameters whose ids are in
        `stepped` (None: all of them): they may have changed without their version counters
        moving (a fused optimizer, a CUDA-graph replay). The shard copies go together."""
        if stepped is None or any(id(p) in stepped for p in self.params):
            self.storage.invalidate_compute()
        for p in self.cast_params:
            if stepped is None or id(p) in stepped:
                p._gtp_cast_version = -1

    # ---- passes -------------------------------------------------------------------------

    def intercepting(self) -> bool:
        """Whether uses of sharded parameters see full weights now (inside a pass)."""
        if torch._C._current_graph_task_id() != -1:
            return True
        self._close_abandoned_backward()
        return bool(self._passes)

    def _close_abandoned_backward(self) -> None:
        """Drop a backward pass still open outside backward: its backward raised, so autograd
        skipped the end-of-backward callback, and a pass left open would make every later op
        (the optimizer's too) a use. Inside backward (a forward called from a hook) the pass
        is live."""
        if (
            self._passes
            and self._passes[-1].kind is PassKind.BACKWARD
            and torch._C._current_graph_task_id() == -1
        ):
            if self._reducing is not None and self._reducing.pending is not None:
                self.comm.abandon(self._reducing.pending)
            self._collecting, self._reducing = ReduceGroup(), None
            self.replicated.abandon()
            self._landed.clear()
            self._end_pass(failed=True)

    def _begin_pass(self, kind: PassKind, opener: str | None = None) -> PassState:
        if self.param_dtype is not None or self.fp8:
            self._refresh_casts()
        state = PassState(kind, self._scope, None, opener=opener)
        state.chain = self._chains.get(state.key)
        self._passes.append(state)
        _OpenPasses.count += 1
        return state

    def _end_pass(self, failed: bool = False) -> None:
        """Close the current pass; record its chain (checked across ranks) if it changed.

        A pass that failed (an exception is propagating) records nothing: its uses stopped
        part-way, and its peers learn of the failure by timing out at their own check.
        """
        state = self._passes.pop()
        _OpenPasses.count -= 1
        if failed:
            with contextlib.suppress(Exception):
                self._drain(state)
            return
        self._drain(state)
        if state.followed_chain() or self.mesh.gtp_size == 1:
            return
        purpose = f"chain-{state.kind.value}-{state.scope}-{state.opener}"
        everyone = self.comm.exchange(purpose, state.recorded)
        diff = first_difference(everyone)
        if diff is not None:
            pos, entries = diff
            names = [self.fqns[e][0] if e is not None else "<end of pass>" for e in entries]
            per_rank = ", ".join(f"rank {r}: '{n}'" for r, n in enumerate(names))
            raise ChainMismatchError(
                f"ranks used their sharded weights in different orders in the {state.kind.value}"
                f" pass of step {self.step}: use #{pos} is {per_rank}. GTP gathers weights "
                "collectively, so every rank must run the same weights in the same order "
                "(make data-dependent branches agree across ranks)"
            )
        self._chains[state.key] = Chain.build(
            state.recorded, self._gathered_numels, self.policy.group_numel
        )

    def _pre_forward(
        self, module: nn.Module, args: Any, kwargs: dict, opener: str | None = None
    ) -> Any:
        self._close_abandoned_backward()  # a forward inside backward nests in its pass
        grad = torch.is_grad_enabled()
        kind = PassKind.FORWARD if grad else PassKind.FORWARD_NO_GRAD
        if grad and self._scope is None and self.mesh.world_size > 1:
            self.replicated.hook_unfrozen()
        state = self._begin_pass(kind, opener)
        if grad:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            state.exit_hooks = hooks
        if self.param_dtype is not None:  # floating inputs follow the weights' compute dtype
            return tree_map_only(
                torch.Tensor,
                lambda t: t.to(self.param_dtype) if t.is_floating_point() else t,
                (args, kwargs),
            )
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._passes:  # an earlier pre-hook raised before ours opened the pass
            return
        state = self._passes[-1]
        if state.exit_hooks is not None:
            state.exit_hooks.__exit__(None, None, None)  # type: ignore[attr-defined]
        # always_call hooks run inside forward's `except` clause when forward raised.
        self._end_pass(failed=sys.exc_info()[1] is not None)

    def _ensure_backward(self) -> None:
        if self._passes and self._passes[-1].kind is PassKind.BACKWARD:
            return
        self._begin_pass(PassKind.BACKWARD)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        model_pass = self._passes[-1].scope is None
        with torch._C.DisableTorchFunctionSubclass():
            self._issue_reduce()
            if self._reducing is not None:
                self._finalize(self._reducing)
                self._reducing = None
            if model_pass and self.sync_replicated and self.mesh.world_size > 1:
                self.replicated.finish()
        self._end_pass()
        if model_pass:
            self.step += 1
            if not self.keep_buffers:
                self._eager.pool.release_free()
                self._eager.staging.clear()
        landed, self._landed = self._landed, {}
        if model_pass:  # a graphed region's warm-up and capture leave no trace
            self._run_grad_hooks(landed)

    def _run_grad_hooks(self, indices: Iterable[int]) -> None:
        """Run the post-accumulate-grad hooks of these sharded parameters (layout indices)."""
        # Still inside autograd's graph task, where a sharded parameter would read as its
        # gathered weight: the hooks see the shards, as outside backward.
        with torch._C.DisableTorchFunctionSubclass():
            for index in indices:
                for hook in list(self._grad_hooks.get(index, {}).values()):
                    hook(self.params[index])

    def mark_landed(self, indices: Iterable[int]) -> None:
        """These sharded weights' `.grad` was written in this backward: their hooks, if any,
        run when it ends."""
        for index in indices:
            if index in self._grad_hooks:
                self._landed[index] = None

    def add_grad_hook(
        self, param: GTPParameter, hook: Callable[[torch.Tensor], None]
    ) -> RemovableHandle:
        """`param.register_post_accumulate_grad_hook(hook)` for a sharded parameter.

        Note: autograd never accumulates into a sharded parameter (the engine writes its
        reduced rows into `.grad` when the reduce-scatter is finalized), so autograd would run
        such a hook too early, with `.grad` not yet written. The engine runs it instead, once
        per backward, after that backward's last gradient landed and its pass closed, so the
        hook may step an optimizer on the shard (optimizer-in-backward).
        """
        # An OrderedDict, as torch's own hook dicts: the handle keeps a weak reference to it.
        hooks = self._grad_hooks.setdefault(param._gtp_layout.index, OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    @contextlib.contextmanager
    def scoped(self, name: str):
        """Passes opened inside run in scope `name` (a graphed region being captured): their
        own chains, and the graphed regions' buffers.

        The autograd thread reads `_scope` too (the region's backward opens its pass there);
        that is safe because the capturing thread waits inside `autograd.grad` meanwhile.
        """
        outer = (self._scope, self.pool, self._staging)
        self._scope, self.pool, self._staging = name, self._graphed.pool, self._graphed.staging
        try:
            yield
        finally:
            self._scope, self.pool, self._staging = outer

    def fence(self) -> None:
        """Make the current stream wait for every collective in flight (their results stay for
        their consumers), so a graph replayed next never runs beside them on the same
        communicator."""
        pending = [gather.pending for state in self._passes for gather in state.inflight]
        if self._reducing is not None and self._reducing.pending is not None:
            pending.append(self._reducing.pending)
        pending += [b.pending for b in self.replicated.buckets if b.pending is not None]
        for p in pending:
            self.comm.wait(p, consume=False)

    # ---- forward gather along the chain -------------------------------------------------

    def call_with_full_weights(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `func` with each sharded parameter among its args replaced by the full weight."""
        if not self._passes:
            self._ensure_backward()  # a checkpoint recompute: uses inside backward
        lay = self._linear_layout(func, args, kwargs) if self._own_linear else None
        if lay is not None:
            return self._linear(lay, *args, **kwargs)
        p = written_param(func, args, kwargs)
        if p is not None:
            name = p._gtp_layout.fqn if p._gtp_layout is not None else "a replicated parameter"
            raise WrapError(
                f"{getattr(func, '__name__', func)} writes in place to '{name}' during a "
                "forward or backward pass, where it reads as a temporary copy (the gathered "
                "weight, or its compute-dtype copy), so the write would be lost (e.g. "
                "nn.Embedding(max_norm=...) renormalizes its weight this way). Replicate that "
                "weight (a LayerRule with action 'replicate', without param_dtype) or change "
                "it outside passes, under torch.no_grad()"
            )
        full: dict[int, torch.Tensor] = {}

        def substitute(p: GTPParameter) -> torch.Tensor:
            if id(p) not in full:
                full[id(p)] = self._full_weight(p)
            return full[id(p)]

        if any(type(a) in _CONTAINERS for a in args) or kwargs:
            args, kwargs = tree_map_only(GTPParameter, substitute, (args, kwargs))
        else:  # the common case, F.linear(x, w, b): no tree walk
            args = tuple(substitute(a) if type(a) is GTPParameter else a for a in args)
        return func(*args, **kwargs)

    def _full_weight(self, p: GTPParameter) -> torch.Tensor:
        """The weight one use of `p` sees, wired so that its gradient reaches `p`."""
        grad = torch.is_grad_enabled() and p.requires_grad
        if p._gtp_layout is None:  # replicated, used in the compute dtype
            return _CastGrad.apply(p, p._gtp_cast) if grad else p._gtp_cast
        w = self.gather(p._gtp_layout)
        return _RouteGrad.apply(p, w, self, p._gtp_layout) if grad else w

    def _linear_layout(self, func: Callable, args: tuple, kwargs: dict) -> ShardLayout | None:
        """The layout of the weight if this use is an F.linear that takes the engine's own
        linear (see `_own_linear`): a sharded 2-D weight, an input in the compute dtype, no
        bias or a 1-D one, and no autocast to another dtype."""
        if func is not F.linear or len(args) < 2 or type(args[1]) is not GTPParameter:
            return None
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        lay = weight._gtp_layout
        if lay is None or len(lay.shape) != 2 or type(x) is GTPParameter:
            return None
        if x.dtype != self.param_dtype or x.dim() == 0 or x.shape[-1] != lay.shape[1]:
            return None
        if bias is not None and bias.dim() != 1:
            return None
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype:
            return None
        if self._fp8_gemm[lay.index]:
            return lay
        return lay if torch.is_grad_enabled() and weight.requires_grad else None

    def _linear(
        self,
        lay: ShardLayout,
        x: torch.Tensor,
        weight: GTPParameter,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F.linear on the gathered weight through `ShardedLinear`; with fp8_matmul the
        gathered FP8 weight is fed straight to the FP8 GEMM."""
        if type(bias) is GTPParameter:
            bias = self._full_weight(bias)
        scale = None
        if self._fp8_gemm[lay.index]:
            w, scale = fp8.unpack_rows(self.gather(lay, packed=True), lay.world,
                                       lay.rows_per_rank, lay.row_numel)  # fmt: skip
            self.stats.fp8_matmuls += 1
        else:
            w = self.gather(lay)
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return ShardedLinear.apply(x, weight, w, bias, self, lay, scale)
        assert scale is not None  # without autograd only FP8 GEMMs take this route
        return fp8.linear_forward(x, w, scale, lay, bias)

    def gather(self, lay: ShardLayout, packed: bool = False) -> torch.Tensor:
        """The logical full weight of `lay`, gathered for one use of the current pass (with
        `packed`, the gathered FP8 slots as they came, for the FP8 GEMM)."""
        if self.mesh.gtp_size == 1:
            return self._local_compute[lay.index]
        state = self._passes[-1]
        if state.expects(lay.index):
            position = state.cursor
            state.cursor += 1
            blocking = not state.inflight  # the chain head: its group is issued now
            if blocking:
                self._issue_group(state, state.chain.rest_of_group(position))  # type: ignore[union-attr]
            gather = state.inflight.popleft()
            self._prefetch_ahead(state)
        else:
            if state.chain is not None and not state.diverged:
                state.diverged = True
                self._drain(state)
            (gather,) = self._issue(state, [lay])
            blocking = True
        state.recorded.append(lay.index)
        return self._complete(gather, state, blocking, packed)

    def _prefetch_ahead(self, state: PassState) -> None:
        while (group := state.next_to_prefetch(self.policy.prefetch_depth)) is not None:
            self._issue_group(state, group)

    def _issue_group(self, state: PassState, positions: range) -> None:
        """Issue the gathers of these consecutive chain positions as one collective."""
        order = state.chain.order  # type: ignore[union-attr]
        lays = [self.layouts[order[p]] for p in positions]
        state.inflight.extend(self._issue(state, lays))

    def _issue(self, state: PassState, lays: list[ShardLayout]) -> list[Gather]:
        """Gather `lays` in one collective."""
        bufs, sends = [], []
        for lay in lays:
            send = self._sends[lay.index]  # FP8 slots are dequantized when consumed
            buf = self.pool.reserve(lay.world * send.numel(), self._gather_dtypes[lay.index])
            buf.owner = lay
            bufs.append(buf)
            sends.append(send)
            self.stats.bytes_gathered += buf.nbytes
        context = f"{state.kind.value} pass, "
        what = _collective_what(lays, self._gather_what[state.kind], "all-gather of", context)
        pendings = self.comm.all_gather([b.tensor for b in bufs], sends, what)
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, self.gather_bytes())
        self.stats.gathers += len(lays)
        return [Gather(lay, buf, pending) for lay, buf, pending in zip(lays, bufs, pendings)]

    def _complete(
        self, gather: Gather, state: PassState, blocking: bool, packed: bool = False
    ) -> torch.Tensor:
        self.comm.wait(gather.pending)
        buf, lay = gather.buffer, gather.layout
        if self.fp8 and not packed:
            out = self.pool.reserve(lay.gathered_numel, self.param_dtype or lay.dtype)
            out.owner = lay
            block = self.storage.fp8_blocks[lay.index]
            fp8.dequantize_into(
                buf.tensor, lay.world, lay.slot_numel, out.tensor, block,
                fused=self._fused_dequant[lay.index],
            )  # fmt: skip
            self.pool.hand_out(buf)
            buf = out
        self.pool.hand_out(buf)
        full = buf.tensor if packed else lay.full_view(buf.tensor)
        if blocking:
            self.stats.blocking_gathers += 1
            key = state.kind.value
            self.stats.blocking_by_pass[key] = self.stats.blocking_by_pass.get(key, 0) + 1
        else:
            self.stats.prefetched_gathers += 1
        return full

    def _drain(self, state: PassState) -> None:
        """Complete the gathers still in flight so their buffers return to the pool (they
        were issued ahead, so they count as prefetched, though no use reads them)."""
        while state.inflight:
            gather = state.inflight.popleft()
            self.comm.wait(gather.pending)
            self.pool.hand_out(gather.buffer)
            self.stats.prefetched_gathers += 1

    # ---- backward rematerialize ---------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout is not torch.strided or t.device != self.device or t.is_meta:
            return t
        try:
            buf = self.pool.lookup(t)
        except RuntimeError:  # a tensor without storage (a wrapper subclass)
            return t
        if buf is None:
            return t
        return SavedWeightView(buf.owner, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedWeightView):
            return saved
        self._ensure_backward()
        full = self.gather(saved.layout)
        return full.as_strided(saved.size, saved.stride, saved.storage_offset)

    # ---- reduce-scatter and finalize ----------------------------------------------------

    def reduce_grad(self, lay: ShardLayout, grad: torch.Tensor) -> None:
        """Collect one use's full weight gradient for its group's reduce-scatter."""
        self._ensure_backward()
        if self.region_weights and self._scope is None and lay.index in self.region_weights:
            raise GraphCaptureError(
                f"'{lay.fqn}' is used inside graphed region {self.region_weights[lay.index]} and "
                "also outside it, where its gradient would race the region's replay: graph a "
                "module that holds every use of its weights, or leave it eager"
            )
        with torch._C.DisableTorchFunctionSubclass():
            param = self.params[lay.index]
            dtype = self.reduce_dtype or grad.dtype
            # A weight used twice has a second gradient; only the first may become `.grad`.
            direct = dtype == lay.dtype and param.grad is None and not self._awaits_grad(lay)
            out = (
                torch.empty(lay.slot_numel, dtype=dtype, device=self.device)
                if direct
                else self._take_staging(lay, dtype)
            )
            full = lay.padded_rows_view(grad.to(dtype))
            group = self._collecting
            group.grads.append(PendingGrad(lay, out, direct))
            group.fulls.append(full)
            group.numel += full.numel()
            self.stats.bytes_reduced += full.numel() * full.element_size()
            if group.numel >= self.policy.group_numel:
                self._issue_reduce()

    def _awaits_grad(self, lay: ShardLayout) -> bool:
        """Whether a gradient of `lay` is collected or reducing, not yet in its `.grad`."""
        groups = [self._collecting] + ([self._reducing] if self._reducing is not None else [])
        return any(g.layout is lay for group in groups for g in group.grads)

    def _issue_reduce(self) -> None:
        """Reduce-scatter the collected gradients as one collective; finalize the previous
        group, whose collective has had this group's backward compute to run under."""
        group, self._collecting = self._collecting, ReduceGroup()
        if not group.grads:
            return
        lays = [g.layout for g in group.grads]
        what = _collective_what(lays, self._reduce_what, "reduce-scatter of the gradients of", "")
        group.pending = self.comm.reduce_scatter([g.out for g in group.grads], group.fulls, what)
        group.fulls = []  # the collective holds its inputs until it completes
        self.stats.reduce_scatters += len(lays)
        prev, self._reducing = self._reducing, group
        if prev is not None:
            self._finalize(prev)

    def _take_staging(self, lay: ShardLayout, dtype: torch.dtype) -> torch.Tensor:
        free = self._staging.setdefault((lay.slot_numel, dtype), [])
        if free:
            return free.pop()
        return torch.empty(lay.slot_numel, dtype=dtype, device=self.device)

    def _finalize(self, group: ReduceGroup) -> None:
        """Complete a group's reduce-scatter, reduce over dp, and land each gradient in its
        shard's grad."""
        self.comm.wait(group.pending)  # type: ignore[arg-type]
        for g in group.grads:
            lay = g.layout
            self.comm.wait(self.comm.all_reduce(g.out, "dp", self._dp_what[lay.index]))
            param = self.params[lay.index]
            local = lay.local_of_slot(g.out)
            self.mark_landed((lay.index,))
            if g.direct:
                param.grad = local
                continue
            if param.grad is None:
                param.grad = local.to(lay.dtype, copy=True)
            else:
                param.grad.add_(local)
            self._staging[(lay.slot_numel, g.out.dtype)].append(g.out)

    # ---- helpers for the public API -----------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        outer, self.sync_replicated = self.sync_replicated, False
        try:
            yield
        finally:
            self.sync_replicated = outer  # nested: still off until the outermost exits

    def gather_bytes(self) -> int:
        """Memory held by the gather buffers of the model and of its graphed regions."""
        return self._eager.pool.total_bytes + self._graphed.pool.total_bytes

    def reset_stats(self) -> None:
        self.stats = Stats(peak_gathered_bytes=self.gather_bytes())


def _replace(plan: ParameterPlan, param: nn.Parameter) -> None:
    """Register `param` in place of the planned one wherever that was registered."""
    for module, name in plan.owners:
        module._parameters[name] = param
    _replaced[id(plan.param)] = plan.param


def _collective_what(lays: list[ShardLayout], one: list[str], action: str, context: str) -> str:
    """The error description of a collective over `lays`: a weight's own (`one`, made at wrap
    time), or for a group its first and last weights; Comm fills in the step."""
    if len(lays) == 1:
        return one[lays[0].index]
    first, last = lays[0].fqn, lays[-1].fqn
    return f"{action} '{first}' ... '{last}' ({len(lays)} weights, {context}step {{step}})"


class _CastGrad(torch.autograd.Function):
    """A replicated parameter used through its compute-dtype copy; the gradient is cast back
    and accumulates into the parameter's `.grad` as usual."""

    @staticmethod
    def forward(ctx, param, cast):  # type: ignore[override]
        ctx.dtype = param.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.to(ctx.dtype), None


class _RouteGrad(torch.autograd.Function):
    """Identity on the gathered weight whose backward sends the full grad to the reduce-scatter.

    The shard parameter is an input only so the output requires grad; no gradient flows to it
    through autograd: the engine writes `.grad` itself when the reduce-scatter is finalized.
    """

    @staticmethod
    def forward(ctx, param, full, engine, layout):  # type: ignore[override]
        ctx.engine, ctx.layout = engine, layout
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.engine.reduce_grad(ctx.layout, grad)
        return None, None, None, None
