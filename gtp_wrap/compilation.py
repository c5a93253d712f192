"""Blocks of a wrapped model run on their gathered weights: compiled by torch.compile
(`compile`), or eagerly (`gather_per_block`); the engine runs between them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .core.weight import ShardedWeight
from .errors import WrapError
from .runtime.engine import engine_of


def compile(  # noqa: A001 - torch.compile's counterpart, named as users look for it
    model: nn.Module, blocks: str | Iterable[nn.Module] | None = None, **options: Any
) -> nn.Module:
    """Compile the blocks of a wrapped model with `torch.compile`, in place; returns `model`.

    Each block's forward runs as compiled code on plain tensors: its sharded weights are
    gathered along the chain just before it runs, and their gradients reduce-scattered in
    backward as in eager mode (see [Note: blocks on gathered weights] in runtime/blocks.py).
    Code outside the blocks (embeddings, the head, the loss) stays eager. This is how
    torchtitan compiles with FSDP2: one block at a time, all blocks of a class sharing one
    compiled graph.

    Args:
        model: a module wrapped by `GTPWrap`.
        blocks: which submodules to compile: None for the items of the model's `nn.ModuleList`s
            that hold sharded weights (the transformer blocks), a class name (the outermost
            modules of that class or a subclass), or the modules themselves.
        **options: passed to `torch.compile` (`mode`, `fullgraph`, `dynamic`, `backend`, ...).

    `torch.compile(model)` on the whole wrapped model is refused with a `WrapError` naming
    this function: Dynamo cannot trace the sharded parameters' gathers.
    """
    return _run_blocks(model, blocks, lambda cls: torch.compile(cls.forward, **options))


def gather_per_block(
    model: nn.Module, blocks: str | Iterable[nn.Module] | None = None
) -> nn.Module:
    """Run the blocks of a wrapped model eagerly on weights gathered once per block call, in
    place; returns `model`.

    What `compile` does, without compiling: before a block runs, its weights are gathered and
    swapped in as plain tensors, so the ops inside it run at plain torch's cost instead of
    each use of a weight going through the engine's interception (about a third less host work
    per step on the reference GPT, `benchmarks/RESULTS.md`). `blocks` is chosen as for
    `compile`. Inside such a block, linear layers take autograd's own backward (the weight
    gradient in the compute dtype, then rounded to the reduce dtype), and an in-place write to a
    weight, which would change the gathered copy only, is refused once the block returns (see
    [Note: writes inside a block] in runtime/blocks.py).
    """
    return _run_blocks(model, blocks, lambda cls: cls.forward)


def _run_blocks(
    model: nn.Module,
    blocks: str | Iterable[nn.Module] | None,
    forward_of: Callable[[type[nn.Module]], Any],
) -> nn.Module:
    """Make each chosen block run `forward_of(its class)` on its gathered weights."""
    engine = engine_of(model)
    chosen = _blocks(model, blocks)
    if not chosen:
        raise WrapError(
            f"found no blocks in {type(model).__name__}{_why_none(model, blocks)}; pass "
            "blocks= a class name or the modules (e.g. model.layers)"
        )
    if engine.policy.fp8_matmul:
        warnings.warn(
            "the policy's fp8_matmul runs FP8 GEMMs for per-use gathers only: the linear layers "
            "of blocks on gathered weights (gtp_wrap.compile, gather_per_block, the policy's "
            "gather_per_block) run bf16 GEMMs on the dequantized weights",
            stacklevel=3,
        )
    forwards: dict[type[nn.Module], Any] = {}
    for block in chosen:
        cls = type(block)
        if cls not in forwards:
            forwards[cls] = forward_of(cls)
        engine.run_on_gathered_weights(block, forwards[cls])
    return model


def _why_none(model: nn.Module, blocks: str | Iterable[nn.Module] | None) -> str:
    """Why `_blocks` found nothing, as the refusal's middle."""
    if isinstance(blocks, str):
        return f" matching '{blocks}'"
    if blocks is not None:
        return ""
    if not any(isinstance(m, nn.ModuleList) for m in model.modules()):
        return " (by default: the items of its nn.ModuleLists, and it has none)"
    return (
        " (by default: the items of its nn.ModuleLists that hold a sharded weight, and the "
        "policy left theirs whole: under min_shard_numel, or no rule shards them)"
    )


def _blocks(model: nn.Module, blocks: str | Iterable[nn.Module] | None) -> list[nn.Module]:
    """The modules `blocks` names, outermost first, each once."""
    if blocks is None:
        found = [
            m
            for lst in model.modules()
            if isinstance(lst, nn.ModuleList)
            for m in lst
            if any(type(getattr(p, "gtp_weight", None)) is ShardedWeight for p in m.parameters())
        ]
    elif isinstance(blocks, str):
        found = [m for m in model.modules() if any(c.__name__ == blocks for c in type(m).__mro__)]
    else:
        found = list(blocks)
        inside = {id(m) for m in model.modules()}
        for m in found:
            if id(m) not in inside:
                raise WrapError(f"{type(m).__name__} passed in blocks is not part of the model")
            never_called = type(m).forward is nn.Module.forward  # took no effect, silently
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and never_called:
                raise WrapError(
                    f"a {type(m).__name__} passed in blocks is a container that is never called:"
                    " pass its items (blocks=model.layers, or model.experts.values() for a "
                    "ModuleDict), or the module whose forward runs them (a mixture-of-experts "
                    "layer)"
                )
    # A block inside another chosen block is compiled as part of it.
    outer: list[nn.Module] = []
    covered: set[int] = set()
    for m in found:
        if id(m) in covered:
            continue
        outer.append(m)
        covered.update(id(sub) for sub in m.modules())
    return outer
