"""Newton–Schulz orthogonalization, batched: Muon's update direction for matrices of one shape.

The iteration is torch.optim.Muon's, step for step (bf16, the quintic with coefficients (a, b, c),
the wide orientation, the Frobenius normalization clamped at eps), written over a batch of
matrices: for each matrix it computes what torch's computes for it alone, bitwise on CPU (the
batched GEMMs round as the single ones do), so owners can orthogonalize every matrix of one
shape in one launch per iteration.
"""

from __future__ import annotations

import math

import torch


def orthogonalize(
    batch: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalized update of each matrix of `batch` ([B, M, N]), in bf16."""
    a, b, c = coefficients
    x = batch.bfloat16()
    tall = batch.size(-2) > batch.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of `shape` (an expert stack's: for each
    of its [M, N] matrices): "original" scales by sqrt(max(1, M / N)), "match_rms_adamw" by
    0.2 sqrt(max(M, N))."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def cost(shape: torch.Size) -> int:
    """Newton–Schulz work of a matrix (or a stack) of `shape`: max(M, N) min(M, N)^2 per
    matrix, which owners are balanced by."""
    rows, cols = shape[-2:]
    return math.prod(shape[:-2]) * max(rows, cols) * min(rows, cols) ** 2
