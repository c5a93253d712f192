"""Where a sharded weight's rows live: the row-block arithmetic, once for the whole package.

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

_ALIGN_BYTES = 128


_TAIL = 128  # every flat tensor ends on a whole block of this many elements (FP8's block)


def rows_per_block(rows: int, parts: int) -> int:
    """The height of each block when `rows` are split into `parts` as torch.chunk (and
    DTensor's Shard) split them: ceil(rows / parts)."""
    return -(-rows // parts)


def row_block(rows: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of block `index` of that split; the last blocks shorter or empty."""
    per = rows_per_block(rows, parts)
    start = min(rows, index * per)
    return start, min(rows, start + per)


@dataclasses.dataclass(frozen=True)
class ShardGeometry:
    """One sharded weight's logical shape and its slot in the flat storage of its dtype."""

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
        return rows_per_block(self.rows, self.world)

    @functools.cached_property
    def local_start(self) -> int:
        return row_block(self.rows, self.world, self.rank)[0]

    @functools.cached_property
    def local_rows(self) -> int:
        start, stop = row_block(self.rows, self.world, self.rank)
        return stop - start

    @functools.cached_property
    def slot_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    @functools.cached_property
    def gathered_numel(self) -> int:
        return self.world * self.slot_numel

    @functools.cached_property
    def padded_rows(self) -> int:
        return self.world * self.rows_per_rank

    @functools.cached_property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's rows in the logical layout (its registered parameter)."""
        return torch.Size(self.local_rows if i == self.dim else s for i, s in enumerate(self.shape))

    @functools.cached_property
    def even_rows(self) -> bool:
        """Whether the weight is split along dim 0 into equal blocks (no padding rows): then
        the full tensor and a rank's block are their own collective layouts, with no view."""
        return self.dim == 0 and self.padded_rows == self.rows

    def slot(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's whole slot (its rows plus any padding rows): what a collective moves."""
        return flat[self.offset : self.offset + self.slot_numel]

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows in the weight's logical layout: the registered parameter."""
        return self.local_of_slot(self.slot(flat))

    def local_of_slot(self, slot: torch.Tensor) -> torch.Tensor:
        """The rows of a slot-sized tensor that this rank owns, in the logical layout."""
        numel = self.local_rows * self.row_numel
        rows = slot if numel == slot.numel() else slot[:numel]  # a slice only past padding
        block = rows.view(self.local_rows, *self.rest)
        return block if self.dim == 0 else block.movedim(0, self.dim)

    @functools.cached_property
    def full_stride(self) -> tuple[int, ...]:
        """Strides of the logical weight inside a gathered buffer (rows first in memory)."""
        return torch.empty((self.rows, *self.rest), device="meta").movedim(0, self.dim).stride()

    def full_view(self, gathered: torch.Tensor) -> torch.Tensor:
        """The logical full weight inside a gathered (padded) buffer: one view op."""
        return gathered.as_strided(self.shape, self.full_stride, 0)

    def local_rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a logical full tensor, in the logical layout (for loading)."""
        moved = full.movedim(self.dim, 0)
        return moved[self.local_start : self.local_start + self.local_rows].movedim(0, self.dim)

    def padded_rows_view(self, full: torch.Tensor) -> torch.Tensor:
        """A contiguous (padded_rows * row_numel,) copy or view of a logical full tensor."""
        moved = full if self.dim == 0 else full.movedim(self.dim, 0)
        pad = self.padded_rows - self.rows
        if pad:
            moved = torch.cat([moved, moved.new_zeros((pad, *self.rest))])
        return moved.reshape(-1)


def lay_out(
    specs: list[tuple[torch.Size, int, torch.dtype, int, int]],
    align: bool,
    block: int = 1,
) -> tuple[list[ShardGeometry], dict[torch.dtype, int]]:
    """Lay the slots of weights (shape, shard dim, dtype, this rank's place in the group they
    are sharded over and its size) out back to back per dtype, each start aligned when asked;
    with a `block` (FP8 quantization) every slot starts and ends on a whole block. Returns the
    geometries, in the order of `specs`, and each dtype's flat storage size (the last slot's
    end, on a whole block of `_TAIL` elements).

    Weights sharded over groups of more than one rank come first in each flat tensor, then
    those of groups of one: what only the gathered weights need (FP8 slots quantized from the
    flat) and what only the others need (a compute copy: see core/storage.py) each cover one
    span of it."""
    ends: dict[torch.dtype, int] = {}
    sizes: dict[torch.dtype, int] = {}
    placed: dict[int, ShardGeometry] = {}
    order = sorted(range(len(specs)), key=lambda i: specs[i][4] == 1)
    for i in order:
        shape, dim, dtype, rank, world = specs[i]
        offset = ends.get(dtype, 0)
        if align:
            step = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            offset = -(-offset // step) * step
        offset = -(-offset // block) * block
        geometry = ShardGeometry(shape, dim, rank, world, dtype, offset)
        ends[dtype] = offset + -(-geometry.slot_numel // block) * block
        sizes[dtype] = offset + -(-geometry.slot_numel // _TAIL) * _TAIL
        placed[i] = geometry
    return [placed[i] for i in range(len(specs))], sizes
