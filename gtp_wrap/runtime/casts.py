"""Compute copies: the kept compute-dtype copy of the shards, the packed FP8 slots, and the
compute-dtype copies of replicated parameters, refreshed at most once per step.

[Note: stale compute copies] A copy is re-made when its parameters' version counter moved,
which every in-place update does, except fused optimizers (AdamW(fused=True) writes its
parameters without moving it). So every optimizer step that holds an engine's parameters also
marks its copies stale, through process-wide optimizer hooks installed at the first wrap; a
replayed CUDA graph, which runs no Python, marks them itself (graphs/capture.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..core.storage import FlatStorage
from ..core.weight import CastWeight
from ..precision.encoding import Packing
from .stats import Stats


def cast_together(tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Each of `tensors` as a new tensor of its dtype in `dtypes` (in its own layout), all
    written by one multi-tensor copy: on a GPU one kernel launch for those of one source and
    target dtype, not one per tensor (on CPU it copies them one by one). One tensor is cast
    by a plain `.to`."""
    if len(tensors) == 1:
        return [tensors[0].to(dtypes[0])]
    cast = [torch.empty_like(t, dtype=dtype) for t, dtype in zip(tensors, dtypes)]
    torch._foreach_copy_(cast, tensors)
    return cast


_live: weakref.WeakSet[Casts] = weakref.WeakSet()
_hook_installed = False


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for casts in list(_live):
        casts.invalidate(stepped)


def install_optimizer_hook() -> None:
    """The process-wide optimizer-step hook that marks stepped parameters' copies stale (once,
    at the first wrap; see [Note: stale compute copies])."""
    global _hook_installed
    if not _hook_installed:
        register_optimizer_step_post_hook(_after_optimizer_step)
        _hook_installed = True


class Casts:
    """The compute copies of one engine."""

    def __init__(
        self,
        storage: FlatStorage,
        packing: Packing | None,
        cast_weights: list[CastWeight],
        sharded: list[nn.Parameter],
        stats: Stats,
    ) -> None:
        self.storage = storage
        self.packing = packing
        self.cast_weights = cast_weights
        # Those whose copy can go stale: an aliased copy is the parameter's own data.
        self._recast = [w for w in cast_weights if not w.aliased]
        self._sharded = {id(p) for p in sharded}
        self.stats = stats
        # Whether anything is copied at all: a kept compute copy, FP8 slots, replicated weights
        # read in the compute dtype or as tensor-parallel blocks.
        self.active = storage.keeps_copy or packing is not None or bool(cast_weights)
        _live.add(self)

    def refresh(self) -> None:
        """Re-make the copies whose parameters changed (as each pass begins)."""
        if not self.active:
            return
        self.stats.weight_casts += self.storage.refresh()
        if self.packing is not None:
            self.stats.weight_casts += self.packing.refresh()
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            # Stale copies (see CastWeight), asked of every re-castable weight as each pass begins
            stale = [w for w in self._recast if w.cast_version != w.param._version]
            if stale:
                # One multi-tensor cast for them all: a kernel, not one per parameter (the
                # norms of a transformer, two a layer).
                torch._foreach_copy_([w.cast for w in stale], [w.param for w in stale])
                for w in stale:
                    w.cast_version = w.param._version

    def invalidate(self, stepped: set[int] | None = None) -> None:
        """Re-make at the next pass the copies of the parameters whose ids are in `stepped`
        (None: all of them): they may have changed without their version counters moving (a
        fused optimizer, a CUDA-graph replay). The shard copies go together."""
        if stepped is None or not self._sharded.isdisjoint(stepped):
            self.storage.invalidate()
            if self.packing is not None:
                self.packing.invalidate()
        for w in self.cast_weights:
            if stepped is None or id(w.param) in stepped:
                w.cast_version = -1
