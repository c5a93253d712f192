"""nn.MultiheadAttention under the default policy: its packed `in_proj_weight` is sharded (its
`out_proj` is a Linear), and F.multi_head_attention_forward, which reaches the engine through
`__torch_function__`, trains exactly as the unwrapped model on the whole batch."""

from __future__ import annotations

import traceback

import pytest
import torch
from harness import cached_ranks, is_sharded, local_rows
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap

D, HEADS, FFN, SEQ, BATCH = 128, 4, 128, 6, 4  # d=128: 3*d*d and d*d reach min_shard_numel
STEPS = 2


def _build(kind: str, batch_first: bool) -> nn.Module:
    torch.manual_seed(0)
    common = {"nhead": HEADS, "dim_feedforward": FFN, "dropout": 0.0, "batch_first": batch_first}
    if kind == "encoder_layer":
        return nn.TransformerEncoderLayer(D, **common)
    return nn.Transformer(D, num_encoder_layers=1, num_decoder_layers=1, **common)


CASES = {
    f"{kind}-{'batch_first' if bf else 'seq_first'}": (kind, bf)
    for kind in ("encoder_layer", "transformer")
    for bf in (True, False)
}


def _data(step: int, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batch of one step: source, target (decoder input) and the loss weights."""
    g = torch.Generator().manual_seed(step)
    shape = (BATCH, SEQ, D) if batch_first else (SEQ, BATCH, D)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))  # type: ignore[return-value]


def _run(model: nn.Module, kind: str, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return model(src) if kind == "encoder_layer" else model(src, tgt)


def _train(model: nn.Module, kind: str, bf: bool, rank: int, world: int) -> dict:
    """STEPS SGD steps of a loss linear in the output, on this rank's part of the batch
    (world=1: the whole batch, the loss divided by the ranks it stands for)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dim = 0 if bf else 1
    outs, dxs, grads = [], [], []
    for step in range(STEPS):
        src, tgt, c = (t.chunk(world, dim)[rank].requires_grad_() for t in _data(step, bf))
        out = _run(model, kind, src, tgt)
        (out * c).sum().div(2 / world).backward()  # the mean over 2 data ranks
        outs.append(out.detach())
        dxs.append(src.grad)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model.eval()
        src, tgt, _ = (t.chunk(world, dim)[rank] for t in _data(STEPS, bf))
        evals = _run(model, kind, src, tgt)
    return {"outs": outs, "dxs": dxs, "grads": grads, "eval": evals}


def _all_cases(rank: int, world: int) -> dict:
    results = {}
    for name, (kind, bf) in CASES.items():
        try:
            model = GTPWrap(_build(kind, bf))  # the default policy
            sharded = sorted(n for n, p in model.named_parameters() if is_sharded(p))
            got = _train(model, kind, bf, rank, world)
            ref_model = _build(kind, bf)
            ref = _train(ref_model, kind, bf, 0, 1)
            dim = 0 if bf else 1
            params = dict(ref_model.named_parameters())
            results[name] = {
                "sharded": sharded,
                "describe": [
                    (r.fqn, r.shard_dim, r.rule, r.bytes_per_rank)
                    for r in gtp_wrap.describe(model).rows
                    if r.fqn.endswith("in_proj_weight")
                ],
                "outs": (got["outs"], [o.chunk(world, dim)[rank] for o in ref["outs"]]),
                # The reference's loss is the mean over ranks, each rank's its own part.
                "dxs": (got["dxs"], [d.chunk(world, dim)[rank] * world for d in ref["dxs"]]),
                "grads": (
                    got["grads"],
                    [
                        {n: local_rows(dict(model.named_parameters())[n], g) for n, g in gs.items()}
                        for gs in ref["grads"]
                    ],
                ),
                "eval": (got["eval"], ref["eval"].chunk(world, dim)[rank]),
                "params": (
                    gtp_wrap.full_state_dict(model),
                    {n: p.detach() for n, p in params.items()},
                ),
            }
        except Exception:  # noqa: BLE001 - reported by the case's test
            results[name] = {"error": traceback.format_exc()}
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_multihead_attention_is_sharded_and_exact(name: str) -> None:
    for rank, per_case in enumerate(cached_ranks(_all_cases, 2)):
        r = per_case[name]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        in_proj = [n for n in r["sharded"] if n.endswith("in_proj_weight")]
        assert in_proj and len(in_proj) == len(r["describe"]), r["sharded"]
        assert any(n.endswith("out_proj.weight") for n in r["sharded"]), r["sharded"]
        for fqn, dim, rule, nbytes in r["describe"]:
            # (3*D, D) split in two row blocks of 1.5*D rows, fp32.
            assert (dim, rule, nbytes) == (0, "MultiheadAttention", 3 * D // 2 * D * 4), fqn
        # Same math as the unwrapped model on the whole batch, up to fp32 summation order
        # (the gradient mean over ranks is reduced in another order than autograd sums it).
        for key in ("outs", "dxs", "grads", "eval", "params"):
            got, expected = r[key]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{key}")
