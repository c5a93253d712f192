"""Flat sharded storage: one flat tensor per dtype holding this rank's slots of every sharded
weight (see geometry.py for where each slot lies), and, with a kept compute copy, a
same-layout copy in the compute dtype that gathers read.

[Note: no flat gradient] Gradients are not kept here. Each weight's `.grad` is the slot its
reduce-scatter wrote (or its own copy of it, when reduced in another dtype), allocated in
backward, so `zero_grad(set_to_none=True)` frees them and the forward of the next step (where
activation memory peaks) holds none, as with FSDP2. A preallocated flat gradient would hold 1/N
of the model in fp32 through every forward.

[Note: one version counter] The parameters are views of `params[dtype]` and share its version
counter, so one integer comparison tells whether any shard changed (an optimizer step, a load)
since the compute copy (or the FP8 slots, precision/encoding.py) was made: when kept, it is cast
once per step, not per use.
"""

from __future__ import annotations

import torch


class FlatStorage:
    """This rank's shards, one flat tensor per dtype; `compute[dtype]` is what uses and gathers
    read: the shards themselves, or their kept copy in the compute dtype."""

    def __init__(
        self, numels: dict[torch.dtype, int], device: torch.device, copy_dtype: torch.dtype | None
    ) -> None:
        self.params: dict[torch.dtype, torch.Tensor] = {}
        self.compute: dict[torch.dtype, torch.Tensor] = {}
        self._cast_version: dict[torch.dtype, int] = {}
        for dtype, numel in numels.items():
            self.params[dtype] = torch.zeros(numel, dtype=dtype, device=device)
            cdtype = copy_dtype or dtype
            self.compute[dtype] = (
                self.params[dtype]
                if cdtype == dtype
                else torch.zeros(numel, dtype=cdtype, device=device)
            )

    @property
    def keeps_copy(self) -> bool:
        """Whether the shards have a copy in the compute dtype (`compute` is not `params`)."""
        return any(self.compute[d] is not flat for d, flat in self.params.items())

    def refresh(self) -> int:
        """Re-cast the compute copies whose shards changed since the last time; return how
        many flat tensors were re-cast."""
        casts = 0
        for dtype, flat in self.params.items():
            compute = self.compute[dtype]
            if compute is flat or self._cast_version.get(dtype) == flat._version:
                continue
            with torch.no_grad():
                compute.copy_(flat)
            self._cast_version[dtype] = flat._version
            casts += 1
        return casts

    def invalidate(self) -> None:
        """Make the next `refresh` re-cast everything (the shards changed unseen)."""
        self._cast_version.clear()
