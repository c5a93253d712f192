"""The engine's own F.linear (gtp_wrap/linear.py, bf16 compute with fp32 reductions): every way
a user asks autograd for gradients gives what autograd's linear gives, against an unwrapped
float64 model on the same ranks' data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import local_rows, run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap

BF16 = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
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


def _inputs(world: int) -> torch.Tensor:
    return torch.randn(world, 2, 3, 32, generator=torch.Generator().manual_seed(1))


def _reference(world: int, loss_of, bias2d: bool = False) -> dict[str, torch.Tensor]:
    """The mean over ranks of each rank's float64 gradients (loss_reduction "mean")."""
    torch.manual_seed(0)
    ref = MLP(bias2d).double()
    for x in _inputs(world):
        loss_of(ref, x.double().requires_grad_()).backward()
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)) / world
        for n, p in ref.named_parameters()
    }


def _compare(model: nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's gradient error (this rank's rows) relative to the reference's largest
    (a parameter the loss does not reach must get no gradient, or zeros)."""
    out = {}
    for name, p in model.named_parameters():
        want = local_rows(p, ref[name])
        got = p.grad.double().cpu() if p.grad is not None else torch.zeros_like(want)
        out[name] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    return out


def _penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty: the squared input gradient, itself differentiated (create_graph)."""
    (gx,) = torch.autograd.grad(model(x).float().sum(), x, create_graph=True)
    return gx.float().square().sum()


def _scenarios(rank: int, world: int) -> dict:
    x = _inputs(world)[rank]
    out = {}

    torch.manual_seed(0)
    model = GTPWrap(MLP(), BF16)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(model(xr).float().sum(), xr)
    model(xr).float().sum().backward(inputs=[xr])
    out["input_only"] = {
        "weight_grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "same_gx": torch.equal(gx, xr.grad),
    }

    torch.manual_seed(0)
    model = GTPWrap(MLP(), BF16)
    _penalty(model, x.clone().requires_grad_()).backward()
    out["penalty"] = _compare(model, _reference(world, _penalty))

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().square().sum()

    torch.manual_seed(0)
    model = GTPWrap(MLP(bias2d=True), BF16)
    plain(model, x.clone().requires_grad_()).backward()
    out["bias2d"] = _compare(model, _reference(world, plain, bias2d=True))

    torch.manual_seed(0)
    model = GTPWrap(MLP(), {"min_shard_numel": 0, "param_dtype": "float16",
                            "reduce_dtype": "float32"})  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x.clone().requires_grad_()).float().square().sum()
    loss.backward()
    out["autocast"] = _compare(model, _reference(world, plain))

    # Sharded weights frozen, replicated biases trained: their optimizer steps must not make the
    # engine re-cast the kept shard copy.
    torch.manual_seed(0)
    model = MLP()
    for lin in (model.a, model.b):
        lin.weight.requires_grad_(False)
    model = GTPWrap(model, BF16 | {"compute_copy": True})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    for step in range(3):
        plain(model, x).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            gtp_wrap.reset_stats(model)
    out["frozen_casts"] = gtp_wrap.stats(model)["weight_casts"]
    return out


def test_autograd_features_through_the_engine_linear() -> None:
    for rank, r in enumerate(run_ranks(_scenarios, 2)):
        # autograd.grad(loss, x) and backward(inputs=[x]) reduce no weight gradient.
        assert r["input_only"] == {"weight_grads": [], "same_gx": True}, rank
        # A gradient penalty's second backward reaches the weights through the input gradient.
        assert max(r["penalty"].values()) < TOL, r["penalty"]
        # A 2-D bias (not F.linear's usual 1-D) takes autograd's own path, gradients intact.
        assert max(r["bias2d"].values()) < TOL, r["bias2d"]
        # Autocast to another dtype than param_dtype also takes autograd's path.
        assert max(r["autocast"].values()) < TOL, r["autocast"]
        assert r["frozen_casts"] == 0
