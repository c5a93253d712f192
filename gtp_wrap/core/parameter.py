"""The registered parameter of a managed weight: the local shard, plus interception of its uses.

[Note: interception] A sharded weight can be read anywhere: in its own module's forward, in a
parent's forward (a tied output head reading the embedding), as a view kept for later, inside a
checkpointed region's recompute. Module hooks only see the first of these. A parameter subclass sees
them all: while a pass runs, every torch function that takes the parameter is handed the gathered
full weight instead. Outside passes (optimizer steps, state dicts, user code) it is an ordinary
parameter holding the local shard, so `named_parameters()` and any optimizer work unchanged.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import WrapError
from .weight import CastWeight, Runtime, ShardedWeight

# Metadata queries answer for the weight a use sees (logical full shape, compute dtype) during a
# pass, without a gather.
_META_FUNCS = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    }
)
# Attribute getters that return a tensor computed from the weight: they are uses.
_TENSOR_GETTERS = frozenset(getattr(torch.Tensor, name).__get__ for name in ("T", "mT", "H", "mH"))
_ATTRIBUTE_ACCESS = frozenset({"__get__", "__set__", "__delete__"})
_GRAD_GET = frozenset({torch.Tensor.grad.__get__})  # type: ignore[union-attr]
_TORCH_CLIP_FILE = sys.modules["torch.nn.utils.clip_grad"].__file__
_graph_task_id = torch._C._current_graph_task_id
# `func` run as on a plain tensor (torch's own no-override path, in C++): what every op on a
# managed parameter outside passes costs, an optimizer step's attribute reads included.
_plain = torch._C._disabled_torch_function_impl
_NO_KWARGS: dict = {}  # never written: `func` gets its keywords unpacked
_TENSOR_DATA: Any = torch._C.TensorBase.data  # the getter and setter GTPParameter.data wraps


class OpenPasses:
    """How many passes are open across all engines: zero makes interception a no-op check
    (the engines' pass stacks keep it, runtime/passes.py)."""

    count = 0

    @classmethod
    def open(cls) -> None:
        cls.count += 1
        _OptimizerSteps.resume()

    @classmethod
    def close(cls) -> None:
        cls.count -= 1


class GTPParameter(nn.Parameter):
    """A parameter holding this rank's rows of a sharded weight, or a replicated parameter read
    through its compute-dtype copy (see the module docstring). `gtp_weight` is all it knows."""

    gtp_weight: ShardedWeight | CastWeight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if not OpenPasses.count and _graph_task_id() == -1:  # optimizer steps, state dicts
            if func in _GRAD_GET:  # torch's clip reads grads outside passes: never on a use
                weight = args[0].gtp_weight  # checked here: zero_grad reads every `.grad`
                if type(weight) is ShardedWeight and weight.axis.size > 1:
                    _refuse_per_rank_clip(weight)
            elif func in _MODULE_COMPUTE:
                _refuse_compute_on_shards(func, args, kwargs)
            elif func is torch.autograd.grad:
                refuse_grad_of_shards(args[1])
            return _plain(func, types, args, kwargs or _NO_KWARGS)
        kwargs = kwargs or {}
        runtime = _runtime_of(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if runtime is None:
                return func(*args, **kwargs)
            if torch._C._current_graph_task_id() == -1:
                # Outside backward, a backward pass still open is one that raised: closed at
                # the first op on a parameter after it (the optimizer's, zero_grad's, the next
                # forward's), before asking whether this op is a use.
                runtime.close_abandoned_backward()
            if not runtime.intercepting():
                return func(*args, **kwargs)
            if func in _META_FUNCS:
                args, kwargs = tree_map_only(GTPParameter, _meta, (args, kwargs))
                return func(*args, **kwargs)
            if not is_use(func):
                return func(*args, **kwargs)
            return runtime.use(func, args, kwargs)

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        if OpenPasses.count and _graph_task_id() == -1:
            _refuse_data_in_forward(self)
        return _TENSOR_DATA.__get__(self, GTPParameter)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """[Note: replacing a parameter's data] The engine reads a weight through the storage
        it laid out at wrap (a sharded weight's rows of the flat storage, a replicated
        weight's compute-dtype copy); `p.data = t` rebinds only the parameter, so the
        optimizer and state dicts would follow `t` while every forward kept using the old
        values, silently. `Module.to(dtype)`, `.half()`, `.double()` and `.to(device)` after
        wrapping do exactly that. A rebind to the tensor already there (`.float()` of an fp32
        model, `.to` its own device) changes nothing and passes."""
        if not (
            isinstance(value, torch.Tensor)
            and value.data_ptr() == self.data_ptr()
            and value.dtype == self.dtype
            and value.device == self.device
            and value.shape == self.shape
            and value.stride() == self.stride()
        ):
            raise WrapError(
                f"'{self.gtp_weight.fqn}' had its .data replaced after GTPWrap (by `p.data = "
                "t`, or by model.to(dtype or device), .half(), .double(), .to_empty() on the "
                "wrapped model): the engine keeps reading the storage laid out at wrap, so "
                "the forward would silently use the old values. Move and cast the model "
                "before wrapping; to change values, write in place under torch.no_grad() "
                "(p.copy_(t) with this rank's rows), or load a full state dict with "
                "gtp_wrap.load_full_state_dict(model, state)"
            )
        _TENSOR_DATA.__set__(self, value)

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        refuse_pickling(f"'{self.gtp_weight.fqn}', a parameter of a wrapped module,")

    def register_hook(self, hook):  # type: ignore[override]
        weight = self.gtp_weight
        if type(weight) is not ShardedWeight:
            return super().register_hook(hook)
        raise WrapError(
            f"register_hook on the sharded parameter '{weight.fqn}': its gradient does not "
            "flow into it through autograd (the engine reduce-scatters each use's full-weight "
            "gradient and writes this rank's rows into .grad), so the hook would see None, or "
            "one use's part. Use register_post_accumulate_grad_hook, which runs once the "
            "reduced gradient is in .grad, or change .grad after backward"
        )

    def register_post_accumulate_grad_hook(self, hook):  # type: ignore[override]
        weight = self.gtp_weight
        if type(weight) is ShardedWeight:
            if not self.requires_grad:  # as torch's own refusal
                raise RuntimeError(
                    "cannot register a hook on a tensor that doesn't require gradient"
                )
            return weight.add_grad_hook(hook)

        def on_the_parameter(p: torch.Tensor) -> None:
            # Autograd runs it inside backward, where this parameter would read as its
            # compute-dtype copy: an optimizer step in the hook must reach the parameter.
            with torch._C.DisableTorchFunctionSubclass():
                hook(p)

        return super().register_post_accumulate_grad_hook(on_the_parameter)


def _refuse_data_in_forward(p: GTPParameter) -> None:
    """[Note: .data in a forward] `.data` is the storage, not a use: inside a forward it is
    this rank's rows of a sharded weight, so a statistic read from it (`w.data.norm()`) was one
    rank's, silently. Handing out the gathered weight instead would lose what is written
    through it (`w.data.mul_(...)`), silently too, so both are refused where the forward reads
    it; backward hooks (an optimizer step in a gradient hook) keep the storage."""
    weight = p.gtp_weight
    if type(weight) is ShardedWeight and weight.axis.size > 1 and weight.runtime.intercepting():
        raise WrapError(
            f"'{weight.fqn}'.data was read inside the forward, where it is this rank's rows of "
            "the sharded weight (and a write through it would change only those). Read "
            "weight.detach() for the full weight without its gradient (and .shape or .dtype "
            "directly); change weights in place under torch.no_grad() outside the forward"
        )


def refuse_pickling(what: str) -> NoReturn:
    """A wrapped module and its parameters hold one rank's rows and the engine's process
    groups; pickling them would fail inside pickle on a process group, naming neither."""
    raise WrapError(
        f"{what} cannot be pickled (torch.save(model), pickle.dumps): it holds this rank's "
        "rows of the weights and the engine's process groups. Save model.state_dict() with "
        "torch.distributed.checkpoint or gtp_wrap.checkpoint.save, or torch.save "
        "gtp_wrap.full_state_dict(model) on one rank"
    )


def _refuse_per_rank_clip(weight: ShardedWeight) -> None:
    """[Note: torch's clip on shards] `torch.nn.utils.clip_grad_norm_(model.parameters())`
    would compute each rank's norm of its own rows of every sharded gradient, so ranks would
    clip by different factors, silently. FSDP2 avoids it with DTensor gradients, whose norm
    reduces across ranks; a shard's `.grad` here is a plain tensor of the shard's shape (what
    any optimizer needs), so the mistake is refused where torch's function reads the gradient
    of a weight sharded over more than one rank."""
    frame: types.FrameType | None = sys._getframe(2)  # torch's comprehension, or its caller
    for _ in range(3):
        if frame is None:
            return
        code = frame.f_code
        if code.co_filename == _TORCH_CLIP_FILE and code.co_name == "clip_grad_norm_":
            raise WrapError(
                f"torch.nn.utils.clip_grad_norm_ read the gradient of '{weight.fqn}', which "
                f"holds only this rank's rows: each of the {weight.axis.size} ranks would "
                "compute the norm of its own shards and clip by a different factor. Use "
                "gtp_wrap.clip_grad_norm_(model, max_norm, norm_type, ...): the same arguments "
                "with the wrapped model in place of its parameters, and the norm over every "
                "rank's shards"
            )
        frame = frame.f_back


# What a module's forward computes with its weight: outside passes, on a sharded parameter, it
# would compute with this rank's rows.
_MODULE_COMPUTE = frozenset({F.linear, F.embedding, F.bilinear, F.conv1d, F.conv2d, F.conv3d})


def _refuse_compute_on_shards(func, args: tuple, kwargs: dict | None) -> None:
    """A module called outside any pass, whose weight is sharded over more than one rank,
    would silently compute with this rank's rows. Owners open a pass around their own calls;
    a module inside a block that runs on gathered weights is no owner (runtime/owners.py)."""
    found = [a for a in (*args, *(kwargs or {}).values()) if type(a) is GTPParameter]
    for p in found:
        weight = p.gtp_weight
        if type(weight) is ShardedWeight and weight.axis.size > 1:
            raise WrapError(
                f"{func.__name__} used '{weight.fqn}' outside a forward or backward pass of "
                f"the wrapped model, where it holds only this rank's rows of the weight. Call "
                "a module of the model instead, which gathers the weight for the call (for a "
                "module inside a block run by gtp_wrap.compile or gtp_wrap.gather_per_block: "
                "the block); gtp_wrap.full_state_dict(model) gives the full weights outside a "
                "pass"
            )


def refuse_grad_of_shards(inputs: tuple) -> None:
    """`torch.autograd.grad` with respect to a sharded parameter cannot return its gradient:
    none flows into the parameter through autograd (each use's full-weight gradient goes to
    the reduce-scatter, which writes this rank's rows into `.grad` when backward ends), so
    torch would report the weight as unused after writing its `.grad` as a side effect."""
    for p in inputs:
        if type(p) is GTPParameter and type(p.gtp_weight) is ShardedWeight:
            raise WrapError(
                f"torch.autograd.grad with respect to the sharded parameter "
                f"'{p.gtp_weight.fqn}': its gradient does not flow into it through autograd "
                "(each use's full-weight gradient is reduce-scattered when backward ends and "
                "this rank's rows land in .grad), so autograd.grad cannot return it. Call "
                "backward() and read .grad, or take autograd.grad with respect to the inputs "
                "only; a weight whose gradient you need this way can stay whole (a LayerRule "
                "with action='replicate')"
            )


# The in-place Python operators; PyTorch's in-place ops end in one underscore.
_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
               "xor", "lshift", "rshift")
) | {"__setitem__"}  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _writes_first_argument(func) -> bool:
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__") and name != "requires_grad_"
    return in_place or name in _IN_PLACE_DUNDERS


def written_param(func, args: tuple, kwargs: dict) -> GTPParameter | None:
    """The engine parameter that `func`, used during a pass, writes into, if any: the first
    argument (or the first of a list, for the in-place _foreach_ ops) of an in-place op, and
    the weight of an embedding lookup with `max_norm` (which renormalizes the rows it reads)."""
    if func is F.embedding:
        max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
        weight = kwargs.get("weight", args[1] if len(args) > 1 else None)
        return weight if max_norm is not None and type(weight) is GTPParameter else None
    if not args or not _writes_first_argument(func):
        return None
    first = args[0]
    if type(first) in (list, tuple):
        first = next((t for t in first if type(t) is GTPParameter), None)
    return first if type(first) is GTPParameter else None


def is_use(func) -> bool:
    """Whether `func`, called during a pass, reads the weight's values (and so needs it
    gathered): not a metadata query, not a plain attribute access."""
    if func in _META_FUNCS:
        return False
    return func in _TENSOR_GETTERS or getattr(func, "__name__", "") not in _ATTRIBUTE_ACCESS


def _meta(p: GTPParameter) -> torch.Tensor:
    return p.gtp_weight.meta


def _runtime_of(args: tuple, kwargs: dict) -> Runtime | None:
    for a in args:
        if type(a) is GTPParameter:
            return a.gtp_weight.runtime
    for a in kwargs.values():  # torch's functional wrappers pass weights by keyword
        if type(a) is GTPParameter:
            return a.gtp_weight.runtime
    found: list[Runtime] = []

    def visit(p: GTPParameter) -> GTPParameter:
        found.append(p.gtp_weight.runtime)
        return p

    tree_map_only(GTPParameter, visit, (args, kwargs))
    return found[0] if found else None


_INTERCEPT = GTPParameter.__dict__["__torch_function__"]


class _OptimizerSteps:
    """[Note: optimizer steps without interception] An optimizer step reads several attributes
    of every parameter (`.grad`, `is_complex()`, its state's keys): 345 calls into
    `__torch_function__` per fused AdamW step of a 12-layer GPT, 689 with foreach kernels, each
    a Python call that only finds no pass open (about 1.5 µs each on CPU, 0.5 to 1 ms per step).
    `zero_grad` reads and sets every `.grad`: 172 calls more. Torch skips the Python call
    altogether for a class whose `__torch_function__` is its own disabled implementation, as
    `nn.Parameter`'s is. So a step outside every pass and outside backward switches
    GTPParameter's to that implementation, and it stays so until the next pass opens
    (`OpenPasses.open`) or a backward reaches the output of a wrapped model's forward
    (`resume_in_backward`), whichever comes first: the step, the `zero_grad` after it and
    whatever else runs before the next forward touch only shards and gradients, never a use.
    The second matters where a step comes between a forward and its backward (another model's
    optimizer: a GAN's discriminator): a checkpoint's recompute in that backward reads the
    weights before any pass of ours opens, and must see them gathered. A step that raises
    leaves interception off the same way.

    What this gives up: outside passes, interception only refuses two mistakes on weights
    sharded over more than one rank, and between a step and the next pass neither is checked:
    torch's clip of the shards' gradients (a loop that clips before its first step is
    refused there; one that clips only the parameters of a second optimizer, after the first
    one's step, is not), and a module inside a block on gathered weights called on its own. A
    backward started from a tensor inside a wrapped model rather than its output, after a
    step, runs a checkpoint's recompute on the shards (the shapes then disagree, or the rows
    are this rank's): start backward from the model's output, or from what it was computed
    into.
    """

    off = False  # whether a step switched interception off and nothing switched it back on
    registered = False  # whether `begin` is a global optimizer-step pre-hook yet

    @staticmethod
    def begin(optimizer: object, args: object, kwargs: object) -> None:
        # Not for an optimizer stepped inside backward (from a gradient hook): uses may follow.
        if not _OptimizerSteps.off and not OpenPasses.count and _graph_task_id() == -1:
            _OptimizerSteps.off = True
            GTPParameter.__torch_function__ = _plain  # type: ignore[assignment]

    @staticmethod
    def resume(*_: object) -> None:
        """Switch interception back on, where a step switched it off."""
        if _OptimizerSteps.off:
            _OptimizerSteps.off = False
            GTPParameter.__torch_function__ = _INTERCEPT  # type: ignore[method-assign]


def resume_in_backward(output: object) -> None:
    """Have a backward through `output`, a wrapped model's forward output, switch
    interception back on as it reaches it (see [Note: optimizer steps without interception]):
    before any node of the model runs, since the output's nodes come first in backward."""
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(_OptimizerSteps.resume)


def register_with_optimizers() -> None:
    """Let optimizers take their multi-tensor kernels for GTP parameters, and step them without
    interception (see [Note: optimizer steps without interception]); at the first wrap.

    [Note: foreach optimizers] Optimizers pick their fast multi-tensor (foreach) kernels only
    for parameters whose exact type is listed in `_foreach_supported_types`, and fall back to
    one small kernel per tensor otherwise (measured: ~19 ms of host time per AdamW step on a
    1.4B model). Outside passes a GTPParameter is a plain strided tensor to every kernel, so it
    is safe to list.
    """
    types = getattr(
        importlib.import_module("torch.optim.optimizer"), "_foreach_supported_types", None
    )
    if isinstance(types, list) and GTPParameter not in types:
        types.append(GTPParameter)
    if not _OptimizerSteps.registered:
        _OptimizerSteps.registered = True
        register_optimizer_step_pre_hook(_OptimizerSteps.begin)


def make_gtp_parameter(
    data: torch.Tensor, requires_grad: bool, weight: ShardedWeight | CastWeight
) -> GTPParameter:
    """`data` (a view into the flat storage, or a replicated tensor) as the parameter of
    `weight`, which points back at it."""
    p = GTPParameter(data, requires_grad=requires_grad)
    p.gtp_weight = weight
    weight.param = p
    if requires_grad and type(weight) is ShardedWeight and weight.axis.size > 1:
        torch.Tensor.register_hook(p, _RefuseGradOfShard(weight))
    return p


class _RefuseGradOfShard:
    """[Note: gradients of shards] The engine hands every use's gradient of a weight sharded
    over more than one rank to its reduce-scatter, which writes `.grad`; autograd never
    delivers one to the parameter itself. One that arrives there came from an op on the
    parameter outside the model's passes (a weight penalty summed over `model.parameters()`
    before or after the forward, say), where it holds only this rank's rows: the penalty is
    one rank's part and the gradient would silently be wrong. The hook refuses it (autograd
    also calls it with the None each of the engine's uses hands back: one Python call per
    use in backward, which it returns from at once). An op outside passes cannot tell such a
    use from an optimizer's or an inspection's, and after a step interception is off (see
    [Note: optimizer steps without interception])."""

    def __init__(self, weight: ShardedWeight) -> None:
        self.fqn = weight.fqn

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is None:  # autograd runs a leaf's hooks on the None its uses hand back
            return
        raise WrapError(
            f"'{self.fqn}' got a gradient through an op outside the wrapped model's forward "
            "(e.g. a weight penalty computed from model.parameters() before or after it), "
            "where the parameter holds only this rank's rows, so the result was one rank's "
            "part. Compute it inside the model's forward, where uses read the full weight"
        )
