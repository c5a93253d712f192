"""NVFP4 gathers: each shard quantized once per step to 4-bit E2M1 values, two per byte, with
one FP8 E4M3 scale per block of 16 consecutive elements and one fp32 scale per shard, gathered
as one byte buffer per weight and decoded into the compute dtype for each use.

[Note: NVFP4 layout] A packed slot is `[fp32 shard scale][E4M3 block scales, padded to 4 bytes]
[payload: element 2i in the low nibble of byte i, element 2i+1 in the high one]`, 0.5625 bytes
per element and 4 + up to 3 more per shard, against 2 for bf16 and 1.031 for FP8 gathers. The
value of an element is `e2m1 * block_scale * shard_scale`. The shard scale is `amax(shard) /
(6 * 448)`, so that the largest block's scale is E4M3's largest normal and every block scale
lands in E4M3's range; it is per shard rather than per weight so that each rank quantizes its
rows alone, with no collective (a per-weight amax would need one), and it can only be finer.
E2M1 holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; a scaled element is rounded to the nearest, ties to
the even code (round half to even, as a hardware cast does). So each element is off by at most
half a step of that grid times its block's scale: 0.25 * scale below 2, 0.5 below 4, 1 above.
That holds for blocks whose scale is an E4M3 normal: an amax down to about 3.5e-5 of the
shard's (2**-6 / 448). Below that the block scales are E4M3 subnormals, coarser, and a block
under about 4e-6 of the shard's amax decodes to zeros: NVFP4 trades that range for its size.

Hopper has no FP4 GEMM, so gathered weights are always decoded (`dequantize_into`): one fused
Triton kernel on CUDA (nvfp4_triton), PyTorch's kernels elsewhere, with the same values (the
E2M1 value times the fp32 product of the two scales, rounded once into the output dtype).
"""

from __future__ import annotations

import functools

import torch

from . import nvfp4_triton
from .fp8 import E4M3_MAX, fp8_dtype

BLOCK = 16
E2M1_MAX = 6.0
# The E2M1 value of each 4-bit code: bit 3 the sign, bits 0-2 the magnitude's index.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_VALUES = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)
# The midpoints between neighbouring magnitudes: where rounding to nearest changes code.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_MAGNITUDES, _MAGNITUDES[1:]))


@functools.cache
def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """`values` as an fp32 tensor on `device`, made once: a copy from the host inside a
    step would be a host sync, and one a CUDA graph cannot capture."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def padded(numel: int) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // BLOCK) * BLOCK


def _scale_bytes(numel: int) -> int:
    """Bytes of a slot's block scales, padded so that its payload starts 4-byte aligned."""
    return -(-(padded(numel) // BLOCK) // 4) * 4


def packed_bytes(numel: int) -> int:
    """Bytes of one packed slot of `numel` elements (a multiple of 4: the gathered slots of
    all ranks stay 4-byte aligned for their fp32 shard scales)."""
    return 4 + _scale_bytes(numel) + padded(numel) // 2


def quantize_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize the 1-D tensor `x` into the packed slot `out` (uint8, packed_bytes(len(x)))."""
    numel = x.numel()
    q = padded(numel)
    values = torch.zeros(q, dtype=torch.float32, device=x.device)
    values[:numel] = x
    blocks = values.view(-1, BLOCK)
    tiny = torch.finfo(torch.float32).tiny
    shard_scale = (blocks.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=tiny)
    block_amax = blocks.abs().amax(dim=1)
    block_scale = (block_amax / E2M1_MAX / shard_scale).clamp(max=E4M3_MAX).to(fp8_dtype())
    scale = block_scale.float() * shard_scale
    scaled = blocks / torch.where(scale > 0, scale, 1.0)[:, None]
    codes = _round_to_e2m1(scaled.abs().clamp(max=E2M1_MAX))
    codes |= (scaled < 0).to(torch.uint8).flatten() << 3
    pairs = codes.view(-1, 2)
    n_scales = q // BLOCK
    out[:4].copy_(shard_scale.reshape(1).view(torch.uint8))
    out[4 : 4 + n_scales].copy_(block_scale.view(torch.uint8))
    start = 4 + _scale_bytes(numel)
    out[start:].copy_(pairs[:, 0] | (pairs[:, 1] << 4))


def _round_to_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """The magnitude code (0-7, uint8) nearest each value in [0, 6], ties to the even code."""
    midpoints = _constant(_MIDPOINTS, magnitude.device)
    down = torch.bucketize(magnitude, midpoints, right=False)  # a tie takes the lower code
    up = torch.bucketize(magnitude, midpoints, right=True)  # and here the upper one
    tie_to_even = torch.where(down % 2 == 0, down, up)
    return tie_to_even.to(torch.uint8).flatten()


def dequantize_into(
    packed: torch.Tensor, ranks: int, numel: int, out: torch.Tensor, fused: bool = False
) -> None:
    """Write the decoded slots of `ranks` gathered packed slots into `out` (ranks * numel,
    contiguous); `fused` runs the Triton kernel where `nvfp4_triton.available` said it can."""
    q = padded(numel)
    slots = packed.view(ranks, packed_bytes(numel))
    start = 4 + _scale_bytes(numel)
    if fused:
        nvfp4_triton.dequantize_into(slots, out, numel, start)
        return
    shard_scale = slots[:, :4].view(torch.float32)  # (ranks, 1)
    block_scale = slots[:, 4 : 4 + q // BLOCK].view(fp8_dtype()).float()
    scale = (block_scale * shard_scale).view(ranks, q // BLOCK, 1)
    payload = slots[:, start:]
    codes = torch.stack((payload & 0xF, payload >> 4), dim=-1).view(ranks, q // BLOCK, BLOCK)
    table = _constant(_VALUES, packed.device)
    values = (table[codes.long()] * scale).view(ranks, q)
    out.view(ranks, numel).copy_(values[:, :numel])
