"""Flat sharded storage: where each rank's row blocks of the sharded weights live.

A weight of logical shape S sharded along dim d is viewed with d moved to the front as
(rows, *rest). It is split into blocks of `rows_per_rank = ceil(rows / N)` rows (torch.chunk's
split, so the local block is exactly DTensor's Shard(d) local tensor). Each rank stores its block
in a slot of `rows_per_rank * row_numel` elements of one flat tensor per dtype; the rows past the
logical end (the last ranks' padding) are zeros that no parameter view covers. An all-gather of
the slots therefore yields the padded full weight contiguously, and the logical weight is its
first `rows` rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import fp8

_ALIGN_BYTES = 128


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where one sharded weight lives: its logical shape and its slot in the flat storage."""

    index: int
    fqn: str
    shape: torch.Size
    dim: int
    rank: int
    world: int
    dtype: torch.dtype
    offset: int

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[self.dim]

    @functools.cached_property
    def rest(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.shape) if i != self.dim)

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.rest)

    @functools.cached_property
    def rows_per_rank(self) -> int:
        return -(-self.rows // self.world)

    @functools.cached_property
    def local_rows(self) -> int:
        start = self.rank * self.rows_per_rank
        return max(0, min(self.rows_per_rank, self.rows - start))

    @functools.cached_property
    def slot_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    @functools.cached_property
    def gathered_numel(self) -> int:
        return self.world * self.slot_numel

    @functools.cached_property
    def padded_rows(self) -> int:
        return self.world * self.rows_per_rank

    def slot(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's whole slot (its rows plus any padding rows): what a collective moves."""
        return flat[self.offset : self.offset + self.slot_numel]

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows in the weight's logical layout: the registered parameter."""
        return self.local_of_slot(self.slot(flat))

    def local_of_slot(self, slot: torch.Tensor) -> torch.Tensor:
        """The rows of a slot-sized tensor that this rank owns, in the logical layout."""
        block = slot[: self.local_rows * self.row_numel].view(self.local_rows, *self.rest)
        return block.movedim(0, self.dim)

    @functools.cached_property
    def full_stride(self) -> tuple[int, ...]:
        """Strides of the logical weight inside a gathered buffer (rows first in memory)."""
        return torch.empty((self.rows, *self.rest), device="meta").movedim(0, self.dim).stride()

    def full_view(self, gathered: torch.Tensor) -> torch.Tensor:
        """The logical full weight inside a gathered (padded) buffer: one view op."""
        return gathered.as_strided(self.shape, self.full_stride, 0)

    def local_rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a logical full tensor, in the logical layout (for loading)."""
        start = self.rank * self.rows_per_rank
        return full.movedim(self.dim, 0)[start : start + self.local_rows].movedim(0, self.dim)

    def padded_rows_view(self, full: torch.Tensor) -> torch.Tensor:
        """A contiguous (padded_rows * row_numel,) copy or view of a logical full tensor."""
        moved = full.movedim(self.dim, 0)
        pad = self.padded_rows - self.rows
        if pad:
            moved = torch.cat([moved, moved.new_zeros((pad, *self.rest))])
        return moved.reshape(-1)


class FlatStorage:
    """One flat tensor per dtype holding this rank's slots of every sharded weight and, with a
    compute dtype, a same-layout copy in that dtype which gathers read.

    Note: gradients are not kept here. Each weight's `.grad` is the slot its reduce-scatter
    wrote (or its own copy of it, when reduced in another dtype), allocated in backward, so
    `zero_grad(set_to_none=True)` frees them and the forward of the next step (where activation
    memory peaks) holds none, as with FSDP2.
    A preallocated flat gradient would hold 1/N of the model in fp32 through every forward.

    Note: the parameters are views of `params[dtype]` and share its version counter, so one
    integer comparison tells whether any shard changed (an optimizer step, a load) since the
    compute copy (or the FP8 slots) was made: when kept, it is cast once per step, not per use.
    """

    def __init__(
        self, layouts: list[ShardLayout], device: torch.device, compute_dtype: torch.dtype | None
    ) -> None:
        self.params: dict[torch.dtype, torch.Tensor] = {}
        self.compute: dict[torch.dtype, torch.Tensor] = {}
        self._cast_version: dict[torch.dtype, int] = {}
        # FP8 gathers (enable_fp8): packed slots, and per dtype the views a quantization fills:
        # block-scaled slots from one quantization of the whole flat tensor, row-scaled slots
        # each from its own rows.
        self.packed_slots: list[torch.Tensor] = []
        self._fp8_targets: dict[torch.dtype, tuple[list, list, list]] = {}
        self._fp8_rows: dict[torch.dtype, list[tuple[torch.Tensor, ...]]] = {}
        self.fp8_blocks: list[int] = []  # elements per scale, per layout
        for dtype in dict.fromkeys(lay.dtype for lay in layouts):
            same = [lay for lay in layouts if lay.dtype == dtype]
            numel = max(lay.offset + fp8.padded(lay.slot_numel) for lay in same)
            self.params[dtype] = torch.zeros(numel, dtype=dtype, device=device)
            cdtype = compute_dtype or dtype
            self.compute[dtype] = (
                self.params[dtype]
                if cdtype == dtype
                else torch.zeros(numel, dtype=cdtype, device=device)
            )

    def enable_fp8(self, layouts: list[ShardLayout], by_row: list[bool]) -> None:
        """Add packed FP8 slots (payload, then scales) that gathers send instead; the elements
        of layout i share a scale per fp8.BLOCK, or per row with `by_row[i]`."""
        self.fp8_blocks = [lay.row_numel if row else fp8.BLOCK for lay, row in zip(layouts, by_row)]
        blocks = self.fp8_blocks
        packed: dict[torch.dtype, torch.Tensor] = {}
        ends: dict[torch.dtype, int] = {}
        spans = []
        for lay, block in zip(layouts, blocks):
            start = -(-ends.get(lay.dtype, 0) // 16) * 16  # the scales stay 4-byte aligned
            ends[lay.dtype] = start + fp8.packed_bytes(lay.slot_numel, block)
            spans.append(start)
        for dtype, n in ends.items():
            packed[dtype] = torch.zeros(n, dtype=torch.uint8, device=self.params[dtype].device)
            self._fp8_targets[dtype] = ([], [], [])
            self._fp8_rows[dtype] = []
        for lay, block, row_scaled, start in zip(layouts, blocks, by_row, spans):
            q = fp8.padded(lay.slot_numel, block)
            slot = packed[lay.dtype][start : start + fp8.packed_bytes(lay.slot_numel, block)]
            self.packed_slots.append(slot)
            payload, scale = slot[:q], slot[q:].view(torch.float32)
            if row_scaled:
                rows = self.params[lay.dtype][lay.offset : lay.offset + q].view(-1, block)
                self._fp8_rows[lay.dtype].append((rows, payload, scale))
                continue
            first, nblocks = lay.offset // fp8.BLOCK, q // fp8.BLOCK
            payloads, scales, block_ranges = self._fp8_targets[lay.dtype]
            payloads.append(payload)
            scales.append(scale)
            block_ranges.append((first, first + nblocks))

    def refresh_compute(self) -> int:
        """Re-cast (or re-quantize) the compute copies whose shards changed since the last time;
        return how many flat tensors were refreshed."""
        casts = 0
        for dtype, flat in self.params.items():
            compute = self.compute[dtype]
            fp8_targets = self._fp8_targets.get(dtype)
            if self._cast_version.get(dtype) == flat._version:
                continue
            if compute is flat and fp8_targets is None:
                continue
            with torch.no_grad():
                if compute is not flat:
                    compute.copy_(flat)
                if fp8_targets is not None and fp8_targets[0]:
                    payload, scale = fp8.quantize(flat.view(-1, fp8.BLOCK))
                    payloads, scales, ranges = fp8_targets
                    torch._foreach_copy_(
                        payloads + scales,
                        [payload[a:b].reshape(-1) for a, b in ranges]
                        + [scale[a:b] for a, b in ranges],
                    )
                for rows, row_payload, row_scale in self._fp8_rows.get(dtype, ()):
                    q, s = fp8.quantize(rows)
                    row_payload.copy_(q.reshape(-1))
                    row_scale.copy_(s)
            self._cast_version[dtype] = flat._version
            casts += 1
        return casts

    def invalidate_compute(self) -> None:
        """Make the next `refresh_compute` re-cast everything (the shards changed unseen)."""
        self._cast_version.clear()

    @staticmethod
    def assign_offsets(
        shapes: list[tuple[str, torch.Size, int, torch.dtype]],
        rank: int,
        world: int,
        align: bool,
        block: int = 1,
    ) -> list[ShardLayout]:
        """Lay the slots out back to back per dtype, each start aligned when asked; with a
        `block` (FP8 quantization) every slot starts and ends on a whole block."""
        ends: dict[torch.dtype, int] = {}
        layouts = []
        for index, (fqn, shape, dim, dtype) in enumerate(shapes):
            offset = ends.get(dtype, 0)
            if align:
                step = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
                offset = -(-offset // step) * step
            offset = -(-offset // block) * block
            lay = ShardLayout(index, fqn, shape, dim, rank, world, dtype, offset)
            ends[dtype] = offset + -(-lay.slot_numel // block) * block
            layouts.append(lay)
        return layouts
