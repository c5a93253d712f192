"""The engine's own F.linear against autograd's: an MLP, its inputs per rank, and its float64
reference gradients (test_linear on gloo, test_gpu on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import local_rows
from torch import nn

TOL = 0.03  # relative to the largest entry: bf16 compute against float64


class MLP(nn.Module):
    """Two Linears; `bias2d` adds a (3, 16) bias, broadcast over the batch, to the output."""

    def __init__(self, bias2d: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 16)
        self.bias2d = nn.Parameter(torch.randn(3, 16)) if bias2d else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.bias2d is None:
            return self.b(h)
        return F.linear(h, self.b.weight, self.bias2d.to(h.dtype))


def inputs(world: int) -> torch.Tensor:
    return torch.randn(world, 2, 3, 32, generator=torch.Generator().manual_seed(1))


def reference(world: int, loss_of, bias2d: bool = False) -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's float64 gradients (loss_reduction "mean")."""
    torch.manual_seed(0)
    ref = MLP(bias2d).double()
    for x in inputs(world):
        loss_of(ref, x.double().requires_grad_()).backward()
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)) / world
        for n, p in ref.named_parameters()
    }


def compare(model: nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's gradient error (this rank's rows) relative to the reference's largest
    (a parameter the loss does not reach must get no gradient, or zeros)."""
    out = {}
    for name, p in model.named_parameters():
        want = local_rows(p, ref[name])
        got = p.grad.double().cpu() if p.grad is not None else torch.zeros_like(want)
        out[name] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    return out
