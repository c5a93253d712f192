"""Mixed precision: weights gathered and used in bf16, cast once per step from fp32 masters,
gradients reduced in fp32; training quality close to fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ranks
from models import TinyGPT

import gtp_wrap
from gtp_wrap import GTPWrap, PolicyError, fp8
from gtp_wrap.app.data import DataConfig, TokenStream
from gtp_wrap.app.model import GPT, GPTConfig

BF16 = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
FP8 = BF16 | {"gather_dtype": "fp8"}


def _steps(rank: int, world: int, policy: dict, steps: int = 3) -> dict:
    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, out_dtypes = [], set()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, 48, (8, 8), generator=g)[rows] for _ in range(2))
        out = model(x)
        out_dtypes.add(str(out.dtype))
        loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten())
        loss.backward()
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)  # an eval forward between steps must not cast again
        losses.append(loss.item())
        if step == 0:
            gtp_wrap.reset_stats(model)
    s = gtp_wrap.stats(model)
    return {
        "losses": losses,
        "out_dtypes": sorted(out_dtypes),
        "grad_dtypes": sorted(grad_dtypes),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "stats": {k: v for k, v in s.items() if isinstance(v, int)},
    }


def test_bf16_gathers_cast_once_per_step_and_reduce_in_fp32() -> None:
    bf16 = run_ranks(_steps, 2, BF16)
    fp32 = run_ranks(_steps, 2, {"min_shard_numel": 0})
    for r in bf16:
        assert r["out_dtypes"] == ["torch.bfloat16"]
        assert r["grad_dtypes"] == r["param_dtypes"] == ["torch.float32"]
        # Two steps after the reset: one cast each, none for the backward or the eval forward.
        assert r["stats"]["weight_casts"] == 2
        assert 2 * r["stats"]["bytes_gathered"] == fp32[0]["stats"]["bytes_gathered"]
        assert r["stats"]["bytes_reduced"] == fp32[0]["stats"]["bytes_reduced"]  # fp32 grads
    torch.testing.assert_close(bf16[0]["losses"], fp32[0]["losses"], rtol=2e-2, atol=0)


def _train_gpt(policy: dict, steps: int = 100) -> float:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d=64, layers=2, heads=4, ffn=172, max_seq=64)
    model = GTPWrap(GPT(cfg), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TokenStream(DataConfig(max_bytes=1 << 20), seq=64, vocab=256, seed=0)
    tail = []
    for step in range(steps):
        x, y = data.batch("train", step, 0, 0, 8)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= steps - 10:
            tail.append(loss.item())
    return sum(tail) / len(tail)


def test_bf16_training_ends_within_half_a_percent_of_fp32() -> None:
    fp32 = _train_gpt({"min_shard_numel": 0})
    bf16 = _train_gpt(BF16)
    assert fp32 < 3.5  # it learned something
    assert abs(bf16 - fp32) / fp32 < 0.005, (bf16, fp32)


def test_fp8_round_trip_is_within_the_e4m3_bound() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, fp8.BLOCK, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    x[3, 7] = 1e4  # an outlier only degrades its own block
    payload, scale = fp8.quantize(x)
    packed = torch.cat([payload.reshape(-1), scale.view(torch.uint8)])
    out = torch.empty(x.numel())
    fp8.dequantize_into(packed, 1, x.numel(), out)
    err = (out.view_as(x) - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale[:, None] * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert scale[4] < scale[3] / 100  # the outlier coarsens only its own block


def test_fp8_pads_small_weights_instead_of_rejecting_them() -> None:
    numel = 37  # far below one block
    assert fp8.padded(numel) == fp8.BLOCK and fp8.packed_bytes(numel) == fp8.BLOCK + 4
    x = torch.randn(1, numel)
    blocks = torch.zeros(1, fp8.BLOCK)
    blocks[0, :numel] = x
    payload, scale = fp8.quantize(blocks)
    out = torch.empty(numel)
    fp8.dequantize_into(torch.cat([payload.reshape(-1), scale.view(torch.uint8)]), 1, numel, out)
    torch.testing.assert_close(out, x.view(-1), rtol=2**-4, atol=0)


def test_fp8_gathers_move_about_one_byte_per_element() -> None:
    fp8_run = run_ranks(_steps, 2, FP8)
    bf16_run = run_ranks(_steps, 2, BF16)
    elements = bf16_run[0]["stats"]["bytes_gathered"] / 2  # bf16: 2 bytes per element
    per_element = fp8_run[0]["stats"]["bytes_gathered"] / elements
    assert per_element > 1.0 and per_element < 1.05, per_element  # 1 + 4/128
    assert fp8_run[0]["stats"]["weight_casts"] == 2  # quantized once per step
    torch.testing.assert_close(fp8_run[0]["losses"], bf16_run[0]["losses"], rtol=2e-2, atol=0)


def test_fp8_training_ends_within_two_percent_of_bf16() -> None:
    bf16 = _train_gpt(BF16)
    low = _train_gpt(FP8)
    assert abs(low - bf16) / bf16 < 0.02, (low, bf16)


def test_fp8_without_float8_dtypes_names_the_alternative(monkeypatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(PolicyError, match="param_dtype: bfloat16"):
        GTPWrap(TinyGPT(), FP8)
