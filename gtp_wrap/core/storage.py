"""Flat sharded storage: one flat tensor per dtype holding this rank's slots of every sharded
weight (see geometry.py for where each slot lies), and, for the weights that keep one, a copy
in the compute dtype that their uses (and gathers) read.

[Note: no flat gradient] Gradients are not kept here. Each weight's `.grad` is the slot its
reduce-scatter wrote (or its own copy of it, when reduced in another dtype), allocated in
backward, so `zero_grad(set_to_none=True)` frees them and the forward of the next step (where
activation memory peaks) holds none, as with FSDP2. A preallocated flat gradient would hold 1/N
of the model in fp32 through every forward.

[Note: one version counter] The parameters are views of `params[dtype]` and share its version
counter, so one integer comparison tells whether any shard changed (an optimizer step, a load)
since the compute copy (or the FP8 slots, precision/encoding.py) was made: when kept, it is cast
once per step, not per use.

[Note: a copy of a span] Which weights keep a compute copy is decided per weight
(precision/encoding.py: `Precision.keeps_copy`): with `compute_copy` all but those gathered in
FP8 or NVFP4, else those sharded over a group of one, which gather nothing to cast on the way
(an expert mesh with egtp = 1 beside dense weights over gtp > 1). `lay_out` puts the weights
of groups of one last in each flat tensor, so the copy is of one span, from the first copied
weight to the end, cast by one copy.
"""

from __future__ import annotations

import torch

from ..geometry import ShardGeometry


class FlatStorage:
    """This rank's shards, one flat tensor per dtype, and the compute copy of the span of each
    that holds the weights in `copied` (see [Note: a copy of a span])."""

    def __init__(
        self,
        numels: dict[torch.dtype, int],
        device: torch.device,
        copy_dtype: torch.dtype | None,
        copied: list[ShardGeometry],
    ) -> None:
        self.params = {
            dtype: torch.zeros(numel, dtype=dtype, device=device) for dtype, numel in numels.items()
        }
        # Per flat dtype: where its copied span starts, and the copy of the flat from there.
        self._copies: dict[torch.dtype, tuple[int, torch.Tensor]] = {}
        self._cast_version: dict[torch.dtype, int] = {}
        for dtype, numel in numels.items():
            starts = [geo.offset for geo in copied if geo.dtype == dtype]
            if copy_dtype is not None and copy_dtype != dtype and starts:
                start = min(starts)
                copy = torch.zeros(numel - start, dtype=copy_dtype, device=device)
                self._copies[dtype] = (start, copy)

    def compute_slot(self, geo: ShardGeometry) -> torch.Tensor:
        """The slot that uses and gathers of a weight read: in its copy where the weight's
        span is copied, else the shard's own slot."""
        start, copy = self._copies.get(geo.dtype, (-1, None))
        if copy is None or geo.offset < start:
            return geo.slot(self.params[geo.dtype])
        return copy[geo.offset - start : geo.offset - start + geo.slot_numel]

    @property
    def keeps_copy(self) -> bool:
        """Whether any shards have a copy in the compute dtype."""
        return bool(self._copies)

    @property
    def copy_bytes(self) -> int:
        """Memory held by the compute copies."""
        return sum(copy.numel() * copy.element_size() for _, copy in self._copies.values())

    def refresh(self) -> int:
        """Re-cast the compute copies whose shards changed since the last time; return how
        many flat tensors were re-cast."""
        casts = 0
        for dtype, (start, copy) in self._copies.items():
            flat = self.params[dtype]
            if self._cast_version.get(dtype) == flat._version:
                continue
            with torch.no_grad():
                copy.copy_(flat[start:])
            self._cast_version[dtype] = flat._version
            casts += 1
        return casts

    def invalidate(self) -> None:
        """Make the next `refresh` re-cast everything (the shards changed unseen)."""
        self._cast_version.clear()
