"""The GTP engine of one wrapped module: a facade over its parts, in the order data flows.

wrap (core/build.py: storage, parameters) -> forward gather along the chain, a group of weights
per collective (gather.py, chain.py) -> compute (uses.py) -> backward
rematerialize: saved weights are re-gathered, never kept (gather.py) -> reduce-scatter of the
weight gradients, a group per collective, finalized one group later into `.grad` (reduce.py)
-> end of backward: last finalize, replicated all-reduce (replicated.py), chain record
(passes.py), users' gradient hooks.

The engine opens and closes the passes (the root's and owners' module hooks, blocks' forwards
through runtime/owners.py, and autograd's end-of-backward callback)
and answers the narrow runtime interface its parameters and autograd functions call:
`intercepting`, `use` (core/weight.Runtime), `ensure_backward`, `gather`, `full_weight`,
`reduce_grad` (uses.GradRuntime). graphs/ drives it through the public methods below.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..comm.agreement import Agreement, agree_to_resume
from ..comm.comm import Comm
from ..comm.watch import Watch
from ..config.plan import ParameterPlan
from ..config.policy import GTPPolicy
from ..core.build import build, check_ranks_agree, install_process_hooks
from ..core.parameter import refuse_pickling, resume_in_backward
from ..core.weight import ShardedWeight
from ..errors import GraphCaptureError, WrapError
from ..mesh import GTPMesh, with_replicated_apart
from ..parallel.experts import EPLayout, ExpertDispatch
from ..parallel.tensor import TPLayout
from ..precision.encoding import Precision
from .blocks import GatheredBlock, refuse_tracing, refuse_transforms
from .casts import Casts, install_optimizer_hook
from .chain import PassKind, PassState
from .gather import Gatherer
from .owners import Owners
from .part import Shared
from .passes import Passes
from .reduce import GradReducer
from .replicated import ReplicatedGrads
from .stats import Stats
from .uses import Uses

_engine_ids = itertools.count()
_ENGINE_ATTR = "_gtp_engine"  # where a wrapped module keeps its engine


def attach(module: nn.Module, engine: GTPEngine) -> None:
    """Make `engine` the engine of the wrapped `module`."""
    object.__setattr__(module, _ENGINE_ATTR, engine)


def is_wrapped(module: nn.Module) -> bool:
    """Whether `module` is the root of a GTPWrap."""
    return hasattr(module, _ENGINE_ATTR)


_MODULE_FILE = nn.modules.module.__file__


def _forward_error() -> BaseException | None:
    """The exception a module's forward raised, when called from an always-called forward hook
    on that exception path; None on the normal path.

    [Note: the hook's exception path] torch runs always-called hooks inside the `except` clause
    of the module call that caught the forward's exception, so `sys.exc_info()` names it. But a
    forward run inside a caller's own `except` block (a retry after an OOM) sees the caller's
    exception there too. Only the forward's exception was caught by the module call itself: its
    traceback starts at a frame of torch's module.py that is on the current stack, right above
    the hook.
    """
    error = sys.exc_info()[1]
    if error is None or error.__traceback__ is None:
        return None
    catcher = error.__traceback__.tb_frame
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(5):  # this hook, the owner hook calling it, torch's call frames
        if frame is None:
            return None
        if frame is catcher:
            return error if frame.f_code.co_filename == _MODULE_FILE else None
        frame = frame.f_back
    return None


def engines_of(params: Iterable[torch.Tensor]) -> list[GTPEngine]:
    """The engines whose managed weights (sharded or replicated) are among `params`, each
    once, in the order first met: what a submodule of a wrapped model, or an optimizer's
    parameters, belong to."""
    engines: dict[int, GTPEngine] = {}
    for p in params:
        runtime = getattr(getattr(p, "gtp_weight", None), "runtime", None)
        if isinstance(runtime, GTPEngine):
            engines.setdefault(id(runtime), runtime)
    return list(engines.values())


def engine_of(module: nn.Module) -> GTPEngine:
    """The engine of a wrapped module (a WrapError naming the fix if it is not wrapped)."""
    engine = getattr(module, _ENGINE_ATTR, None)
    if engine is None:
        if engines_of(module.parameters()):
            raise WrapError(
                f"{type(module).__name__} is a part of a wrapped model, not the module "
                "GTPWrap wrapped; pass the wrapped model itself"
            )
        raise WrapError(
            f"{type(module).__name__} is not wrapped; call GTPWrap(module, policy) first"
        )
    return engine


class GTPEngine:
    """Owns the parts (storage, passes, gathers, gradient reduction, casts) of one module."""

    def __init__(
        self,
        root: nn.Module,
        plans: list[ParameterPlan],
        policy: GTPPolicy,
        mesh: GTPMesh,
        device: torch.device,
        layouts: dict[int, TPLayout],
        ep_layouts: dict[int, EPLayout],
    ) -> None:
        install_process_hooks()
        install_optimizer_hook()
        self.policy, self.mesh, self.device = policy, mesh, device
        self.step = 0  # finished backward passes of the model
        self.finite_checked = -1  # the step whose gradients were last checked (finite.py)
        self.stats = Stats()
        timeout = policy.collective_timeout_s
        self.watch = Watch(str(next(_engine_ids)), timeout)
        self.agreement = Agreement(mesh.world_size, self.watch)
        check_ranks_agree(plans, policy, self.agreement, layouts)
        if any(p.shard_dim is None for p in plans):  # every rank alike, nothing allocated yet
            mesh = self.mesh = with_replicated_apart(mesh)
        # The groups the sharded weights are sharded over: gtp, and egtp for expert stacks.
        groups = {
            mesh.egtp.size if p.expert else mesh.gtp.size for p in plans if p.shard_dim is not None
        }
        experts = any(p.expert for p in plans)
        if policy.collectives == "copy_engine" and mesh.gtp.size > 1 < mesh.egtp.size and experts:
            raise WrapError(
                "collectives: copy_engine moves gathers over the gtp group only, and the policy "
                "shards expert stacks over egtp; use collectives: process_group with experts"
            )
        gathers = max(groups, default=1) > 1  # whether any weight is gathered at all
        self.precision = Precision.resolve(policy, gathers, device)
        self.reduce_dtype = self.precision.reduce_dtype
        average = policy.loss_reduction == "mean"
        self.comm = Comm(mesh, timeout, average, step=lambda: self.step, watch=self.watch)
        if policy.collectives == "copy_engine" and mesh.gtp.size > 1:
            self.comm.use_copy_engine(self.agreement, device, policy.group_numel)
        built = build(
            root, plans, policy, self.precision, mesh, self.comm, self, device, layouts, ep_layouts
        )
        self.weights = built.weights
        self.decisions = built.decisions  # for gtp_wrap.describe
        self.passes = Passes(
            self.weights, self.agreement, policy.group_numel, gathers, lambda: self.step
        )
        shared = Shared(
            self.weights, self.comm, self.passes, self.stats, self.ensure_backward, device
        )
        self.gatherer = Gatherer(shared, self.precision, policy.prefetch_depth)
        self.reducer = GradReducer(shared, policy.group_numel, self.reduce_dtype)
        self.casts = Casts(built.storage, built.packing, built.cast_weights,
                           [w.param for w in self.weights], self.stats)  # fmt: skip
        self.replicated = ReplicatedGrads(
            built.replicated, built.replicated_names, self.comm, mesh.replicated
        )
        if mesh.world_size > 1:
            self.replicated.register(self.ensure_backward)
        self.uses = Uses(self, self.passes, self.gatherer, self.stats, self.precision)
        # The runtime interface on the hot path, bound once: no facade hop per use.
        self.intercepting = self.passes.intercepting
        self.use = self.uses.use
        self.full_weight = self.uses.full_weight
        self.gather = self.gatherer.gather
        self.keep_recomputed = self.gatherer.keep_recomputed
        self.take_recomputed = self.gatherer.take_recomputed
        self.reduce_grad = self.reducer.reduce_grad
        self.reduce_grads = self.reducer.reduce_grads
        self.accumulated = self.reducer.accumulated
        # [Note: buffers between steps] Between eager steps the model's gather and staging
        # buffers go back to the allocator. Kept, they would sit under the optimizer step,
        # where AdamW's temporaries put the memory peak at small batch (0.2 GiB at 1.36B: an
        # embedding-sized buffer and a few layers'); on the GPU the caching allocator serves
        # the next step's buffers from the same cached blocks. A graph_step sets keep_buffers
        # for good: from its warm-up on, the buffers its capture will read must exist and stay.
        self.keep_buffers = False
        self.owners = Owners(root, [m for plan in plans for m, _ in plan.owners], self)
        self._gathered_blocks: list[nn.Module] = []  # run on gathered weights (blocks.py)

    def __deepcopy__(self, memo: dict) -> GTPEngine:
        raise WrapError(
            "a wrapped module cannot be deep-copied: its engine holds process groups, streams "
            "and collective state. For an EMA or teacher copy, deep-copy the module before "
            "GTPWrap and wrap the copy too, or load gtp_wrap.full_state_dict(model) into a "
            "fresh unwrapped model"
        )

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        refuse_pickling("a wrapped module")

    def run_on_gathered_weights(self, block: nn.Module, forward: Callable) -> None:
        """Run `block` as `forward(block, ...)` (its class's forward, compiled or not) on its
        weights gathered once per call (see [Note: blocks on gathered weights]); the block
        becomes the owner of the weights inside it."""
        if isinstance(block.__dict__.get("forward"), ExpertDispatch):
            raise WrapError(
                f"'{self.owners.name(block)}' exchanges its tokens over ep (the policy's "
                "expert_parallel) around its own forward: run its parent (the MoE layer) on "
                "gathered weights instead"
            )
        inside = {id(m) for m in block.modules()}
        for taken in list(self._gathered_blocks):
            if taken is not block and id(taken) in inside:
                # One inside it (a policy's MoE layer inside a transformer block that is now
                # compiled): the outer block gathers its weights from now on.
                del taken.forward  # its class's forward again
                self._gathered_blocks.remove(taken)
            elif id(taken) in inside or any(m is block for m in taken.modules()):
                raise WrapError(  # the block itself, or one around it
                    f"'{self.owners.name(taken)}' runs on gathered weights already "
                    "(gtp_wrap.compile or gtp_wrap.gather_per_block was applied to it): apply "
                    "one of them once, to the blocks alone"
                )
        self.owners.take_block(block)
        name = self.owners.name(block)
        gathered = GatheredBlock(name, block, forward, self.uses, self.owners)
        for place, w in enumerate(gathered.members.sharded):
            w.block = (name, place)  # see [Note: a block's weights in one group], chain.py
        self.passes.chains.clear()  # cut anew as the next passes record (every rank alike)
        block.forward = gathered
        self._gathered_blocks.append(block)

    # ---- the pass lifecycle -------------------------------------------------------------

    def open_forward(
        self, module: nn.Module, args: Any, kwargs: dict, opener: str | None = None
    ) -> Any:
        """Open a forward pass of `module` (its forward pre-hook); returns converted inputs."""
        if torch.compiler.is_compiling():
            refuse_tracing("the forward hooks of a wrapped model")
        if torch._C._are_functorch_transforms_active():
            refuse_transforms()
        self.close_abandoned_backward()  # a forward inside backward nests in its pass
        if self.watch.failure is not None and not self.passes.stack:
            agree_to_resume(self.agreement)  # see [Note: a pass after a failure]
        grad = torch.is_grad_enabled()
        if grad and self.passes.scope is None and self.mesh.world_size > 1:
            self.replicated.hook_unfrozen()
        self.casts.refresh()
        state = self.passes.begin(PassKind.FORWARD if grad else PassKind.FORWARD_NO_GRAD, opener)
        if grad and not self.gatherer.local:  # a group of one saves its local weights as is
            hooks = torch.autograd.graph.saved_tensors_hooks(
                self.gatherer.pack, self.gatherer.unpack
            )
            hooks.__enter__()
            state.exit_hooks = hooks
        dtype = self.precision.param_dtype
        if dtype is not None:  # floating inputs follow the weights' compute dtype
            return tree_map_only(
                torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs)
            )
        return None

    def close_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Close the forward pass `open_forward` opened (its always-called forward hook)."""
        error = _forward_error()
        self.end_forward(error, output if error is None else None)

    def end_forward(self, error: BaseException | None, output: Any = None) -> None:
        """Close the forward pass `open_forward` opened; `error`: what its forward raised, if
        it raised; `output`: what it returned, whose backward switches interception back on
        (see [Note: optimizer steps without interception], core/parameter.py)."""
        if not self.passes.stack:  # an earlier pre-hook raised before ours opened the pass
            return
        state = self.passes.stack[-1]
        if state.exit_hooks is not None:
            state.exit_hooks.__exit__(None, None, None)  # type: ignore[attr-defined]
        if error is not None:  # the peers waiting for this pass's collectives learn of it
            self.watch.failed(error, f"in {state.describe(self.step)}")
        self._end_pass(failed=error is not None)
        if error is None:
            self.watch.recovered()
            if output is not None and state.kind is PassKind.FORWARD:
                resume_in_backward(output)

    def ensure_backward(self) -> None:
        """Open the backward pass, unless one is open: called by everything backward runs of
        ours (autograd functions, saved-tensor unpacks, replicated-grad hooks)."""
        if self.passes.in_backward():
            return
        self.casts.refresh()
        self.passes.begin(PassKind.BACKWARD)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        model_pass = self.passes.stack[-1].scope is None
        self.reducer.flush()
        if model_pass and self.replicated.sync and self.mesh.world_size > 1:
            with torch._C.DisableTorchFunctionSubclass():
                self.replicated.finish()
        self._end_pass()
        self.watch.recovered()
        if model_pass:
            self.step += 1
            if not self.keep_buffers:
                self.gatherer.eager.release_free()
                self.reducer.eager.clear()
        self.reducer.end_backward(run_hooks=model_pass)

    def _end_pass(self, failed: bool = False) -> None:
        """Close the current pass: drain its gathers, and record its chain unless it failed."""
        state = self.passes.pop()
        self.gatherer.release_held()
        if failed:
            self.gatherer.abandon(state)
            return
        self.gatherer.drain(state)
        self.passes.record(state)

    def close_abandoned_backward(self) -> None:
        """Drop a backward pass whose backward raised (see `Passes.abandoned`), with what it
        left in flight: called outside backward by the first op on a parameter, and where a
        forward or a capture starts."""
        if self.passes.abandoned():
            state = self.passes.stack[-1]
            self.watch.failed(
                RuntimeError("its backward raised"), f"in {state.describe(self.step)}"
            )
            self.reducer.abandon()
            self.replicated.abandon()
            self._end_pass(failed=True)

    # ---- for graphs/ ----------------------------------------------------------------------

    def current_pass(self) -> PassState | None:
        """The innermost open pass, if any (a graphed region replays once per pass)."""
        return self.passes.stack[-1] if self.passes.stack else None

    def in_pass(self) -> bool:
        """Whether a forward or backward of the model is running."""
        self.close_abandoned_backward()
        return bool(self.passes.stack)

    @contextlib.contextmanager
    def scoped(self, name: str) -> Iterator[None]:
        """Passes opened inside run in scope `name` (a graphed region being captured): their
        own chains, and the graphed regions' buffers (see [Note: graphed buffers]).

        The autograd thread reads the scope too (the region's backward opens its pass there);
        that is safe because the capturing thread waits inside `autograd.grad` meanwhile.
        """
        g, r = self.gatherer, self.reducer
        outer = (self.passes.scope, g.pool, r.staging)
        self.passes.scope, g.pool, r.staging = name, g.graphed, r.graphed
        try:
            yield
        finally:
            self.passes.scope, g.pool, r.staging = outer

    def claim_region(self, name: str) -> None:
        """The weights the passes of region `name` used get their gradients from its replays
        alone (a reduce of one outside the region is refused)."""
        used = [self.weights[i] for i in sorted(self.passes.region_weights(name))]
        for w in used:
            if w.region is not None:
                raise GraphCaptureError(
                    f"'{w.fqn}' is used by graphed regions {w.region} and {name}; each region's "
                    "weights must be its own (graph a module that holds both uses)"
                )
        for w in used:
            w.region = name

    def region_landed(self, weights: Iterable[ShardedWeight]) -> None:
        """A region's replay wrote these weights' `.grad`: their hooks run when the model's
        backward ends, with the others'."""
        self.reducer.region_landed(weights)

    def fence(self) -> None:
        """Make the current stream wait for every collective in flight (their results stay for
        their consumers), so a graph replayed next never runs beside them on the same
        communicator."""
        pending = [gather.pending for state in self.passes.stack for gather in state.inflight]
        for p in pending + self.reducer.in_flight() + self.replicated.in_flight():
            self.comm.wait(p, consume=False)

    def invalidate_casts(self) -> None:
        """The shards changed unseen (a replayed optimizer step): re-cast at the next pass."""
        self.casts.invalidate()

    # ---- for the public API ---------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.replicated.no_sync()

    def gather_bytes(self) -> int:
        """Memory held by the gather buffers of the model and of its graphed regions."""
        return self.gatherer.total_bytes()

    def reset_stats(self) -> None:
        self.stats.reset(peak_gathered_bytes=self.gather_bytes())
