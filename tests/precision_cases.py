"""Precision policies and the training runs that check them (test_precision on CPU, test_gpu on
CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.data import DataConfig, TokenStream
from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.precision import fp8

BF16 = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
FP8 = BF16 | {"gather_dtype": "fp8"}


FP8_GEMM = FP8 | {"fp8_matmul": True}


def train_gpt(
    rank: int, world: int, policy: dict, ffn: int = 172, steps: int = 100, cuda: bool = False
) -> dict:
    """The reference GPT trained on a global batch of 8 split over the ranks; returns this
    rank's mean loss over the last 10 steps and the counters of the last step."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d=64, layers=2, heads=4, ffn=ffn, max_seq=64)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = GTPWrap(GPT(cfg).to(device), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TokenStream(DataConfig(max_bytes=1 << 20), seq=64, vocab=256, seed=0)
    tail = []
    for step in range(steps):
        x, y = (t.to(device) for t in data.batch("train", step, rank, 0, 8 // world))
        gtp_wrap.reset_stats(model)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= steps - 10:
            tail.append(loss.item())
    return {"loss": sum(tail) / len(tail), "stats": gtp_wrap.stats(model)}


def linear_grads(rank: int, world: int, policy: dict, cuda: bool = False) -> dict:
    """One Linear (64 -> 48, bias) trained one step on a loss linear in its output, so the
    weight gradient is exactly the mean over ranks of dy.T @ x with dy and x in bf16."""
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = GTPWrap(nn.Sequential(nn.Linear(64, 48)).to(device), policy)
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(world, 4, 5, 64, generator=g), torch.randn(world, 4, 5, 48, generator=g)
    xr = x[rank].to(device).requires_grad_()
    (model(xr).float() * c[rank].to(device)).sum().backward()
    weight = model[0].weight
    return {"grad": weight.grad.cpu(), "dtype": str(weight.grad.dtype), "dx": xr.grad.cpu(),
            "w": gtp_wrap.full_state_dict(model)["0.weight"], "x": x, "c": c}  # fmt: skip


def check_weight_grads_are_rounded_once(results: list[dict], dx_tol: float = 0.0) -> None:
    """The gathered weight gradient is each rank's dy.T @ x summed in fp32 (then averaged),
    not a bf16 GEMM output cast to fp32; the input gradient is the bf16 GEMM dy @ w, within
    `dx_tol` (another GEMM library sums in another order; with FP8 gathers `w` is the
    dequantized weight)."""
    x, c, w = results[0]["x"], results[0]["c"], results[0]["w"]
    dy, xb = c.bfloat16().double().flatten(1, 2), x.bfloat16().double().flatten(1, 2)
    exact = (dy.transpose(1, 2) @ xb).mean(0)
    rounded = (dy.transpose(1, 2) @ xb).bfloat16().double().mean(0)  # autograd's bf16 GEMM
    got = torch.cat([r["grad"] for r in results]).double()
    scale = exact.abs().max().item()
    assert (got - exact).abs().max().item() < 1e-6 * scale
    assert (rounded - exact).abs().max().item() > 1e-4 * scale  # the check tells them apart
    assert {r["dtype"] for r in results} == {"torch.float32"}
    for rank, r in enumerate(results):
        dx = (c[rank].bfloat16() @ w.bfloat16()).float()
        torch.testing.assert_close(r["dx"], dx, rtol=dx_tol, atol=dx_tol)


def packed_slots(numel: int, block: int, ranks: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP8 slots of `ranks` random shards, back to back as an all-gather leaves them,
    and their dequantization in bf16: FP8 value times fp32 scale, rounded once."""
    torch.manual_seed(0)
    q = fp8.padded(numel, block)
    slots, expected = [], []
    for _ in range(ranks):
        x = torch.zeros(q)
        x[:numel] = torch.randn(numel) * 3
        payload, scale = fp8.quantize(x.view(-1, block))
        slots.append(torch.cat([payload.reshape(-1), scale.view(torch.uint8)]))
        values = payload.view(fp8.fp8_dtype()).float().view(-1, block) * scale[:, None]
        expected.append(values.reshape(-1)[:numel].bfloat16())
    return torch.cat(slots), torch.cat(expected)
