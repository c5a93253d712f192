"""Meta-device init: the values of a model built under torch.device("meta"), made after GTPWrap
allocated only this rank's shards, replicated parameters and buffers.

[Note: replaying the inits] A model built on the meta device ran its inits on nothing, and drew
no random numbers. The values an unwrapped build would have come from what its constructors
ran, replayed here in the order they ran it, with the random generators where the user's seed
left them: each module's children built first (registration order is construction order for
models that register what they build), then its own `reset_parameters()` (what torch's layers
run in their constructors), then, for a module defining `_init_weights(module)` (Hugging Face's
models, nested ones included, and the reference GPT), that hook on each of its modules, children
first, that an inner model did not initialize already. Each call sees its module's own weights
whole: they are staged, one
module at a time, on the target device (empty when first initialized, gathered when a
tied weight was already), and this rank keeps its rows of them. So every weight gets the values
the unwrapped model built with the same seed on the same device type has, whatever the world
size, mesh and policy, at the cost of every rank running the whole init, with memory for one
module's weights. A module whose init is neither (an init written in its constructor only)
needs `init_fn`, which writes each rank's part directly and stages nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..comm.agreement import Agreement, stable_hash
from ..errors import WrapError
from .weight import ShardedWeight

# init_fn(module, name, local, offset): write the values of `module`'s parameter or buffer
# `name` into `local`, this rank's part of it, which starts at `offset` in the whole tensor.
InitFn = Callable[[nn.Module, str, torch.Tensor, tuple[int, ...]], None]


def materialize_meta(
    root: nn.Module,
    weights: list[ShardedWeight],
    gather: Callable[[ShardedWeight], torch.Tensor],
    offset_of: Callable[[ShardedWeight], tuple[int, ...]],
    init_fn: InitFn | None,
) -> None:
    """Give the wrapped `root`'s parameters and buffers their values (see the module docstring).
    `gather(w)`: the whole of a sharded weight, a collective every rank calls in the same order;
    `offset_of(w)`: where this rank's part of it starts."""
    sharded = {id(w.param): w for w in weights}
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        if init_fn is not None:
            for module in root.modules():
                for name, t in [*module._parameters.items(), *module._buffers.items()]:
                    if t is not None:
                        w = sharded.get(id(t))
                        offset = offset_of(w) if w is not None else (0,) * t.dim()
                        init_fn(module, name, t, offset)
            return
        done: set[int] = set()  # sharded weights initialized once already (tied ones)

        def stage(module: nn.Module) -> contextlib.AbstractContextManager:
            return _staged(module, sharded, done, gather)

        _construct(root, stage, set())


def _construct(
    module: nn.Module,
    stage: Callable[[nn.Module], contextlib.AbstractContextManager],
    initialized: set[int],
) -> None:
    """Replay what building `module` ran, in the order it ran it: its children's builds, its
    own `reset_parameters()`, then, where it defines `_init_weights`, that hook on every module
    of it (children first) that no inner model initialized already (Hugging Face initializes
    each nested model in its own constructor, and skips what is initialized when the outer one
    does)."""
    for child in module.children():
        _construct(child, stage, initialized)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        with stage(module):
            reset()
    hook = getattr(module, "_init_weights", None)
    if callable(hook):
        for m in _children_first(module):
            if id(m) not in initialized:
                initialized.add(id(m))
                with stage(m):
                    hook(m)


@contextlib.contextmanager
def _staged(
    module: nn.Module,
    sharded: dict[int, ShardedWeight],
    done: set[int],
    gather: Callable[[ShardedWeight], torch.Tensor],
) -> Iterator[None]:
    """`module`'s own sharded weights whole on their device for the body, this rank's rows of
    them written back after it."""
    staged: list[tuple[str, nn.Parameter, ShardedWeight, torch.Tensor]] = []
    for name, p in module._parameters.items():
        w = sharded.get(id(p)) if p is not None else None
        if w is None or p is None:
            continue
        if id(p) in done:
            whole = gather(w)
        else:
            with torch.inference_mode(False):
                whole = torch.empty(_whole_shape(w), dtype=p.dtype, device=p.device)
        module._parameters[name] = nn.Parameter(whole, requires_grad=p.requires_grad)
        staged.append((name, p, w, whole))
    try:
        yield
    finally:
        for name, p, w, whole in staged:
            module._parameters[name] = p
            local = whole if w.ep is None else w.ep.local_of(whole)
            p.copy_(w.geometry.local_rows_of(local))
            done.add(id(p))


def _whole_shape(w: ShardedWeight) -> torch.Size:
    return (w.ep or w.geometry).shape


def _children_first(root: nn.Module) -> Iterator[nn.Module]:
    """Modules in `nn.Module.apply`'s order: each one's children before it."""
    for child in root.children():
        yield from _children_first(child)
    yield root


def check_same_generators(agreement: Agreement, device: torch.device) -> None:
    """Every rank's random generators (the CPU's, and the device's) must stand where the same
    seed left them: each rank draws the whole init and keeps its rows, so ranks seeded
    differently would hold rows of different models."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    mine = [stable_hash(bytes(s.tolist()).hex()) for s in states]
    per_rank = agreement.exchange(
        "meta-seed", mine, "the check that every rank seeded its random generators the same"
    )
    if any(theirs != mine for theirs in per_rank):
        raise WrapError(
            "ranks built the meta-device model with their random generators in different "
            "states: call torch.manual_seed(same seed) on every rank before building it (each "
            "rank runs the whole init and keeps its own rows)"
        )


def check_meta(module: nn.Module, has_tp: bool) -> bool:
    """Whether `module` was built on the meta device (all of it, or nothing: a part would mix
    values from two sources); a WrapError for what a meta build does not support yet."""
    tensors = [*module.parameters(), *module.buffers()]
    on_meta = [t.is_meta for t in tensors]
    if not any(on_meta):
        return False
    if not all(on_meta):
        raise WrapError(
            "the model is partly on the meta device: build all of it under "
            'torch.device("meta") (GTPWrap then allocates and initializes this rank\'s part), '
            "or none of it"
        )
    if has_tp:
        raise WrapError(
            "a meta-device model with tensor parallelism is not supported yet: build the model "
            "on its device, or leave tp out"
        )
    return True
