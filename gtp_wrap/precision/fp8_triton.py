"""One fused kernel that dequantizes gathered FP8 slots on CUDA GPUs (Triton).

[Note: fused dequantization] PyTorch dequantizes in two elementwise kernels (FP8 -> bf16 of a
strided view, then the scale multiply), which measured 0.10-0.48 ms per weight of the 1.36B model on
an H200: more than the bf16 all-gather the FP8 gather replaces (0.07-0.33 ms). This kernel reads
each payload byte and its block's scale once and writes the result once. `available()` says where it
runs: Triton present, a CUDA GPU with FP8 support (compute capability 8.9+), a slot small enough for
one launch grid. Elsewhere fp8.dequantize_into uses PyTorch's kernels, which compute the same values
(one rounding of FP8 value x fp32 scale).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - CPU builds come without Triton; a broken one must not stop us
    triton = None

_ELEMS = 4096  # output elements per program
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid axis, which counts ELEMS-wide chunks


def available(device: torch.device, numel: int) -> bool:
    """Whether slots of `numel` elements gathered on `device` can be dequantized here (decided
    once per weight, at wrap time)."""
    return (
        triton is not None
        and device.type == "cuda"
        and _fp8_capable(device.index)
        and triton.cdiv(numel, _ELEMS) <= _MAX_GRID_Y
    )


@functools.cache
def _fp8_capable(index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 9)


if triton is not None:

    @triton.jit
    def _dequantize(
        packed_ptr, scales_ptr, out_ptr, row_bytes, scale_stride, numel, block,
        elems: tl.constexpr,
    ):  # fmt: skip
        rank = tl.program_id(0).to(tl.int64)  # offsets of big weights pass 2**31
        col = tl.program_id(1) * elems + tl.arange(0, elems)
        keep = col < numel
        payload = tl.load(packed_ptr + rank * row_bytes + col, mask=keep, other=0)
        scale = tl.load(scales_ptr + rank * scale_stride + col // block, mask=keep, other=0.0)
        value = payload.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        tl.store(out_ptr + rank * numel + col, value.to(out_ptr.dtype.element_ty), mask=keep)


def dequantize_into(
    rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, numel: int, block: int
) -> None:
    """`out` (ranks * numel, contiguous) from gathered packed slots: `rows` (ranks, packed
    bytes) uint8 with the payload first, `scales` (ranks, blocks) fp32, a view into the same
    rows."""
    ranks = rows.shape[0]
    grid = (ranks, triton.cdiv(numel, _ELEMS))
    with torch.cuda.device(out.device):
        _dequantize[grid](
            rows, scales, out, rows.stride(0), scales.stride(0), numel, block, elems=_ELEMS
        )
