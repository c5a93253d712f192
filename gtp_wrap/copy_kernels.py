"""Fused Triton kernels for the SM work of the copy-engine collectives (CUDA GPUs).

Note: why. The copy-engine collectives move data with the copy engines, but leave two jobs to
SM kernels, which run beside the GEMMs and slow them down. A gather writes this rank's chunk
twice: into the workspace its peers read (with the cast to the gather dtype) and into its own
output (a same-GPU copy). A two-rank reduce-scatter adds the peer's part to this rank's own,
then halves the sum for the mean. In a graphed 1.36B batch-1 step on 2xH200 (54.7 ms), leaving
out the same-GPU copies saved 2.5 ms and leaving out the halving 0.8 ms: experiments that
computed wrong values, run only to size the costs. These kernels read each input once and write
each output once.

`usable()` says where they run: Triton present, CUDA tensors of the dtypes below. Elsewhere the
collectives use PyTorch's ops, which compute the same values: one rounding of the sum, and an
exact halving (they could differ in the last bit only for sums below the smallest normal
number, where halving rounds).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - CPU builds come without Triton; a broken one must not stop us
    triton = None

_ELEMS = 4096  # elements per program
_SUMMED = (torch.float32, torch.bfloat16)  # summed in fp32, as PyTorch's add does


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors (the operands of one kernel below) can take the fused kernel."""
    return triton is not None and all(t.is_cuda and t.is_contiguous() for t in tensors)


if triton is not None:

    @triton.jit
    def _write_twice(src_ptr, a_ptr, b_ptr, numel, elems: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
        keep = i < numel
        value = tl.load(src_ptr + i, mask=keep).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + i, value, mask=keep)
        tl.store(b_ptr + i, value, mask=keep)

    @triton.jit
    def _sum_into(out_ptr, x_ptr, y_ptr, numel, scale, elems: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
        keep = i < numel
        x = tl.load(x_ptr + i, mask=keep).to(tl.float32)
        y = tl.load(y_ptr + i, mask=keep).to(tl.float32)
        tl.store(out_ptr + i, ((x + y) * scale).to(out_ptr.dtype.element_ty), mask=keep)


def write_twice(src: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`src` (1-D, contiguous) cast to `a`'s dtype into both `a` and `b`."""
    if not usable(src, a, b):
        a.copy_(src)
        b.copy_(a)
        return
    numel = src.numel()
    with torch.cuda.device(src.device):
        _write_twice[(triton.cdiv(numel, _ELEMS),)](src, a, b, numel, elems=_ELEMS)


def sum_into(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, average: bool) -> None:
    """`out = x + y`, halved with `average` (1-D, contiguous, one dtype)."""
    if not usable(out, x, y) or out.dtype not in _SUMMED:
        torch.add(x, y, out=out)
        if average:
            out.div_(2)
        return
    numel = out.numel()
    scale = 0.5 if average else 1.0  # exact: the halving commutes with the sum's one rounding
    with torch.cuda.device(out.device):
        _sum_into[(triton.cdiv(numel, _ELEMS),)](out, x, y, numel, scale, elems=_ELEMS)
