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

import functools
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
        replay = _Replay(root, weights, gather)
        replay.construct(root)
        replay.check_all_written()


class _Replay:
    """The replay of one model's inits (see [Note: replaying the inits]), and what it wrote."""

    def __init__(
        self,
        root: nn.Module,
        weights: list[ShardedWeight],
        gather: Callable[[ShardedWeight], torch.Tensor],
    ) -> None:
        self.root = root
        self.sharded = {id(w.param): w for w in weights}
        self.gather = gather
        # Parameters written: a tied sharded one is gathered for its next init, a tied one's
        # next constructor init runs on scratch.
        self.done: set[int] = set()
        self.built: set[int] = set()  # modules replayed (one registered twice runs once)
        self.initialized: set[int] = set()  # modules an `_init_weights` hook has seen
        # The flat storages' version counters (one per dtype, shared by its shards): a body
        # that moves one wrote a shard it did not stage.
        self.flats = list({w.geometry.dtype: w.param for w in weights}.values())
        self.versions = {
            name: t._version
            for name, t in [*root.named_parameters(), *root.named_buffers()]
            if id(t) not in self.sharded
        }

    def construct(self, module: nn.Module) -> None:
        """Replay what building `module` ran, in the order it ran it: its children's builds,
        its own `reset_parameters()` (or `_reset_parameters()`, torch's attention's name), then,
        where it defines `_init_weights`, that hook on every module of it (children first)
        that no inner model initialized already (Hugging Face initializes each nested model in
        its own constructor, and skips what is initialized when the outer one does)."""
        if id(module) in self.built:
            return
        self.built.add(id(module))
        for child in module.children():
            self.construct(child)
        reset = getattr(module, "reset_parameters", None) or getattr(
            module, "_reset_parameters", None
        )
        if callable(reset):
            self.run(module, reset, constructing=True)
        hook = getattr(module, "_init_weights", None)
        if callable(hook):
            for m in _children_first(module):
                if id(m) not in self.initialized:
                    self.initialized.add(id(m))
                    self.run(m, functools.partial(hook, m))

    def run(
        self, module: nn.Module, init: Callable[[], object], constructing: bool = False
    ) -> None:
        """`init()` with `module`'s own sharded weights staged whole, this rank's rows of them
        written back after it.

        [Note: tied weights at construction] A weight two modules share was tied after both
        were built (`self.head.weight = self.embed.weight`): the second module's constructor
        initialized a tensor of its own, which the tie then dropped, and the first one's values
        are the model's. So a constructor-time init (`constructing`) of a weight an earlier
        init wrote runs on a scratch tensor, drawing its random numbers as the unwrapped build
        did, and its values are dropped. A tie the other way round (the first module made to
        share the second's tensor) is not told apart: pass init_fn for it. Hooks that run on
        the finished model (`_init_weights`) see the tie, so their writes count."""
        staged: list[tuple[str, nn.Parameter, ShardedWeight, torch.Tensor]] = []
        originals = dict(module._parameters)
        for name, p in originals.items():
            if p is None:
                continue
            w = self.sharded.get(id(p))
            if id(p) in self.done and constructing:
                shape = p.shape if w is None else _whole_shape(w)
                with torch.inference_mode(False):
                    scratch = torch.empty(shape, dtype=p.dtype, device=p.device)
                module._parameters[name] = nn.Parameter(scratch, requires_grad=p.requires_grad)
                continue  # restored below, its values not kept
            if w is None:
                continue  # replicated: the init writes it in place
            if id(p) in self.done:
                whole = self.gather(w)
            else:
                with torch.inference_mode(False):
                    whole = torch.empty(_whole_shape(w), dtype=p.dtype, device=p.device)
            module._parameters[name] = nn.Parameter(whole, requires_grad=p.requires_grad)
            staged.append((name, p, w, whole))
        # Replicated parameters this init writes in place (a tied one's second init is given
        # a scratch tensor above, like a sharded one's).
        replicated = [
            (p, p._version)
            for p in originals.values()
            if p is not None and id(p) not in self.sharded and id(p) not in self.done
        ]
        before = [f._version for f in self.flats]
        try:
            init()
        finally:
            module._parameters.update(originals)
        if [f._version for f in self.flats] != before:
            raise WrapError(
                f"the init of {type(module).__name__} '{self._name(module)}' writes weights of "
                "its submodules, which a meta-device build holds as shards (each rank its "
                "rows): give each submodule a reset_parameters() of its own, or pass init_fn"
            )
        for _, p, w, whole in staged:
            local = whole if w.ep is None else w.ep.local_of(whole)
            p.copy_(w.geometry.local_rows_of(local))
            self.done.add(id(p))
        for p, version in replicated:
            if p._version != version:
                self.done.add(id(p))

    def check_all_written(self) -> None:
        """Every parameter and buffer must have been written by the replay: one whose init runs
        only in a constructor would keep uninitialized memory (different on each rank)."""
        named = dict([*self.root.named_parameters(), *self.root.named_buffers()])
        missed = [n for n, t in named.items() if id(t) in self.sharded and id(t) not in self.done]
        missed += [n for n, v in self.versions.items() if named[n]._version == v]
        if missed:
            raise WrapError(
                f"a meta-device build left {missed[:6]}{' ...' if len(missed) > 6 else ''} "
                "uninitialized: no reset_parameters() or _init_weights() writes them (their "
                "init runs only in a constructor). Move it into the module's reset_parameters(), "
                "or pass init_fn to GTPWrap"
            )

    def _name(self, module: nn.Module) -> str:
        return next((n for n, m in self.root.named_modules() if m is module), "")


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
