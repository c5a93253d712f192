"""One object per managed weight: what the engine knows of it, and its gradient's lifecycle.

A `ShardedWeight` is everything about one sharded parameter: its names, its geometry, the
registered parameter (this rank's rows), the mesh roles it is sharded and replicated over (and
an expert stack's experts this rank keeps), how its gathers send
it (its encoding), the view its local uses read, the graphed region that owns it, its users'
gradient hooks, and where this backward's gradient of it is (`GradState`). The parameter points
to it and to nothing else; the engine's parts take it as their unit of work. A `CastWeight` is
the same for a replicated parameter that passes read through a copy in the compute dtype.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..geometry import ShardGeometry

if TYPE_CHECKING:
    from ..mesh import MeshAxis
    from ..parallel.experts import EPLayout
    from ..parallel.tensor import TPLayout
    from ..precision.encoding import Encoding


class Runtime(Protocol):
    """What a parameter asks of the engine that owns it, from `__torch_function__`."""

    def intercepting(self) -> bool:
        """Whether uses of managed parameters see full weights now (a pure query)."""
        ...

    def close_abandoned_backward(self) -> None:
        """Close a backward pass left open by a backward that raised, if there is one."""
        ...

    def use(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `func` with each managed parameter among its arguments as the weight it uses."""
        ...


class GradState(enum.Enum):
    """Where the current backward's gradient of one sharded weight is. Advanced only by the
    gradient reducer (runtime/reduce.py), through the methods below."""

    NONE = "none"  # no gradient of it in this backward yet
    PENDING = "pending"  # handed to a reduce-scatter group, not yet in `.grad`
    # in `.grad`, or handed to autograd to accumulate there (a block's gradient in a group of
    # one, written before backward ends); its post-accumulate-grad hooks run when backward ends
    LANDED = "landed"


class ShardedWeight:
    """One sharded weight (see the module docstring)."""

    __slots__ = (
        "index", "fqns", "geometry", "axis", "param", "encoding", "local", "meta", "runtime",
        "region", "grad_hooks", "grad_state", "pending_grads", "what_gather", "what_reduce",
        "what_dp", "tp", "replicas", "ep", "unit", "block",
    )  # fmt: skip

    def __init__(
        self,
        index: int,
        fqns: tuple[str, ...],
        geometry: ShardGeometry,
        axis: MeshAxis,
        replicas: MeshAxis,
        runtime: Runtime,
        compute_dtype: torch.dtype,
    ) -> None:
        self.index = index  # its position in the engine's weights: what chains record
        self.fqns = fqns
        self.geometry = geometry
        self.axis = axis  # sharded over it: gtp, or egtp for an expert stack
        self.replicas = replicas  # replicated over it: dp, or edp
        self.runtime = runtime
        # The weight a use sees (logical shape, compute dtype) on the meta device: metadata
        # queries during a pass answer from it without a gather.
        self.meta = torch.empty(geometry.shape, dtype=compute_dtype, device="meta")
        self.param: torch.nn.Parameter  # set by the build, once storage exists
        self.encoding: Encoding
        self.local: torch.Tensor  # this rank's rows as local uses read them (a group of one)
        self.region: str | None = None  # the graphed region whose replays own its gradient
        self.grad_hooks: OrderedDict[int, Callable[[torch.Tensor], None]] | None = None
        self.grad_state = GradState.NONE
        self.pending_grads = 0
        # Its collectives' error descriptions, made here rather than per use (comm.Pending).
        fqn = fqns[0]
        self.what_gather = f"all-gather of '{fqn}' ({{context}}step {{step}})"
        self.what_reduce = f"reduce-scatter of the gradient of '{fqn}' (step {{step}})"
        self.what_dp = f"dp all-reduce of the gradient of '{fqn}'"
        self.tp: TPLayout | None = None  # its tensor-parallel layout: a use sees a DTensor
        self.ep: EPLayout | None = None  # an expert stack's experts this rank keeps
        # An expert stack's layer (its module's FQN): the stacks of one layer are gathered and
        # reduce-scattered as one collective, whatever group_numel says.
        self.unit: str | None = None
        # The block on gathered weights it belongs to and its place among the block's weights
        # (the order a block call gathers them in), if any: a chain never cuts one call of a
        # block into two groups (see [Note: a block's weights in one group]).
        self.block: tuple[str, int] | None = None

    @property
    def fqn(self) -> str:
        return self.fqns[0]

    def __repr__(self) -> str:
        return f"ShardedWeight({self.fqn!r}, {tuple(self.geometry.shape)}, {self.grad_state})"

    # ---- the gradient's lifecycle: NONE -> PENDING (-> PENDING ...) -> LANDED -> NONE, ----
    # ---- or NONE -> LANDED for a gradient that lands as it is collected             ----

    def grad_collected(self) -> None:
        """A gradient of this weight joined a reduce-scatter group."""
        self.grad_state = GradState.PENDING
        self.pending_grads += 1

    def grad_landed(self) -> None:
        """One pending gradient was written into `.grad`; the last one lands the weight."""
        if self.grad_state is not GradState.PENDING:
            raise RuntimeError(f"{self!r}: a gradient landed that was never collected")
        self.pending_grads -= 1
        if self.pending_grads == 0:
            self.grad_state = GradState.LANDED

    def grad_landed_at_once(self) -> None:
        """A gradient landed as it was collected (no collective to wait for): the weight is
        landed, unless another of its gradients is still pending."""
        if self.pending_grads == 0:
            self.grad_state = GradState.LANDED

    def region_grad_landed(self) -> None:
        """A graphed region's replay wrote this weight's `.grad` (no Python ran for it)."""
        if self.grad_state is GradState.PENDING:
            raise RuntimeError(f"{self!r}: a region replay landed a gradient still pending")
        self.grad_state = GradState.LANDED

    @staticmethod
    def backward_ended(weights: Iterable[ShardedWeight]) -> None:
        """The backward is over: the next one starts with no gradient of these weights (those
        it landed, all at once: one call per backward, not per weight)."""
        for w in weights:
            if w.grad_state is GradState.PENDING:
                raise RuntimeError(f"{w!r}: backward ended with its gradient still pending")
            w.grad_state = GradState.NONE

    def abandon_grads(self) -> None:
        """The backward raised: its pending gradients will never land."""
        self.grad_state, self.pending_grads = GradState.NONE, 0

    # ---- users' hooks -----------------------------------------------------------------

    def add_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """`param.register_post_accumulate_grad_hook(hook)` for this sharded parameter.

        [Note: hooks on shards] The reducer writes a sharded parameter's `.grad` when its
        reduce-scatter is finalized; autograd accumulates into it only a block's gradient with
        no peer to reduce with (see [Note: a block's gradients in a group of one]). Either way
        autograd would run such a hook at the wrong time: before `.grad` is written, or before
        the weight's other uses in this backward landed. The reducer runs it instead, once per
        backward, after that backward's last gradient landed and its pass closed, so the hook
        may step an optimizer on the shard (optimizer-in-backward).
        """
        if self.grad_hooks is None:
            # An OrderedDict, as torch's own hook dicts: the handle keeps a weak reference.
            self.grad_hooks = OrderedDict()
        handle = RemovableHandle(self.grad_hooks)
        self.grad_hooks[handle.id] = hook
        return handle


class CastWeight:
    """A replicated floating-point parameter that passes read through its compute-dtype copy,
    re-cast when the parameter changed (its version counter moved past `cast_version`, or an
    optimizer stepped): the engine's casts re-cast every stale copy together (runtime/casts.py)."""

    __slots__ = ("fqn", "param", "cast", "cast_version", "meta", "runtime", "tp", "aliased")

    def __init__(self, fqn: str, like: torch.Tensor, dtype: torch.dtype, runtime: Runtime):
        self.fqn = fqn
        self.param: torch.nn.Parameter  # set by the build
        self.runtime = runtime
        # In the parameter's own dtype (a tensor-parallel block read as a DTensor) the "copy"
        # is the parameter's data itself: nothing to hold twice or re-cast.
        self.aliased = dtype == like.dtype
        self.cast = like.detach() if self.aliased else torch.empty_like(like, dtype=dtype)
        self.cast_version = -1  # stale: cast before the first pass
        self.meta = torch.empty(like.shape, dtype=dtype, device="meta")
        self.tp: TPLayout | None = None  # as ShardedWeight.tp


def describe_group(weights: list[ShardedWeight], action: str, one: str, context: str) -> str:
    """The error description of a collective over `weights`: a weight's own (`one`, made at
    wrap time), or for a group its first and last weights; Comm fills in the step."""
    if len(weights) == 1:
        return one
    first, last = weights[0].fqn, weights[-1].fqn
    return f"{action} '{first}' ... '{last}' ({len(weights)} weights, {context}step {{step}})"
