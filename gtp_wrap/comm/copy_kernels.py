"""Fused Triton kernels for the SM work of the copy-engine collectives (CUDA GPUs).

[Note: fused copy kernels] The copy-engine collectives move data with the copy engines, but leave
two jobs to SM kernels, which run beside the GEMMs and slow them down. A gather writes this rank's
chunk twice: into the workspace its peers read (with the cast to the gather dtype) and into its own
output (a same-GPU copy). A two-rank reduce-scatter adds the peer's part to this rank's own, then
halves the sum for the mean. In a graphed 1.36B batch-1 step on 2xH200 (54.7 ms), leaving out the
same-GPU copies saved 2.5 ms and leaving out the halving 0.8 ms: experiments that computed wrong
values, run only to size the costs. These kernels read each input once and write each output once.

They run on contiguous CUDA tensors of the dtypes below, with Triton installed. Elsewhere, and
for good should a launch fail (a kernel is compiled at its first launch, which may come with
barriers already queued, so it must not raise), the collectives use PyTorch's ops. Those write
the same values: the same cast; for fp32 the same sum and halving; for bf16 too, except at the
ends of its range (PyTorch rounds the sum before halving it, so a sum beyond bf16's largest
finite value becomes inf, and a half below its smallest normal value rounds twice).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - CPU builds come without Triton; a broken one must not stop us
    triton = None

_ELEMS = 4096  # elements per program
_MOVED = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8)
_SUMMED = (torch.float32, torch.bfloat16)  # summed in fp32, as PyTorch's add does
_enabled = triton is not None


def _fused(dtypes: tuple[torch.dtype, ...], *tensors: torch.Tensor) -> bool:
    """Whether these operands of one kernel can take it."""
    return _enabled and all(t.is_cuda and t.is_contiguous() and t.dtype in dtypes for t in tensors)


def _launch(kernel: Any, numel: int, device: torch.device, *args: Any) -> bool:
    """Launch `kernel` over `numel` elements; False (and the kernels off from now on) if it
    fails."""
    global _enabled
    try:
        with torch.cuda.device(device):
            kernel[(triton.cdiv(numel, _ELEMS),)](*args, numel, elems=_ELEMS)
    except Exception as e:  # noqa: BLE001 - any failure: the PyTorch ops do the same work
        warnings.warn(
            f"gtp_wrap: a fused copy-engine kernel failed ({e}); PyTorch's ops take over",
            stacklevel=3,
        )
        _enabled = False
        return False
    return True


if triton is not None:

    @triton.jit
    def _write_twice(src_ptr, a_ptr, b_ptr, numel, elems: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
        keep = i < numel
        value = tl.load(src_ptr + i, mask=keep).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + i, value, mask=keep)
        tl.store(b_ptr + i, value, mask=keep)

    @triton.jit
    def _sum_into(out_ptr, x_ptr, y_ptr, scale, numel, elems: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
        keep = i < numel
        x = tl.load(x_ptr + i, mask=keep).to(tl.float32)
        y = tl.load(y_ptr + i, mask=keep).to(tl.float32)
        tl.store(out_ptr + i, ((x + y) * scale).to(out_ptr.dtype.element_ty), mask=keep)


def write_twice(src: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`src` cast to `a`'s dtype into both `a` and `b` (1-D, one size)."""
    if src.numel() != a.numel() or a.numel() != b.numel():
        raise ValueError(f"write_twice of {src.numel()} into {a.numel()} and {b.numel()} elements")
    if not (
        _fused(_MOVED, src, a, b) and _launch(_write_twice, src.numel(), src.device, src, a, b)
    ):
        a.copy_(src)
        b.copy_(a)


def sum_into(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, average: bool) -> None:
    """`out = x + y`, halved with `average` (1-D, one size, one dtype)."""
    if not (x.numel() == y.numel() == out.numel()):
        raise ValueError(f"sum_into of {x.numel()} and {y.numel()} into {out.numel()} elements")
    scale = 0.5 if average else 1.0  # exact: halving commutes with the sum's one rounding
    if not (
        _fused(_SUMMED, out, x, y)
        and out.dtype == x.dtype == y.dtype
        and _launch(_sum_into, out.numel(), out.device, out, x, y, scale)
    ):
        torch.add(x, y, out=out)
        if average:
            out.div_(2)
