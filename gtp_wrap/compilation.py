"""torch.compile for a wrapped model: its blocks compiled, the engine running between them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .core.parameter import GTPParameter
from .errors import WrapError
from .runtime.engine import engine_of


def compile(  # noqa: A001 - torch.compile's counterpart, named as users look for it
    model: nn.Module, blocks: str | Iterable[nn.Module] | None = None, **options: Any
) -> nn.Module:
    """Compile the blocks of a wrapped model with `torch.compile`, in place; returns `model`.

    Each block's forward runs as compiled code on plain tensors: its sharded weights are
    gathered along the chain just before it runs, and their gradients reduce-scattered in
    backward as in eager mode (see [Note: compiled blocks] in runtime/compiled.py). Code outside
    the blocks (embeddings, the head, the loss) stays eager. This is how torchtitan compiles
    with FSDP2: one block at a time, all blocks of a class sharing one compiled graph.

    Args:
        model: a module wrapped by `GTPWrap`.
        blocks: which submodules to compile: None for the items of the model's `nn.ModuleList`s
            that hold sharded weights (the transformer blocks), a class name (the outermost
            modules of that class or a subclass), or the modules themselves.
        **options: passed to `torch.compile` (`mode`, `fullgraph`, `dynamic`, `backend`, ...).

    `torch.compile(model)` on the whole wrapped model is refused with a `WrapError` naming
    this function: Dynamo cannot trace the sharded parameters' gathers.
    """
    engine = engine_of(model)
    chosen = _blocks(model, blocks)
    if not chosen:
        raise WrapError(
            f"gtp_wrap.compile found no blocks to compile in {type(model).__name__}"
            + (f" matching '{blocks}'" if isinstance(blocks, str) else "")
            + ": pass blocks= a class name or the modules (e.g. model.layers)"
        )
    compiled: dict[type, Any] = {}
    for block in chosen:
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **options)
        engine.compile_block(block, compiled[cls])
    return model


def _blocks(model: nn.Module, blocks: str | Iterable[nn.Module] | None) -> list[nn.Module]:
    """The modules `blocks` names, outermost first, each once."""
    if blocks is None:
        found = [
            m
            for lst in model.modules()
            if isinstance(lst, nn.ModuleList)
            for m in lst
            if any(type(p) is GTPParameter for p in m.parameters())
        ]
    elif isinstance(blocks, str):
        found = [m for m in model.modules() if any(c.__name__ == blocks for c in type(m).__mro__)]
    else:
        found = list(blocks)
        inside = {id(m) for m in model.modules()}
        for m in found:
            if id(m) not in inside:
                raise WrapError(f"{type(m).__name__} passed in blocks is not part of the model")
    # A block inside another chosen block is compiled as part of it.
    outer: list[nn.Module] = []
    covered: set[int] = set()
    for m in found:
        if id(m) in covered:
            continue
        outer.append(m)
        covered.update(id(sub) for sub in m.modules())
    return outer
