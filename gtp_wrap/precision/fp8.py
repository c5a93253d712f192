"""FP8 gathers: each shard quantized once per step to float8_e4m3fn with one scale per block of
128 consecutive elements, gathered as one byte buffer per weight, dequantized for the GEMM.
With `fp8_matmul`, one scale per row instead, and the forward GEMM runs in FP8 (scaled_linear).

[Note: FP8 block scales] Block scales rather than one scale per row. A row of a 2048-wide weight
spans 2048 elements, so one outlier flattens the resolution of all of them; a 128-element block
confines it. The cost is one fp32 scale per 128 bytes: 1.031 bytes per element on the wire instead
of 2 for bf16. Error bound per element, with s = amax(block) / 448 (e4m3's largest normal):
|x - dq(q(x))| <= max(2**-4 * |x|, 2**-10 * s) — half a unit in the last place of a 3-bit
mantissa, or half the smallest subnormal step (2**-9) for values near zero.

[Note: FP8 row scales] The FP8 GEMM (`torch._scaled_mm`) takes one scale per row of each operand,
not block scales, so `fp8_matmul` quantizes each weight row (output channel) with one scale, and
each activation row (token) on the fly. The same bound holds with s = amax(row) / 448: an outlier
coarsens its whole row, which is the price of the faster GEMM.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from ..errors import PolicyError
from . import fp8_triton

if TYPE_CHECKING:
    from ..geometry import ShardGeometry

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


def padded(numel: int, block: int = BLOCK) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // block) * block


def packed_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes of one packed slot: the FP8 payload of the padded blocks, then their fp32 scales."""
    return padded(numel, block) + 4 * (padded(numel, block) // block)


def quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 payload viewed as uint8, fp32 scales) of a (n, BLOCK) tensor."""
    amax = blocks.abs().amax(dim=1).float().clamp_(min=torch.finfo(torch.float32).tiny)
    scale = amax / E4M3_MAX
    payload = (blocks.float() / scale[:, None]).to(fp8_dtype())
    return payload.view(torch.uint8), scale


def dequantize_into(
    packed: torch.Tensor,
    ranks: int,
    numel: int,
    out: torch.Tensor,
    block: int = BLOCK,
    fused: bool = False,
) -> None:
    """Write the dequantized slots of `ranks` gathered packed slots into `out` (ranks * numel,
    contiguous); `fused` runs the Triton kernel where `fp8_triton.available` said it can."""
    q = padded(numel, block)
    rows = packed.view(ranks, packed_bytes(numel, block))
    if fused:
        fp8_triton.dequantize_into(rows, rows[:, q:].view(torch.float32), out, numel, block)
        return
    # FP8 value (exact in out's dtype) times its fp32 scale, computed in fp32 and rounded
    # once into `out`: the values the fused kernel writes.
    payload = rows[:, :q].view(fp8_dtype()).view(ranks, q // block, block).to(out.dtype)
    scales = rows[:, q:].view(torch.float32).view(ranks, q // block, 1)
    if q == numel:
        torch.mul(payload, scales, out=out.view(ranks, q // block, block))
        return
    out.view(ranks, numel).copy_(torch.mul(payload, scales).view(ranks, q)[:, :numel])


def unpack_rows(
    packed: torch.Tensor, ranks: int, rows: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered row-quantized weight as one (ranks * rows, width) FP8 matrix and its
    (ranks * rows,) row scales: the payloads of the ranks' slots made contiguous (one copy of
    one byte per element), as the FP8 GEMM needs."""
    q = rows * width
    slots = packed.view(ranks, packed_bytes(q, width))
    payload = slots[:, :q].reshape(ranks * rows, width).view(fp8_dtype())
    return payload, slots[:, q:].view(torch.float32).reshape(-1)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (weight * scale[:, None]).T in x's dtype, as one FP8 GEMM: the rows of `x` (2-D)
    quantized on the fly with one scale each, `weight` (FP8, row-major) with its row scales."""
    xq, xs = quantize(x)
    xq = xq.view(fp8_dtype())
    if not _rowwise_scaled_mm(x.device.type):
        # The same FP8 operands and scales, multiplied in fp32 (the products of two FP8
        # values are exact there; the sum is in another order than the FP8 GEMM's).
        dq = (xq.float() * xs[:, None]) @ (weight.float() * scale[:, None]).t()
        return dq.to(x.dtype)
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=x.dtype
    )


@functools.cache
def _rowwise_scaled_mm(device_type: str) -> bool:
    """Whether torch._scaled_mm takes one scale per row on this device type.

    [Note: row-wise scaled_mm] CUDA's does from torch 2.11 on, the CPU backend only from 2.13
    (2.11's raises an internal assert). Asking the backend itself, once, keeps fp8_matmul usable for
    CPU development on either version.
    """
    if device_type != "cpu":
        return True
    a = torch.zeros(16, 16).to(fp8_dtype())
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)  # fmt: skip
    except RuntimeError:
        return False
    return True


def fits_gemm(lay: ShardGeometry) -> bool:
    """Whether `lay` is a weight the FP8 GEMM can take: a 2-D weight sharded by output row,
    with both dims multiples of 16 (torch._scaled_mm's requirement)."""
    return (
        lay.dim == 0
        and len(lay.shape) == 2
        and lay.row_numel % 16 == 0
        and (lay.rows_per_rank * lay.world) % 16 == 0
    )


def warn_unfit(names: list[str], layouts: list[ShardGeometry], fits: list[bool]) -> None:
    """Name the 2-D weights that keep bf16 GEMMs under fp8_matmul (dims not multiples of 16)."""
    unfit = [(n, g) for n, g, ok in zip(names, layouts, fits) if not ok and len(g.shape) == 2]
    if unfit:
        listed = ", ".join(f"{name} {tuple(g.shape)}" for name, g in unfit[:4])
        warnings.warn(
            f"fp8_matmul: {len(unfit)} weight(s) keep FP8 gathers with bf16 GEMMs, because "
            f"torch._scaled_mm needs both dims to be multiples of 16: {listed}"
            + (", ..." if len(unfit) > 4 else ""),
            stacklevel=6,  # the GTPWrap call: fp8, encoding, build, engine, api
        )


def warn_local(names: list[str], layouts: list[ShardGeometry]) -> None:
    """Name the 2-D weights that keep bf16 GEMMs under fp8_matmul because they are sharded
    over a group of one: they gather nothing, so there is no FP8 weight to feed the GEMM."""
    local = [(n, g) for n, g in zip(names, layouts) if g.world == 1 and len(g.shape) == 2]
    if local:
        listed = ", ".join(f"{name} {tuple(g.shape)}" for name, g in local[:4])
        warnings.warn(
            f"fp8_matmul: {len(local)} weight(s) keep bf16 GEMMs, because they are sharded over "
            f"a group of one rank, which gathers nothing (no FP8 weight to feed the GEMM): "
            f"{listed}" + (", ..." if len(local) > 4 else ""),
            stacklevel=6,  # the GTPWrap call: fp8, encoding, build, engine, api
        )


def check_gemm_device(device: torch.device) -> None:
    """FP8 GEMMs run on CPUs and on GPUs with FP8 tensor cores (compute capability 8.9+)."""
    if not hasattr(torch, "_scaled_mm"):
        raise PolicyError(
            f"fp8_matmul needs torch._scaled_mm, which torch {torch.__version__} lacks; set "
            "fp8_matmul: false (FP8 gathers, dequantized to bf16 for the GEMMs)"
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise PolicyError(
            f"fp8_matmul needs a GPU with FP8 tensor cores (compute capability 8.9+: Ada, "
            f"Hopper or newer); {name} has none. Set fp8_matmul: false to keep FP8 gathers "
            "with bf16 GEMMs"
        )


def linear_forward(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    lay: ShardGeometry,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    rows = lay.shape[0]
    out = scaled_linear(x.reshape(-1, x.shape[-1]), w, scale)[:, :rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], rows)
