"""One fused kernel that decodes gathered NVFP4 slots on CUDA GPUs (Triton).

PyTorch decodes in several kernels (split the nibbles, look up their values, multiply by the
two scales, copy out the unpadded part), each a pass over the weight; this kernel reads each
payload byte and its block's scale once and writes the result once, with the values PyTorch's
path computes (nvfp4.dequantize_into): the E2M1 value times the fp32 product of the block and
shard scales, rounded once into the output dtype. `available()` says where it runs: Triton
present and a CUDA GPU with FP8 support (the block scales are E4M3).
"""

from __future__ import annotations

import torch

from .fp8_triton import _ELEMS, _MAX_GRID_Y, _fp8_capable, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _decode(
        slots_ptr, shard_ptr, out_ptr, row_bytes, shard_stride, numel, start,
        elems: tl.constexpr,
    ):  # fmt: skip
        rank = tl.program_id(0).to(tl.int64)  # offsets of big weights pass 2**31
        col = tl.program_id(1) * elems + tl.arange(0, elems)
        keep = col < numel
        row = slots_ptr + rank * row_bytes
        byte = tl.load(row + start + col // 2, mask=keep, other=0).to(tl.int32)
        code = (byte >> ((col % 2) * 4)) & 0xF
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        # E2M1 magnitudes, exact: e=0: 0, 0.5; e=1: 1, 1.5; e=2: 2, 3; e=3: 4, 6.
        high = tl.where(e == 2, 2.0 + m, 4.0 + 2.0 * m)
        value = tl.where(e == 0, 0.5 * m, tl.where(e == 1, 1.0 + 0.5 * m, high))
        value = tl.where(code >= 8, -value, value)
        block = tl.load(row + 4 + col // 16, mask=keep, other=0)
        block_scale = block.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        shard_scale = tl.load(shard_ptr + rank * shard_stride)
        result = value * (block_scale * shard_scale)
        tl.store(out_ptr + rank * numel + col, result.to(out_ptr.dtype.element_ty), mask=keep)


def available(device: torch.device, numel: int) -> bool:
    """Whether slots of `numel` elements gathered on `device` can be decoded here (decided
    once per weight, at wrap time)."""
    return (
        triton is not None
        and device.type == "cuda"
        and _fp8_capable(device.index)
        and triton.cdiv(numel, _ELEMS) <= _MAX_GRID_Y
    )


def dequantize_into(slots: torch.Tensor, out: torch.Tensor, numel: int, start: int) -> None:
    """`out` (ranks * numel, contiguous) from gathered packed slots `slots` (ranks, packed
    bytes, uint8) whose payload starts at byte `start` of each."""
    ranks = slots.shape[0]
    shard = slots[:, :4].view(torch.float32)
    grid = (ranks, triton.cdiv(numel, _ELEMS))
    with torch.cuda.device(out.device):
        _decode[grid](
            slots, shard, out, slots.stride(0), shard.stride(0), numel, start, elems=_ELEMS
        )
