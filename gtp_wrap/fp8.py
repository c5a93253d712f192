"""FP8 gathers: each shard quantized once per step to float8_e4m3fn with one scale per block of
128 consecutive elements, gathered as one byte buffer per weight, dequantized for the GEMM.

Note: block scales rather than one scale per row. A row of a 2048-wide weight spans 2048
elements, so one outlier flattens the resolution of all of them; a 128-element block confines
it. The cost is one fp32 scale per 128 bytes: 1.031 bytes per element on the wire instead of
2 for bf16. Error bound per element, with s = amax(block) / 448 (e4m3's largest normal):
|x - dq(q(x))| <= max(2**-4 * |x|, 2**-10 * s) — half a unit in the last place of a 3-bit
mantissa, or half the smallest subnormal step (2**-9) for values near zero.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def fp8_dtype() -> torch.dtype:
    """float8_e4m3fn, or an error naming the alternative when this torch lacks it."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise TypeError(
            f"torch {torch.__version__} has no float8_e4m3fn dtype, so FP8 gathers are "
            "unavailable; use gather_dtype: null with param_dtype: bfloat16 (2-byte gathers)"
        )
    return dtype


def padded(numel: int) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // BLOCK) * BLOCK


def packed_bytes(numel: int) -> int:
    """Bytes of one packed slot: the FP8 payload of the padded blocks, then their fp32 scales."""
    return padded(numel) + 4 * (padded(numel) // BLOCK)


def quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 payload viewed as uint8, fp32 scales) of a (n, BLOCK) tensor."""
    amax = blocks.abs().amax(dim=1).float().clamp_(min=torch.finfo(torch.float32).tiny)
    scale = amax / E4M3_MAX
    payload = (blocks.float() / scale[:, None]).to(fp8_dtype())
    return payload.view(torch.uint8), scale


def dequantize_into(packed: torch.Tensor, ranks: int, numel: int, out: torch.Tensor) -> None:
    """Write the dequantized slots of `ranks` gathered packed slots into `out` (ranks * numel)."""
    q = padded(numel)
    rows = packed.view(ranks, packed_bytes(numel))
    payload = rows[:, :q].view(fp8_dtype()).view(ranks, q // BLOCK, BLOCK)
    scales = rows[:, q:].view(torch.float32).view(ranks, q // BLOCK, 1)
    values = payload.to(out.dtype) * scales.to(out.dtype)
    if q == numel:
        out.view(ranks, q // BLOCK, BLOCK).copy_(values)
    else:
        out.view(ranks, numel).copy_(values.view(ranks, q)[:, :numel])
