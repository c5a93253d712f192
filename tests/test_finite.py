"""Non-finite gradients named (GTPPolicy.check_finite, gtp_wrap.nonfinite_grads): every rank
raises, naming the first bad weight, before the optimizer steps; a NaN in one rank's rows of a
shard is seen by every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import cached_ranks, caught

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig

CFG = GPTConfig(vocab=64, d=32, layers=2, heads=4, ffn=48, max_seq=16)


def _loss(model: torch.nn.Module, seed: int, poison: bool = False) -> torch.Tensor:
    idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    return loss * float("nan") if poison else loss


def _cases(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), {"min_shard_numel": 0, "check_finite": True})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, rank).backward()
    opt.step()  # finite: checked, and steps
    opt.zero_grad()
    out = {"finite": gtp_wrap.nonfinite_grads(model)}
    before = gtp_wrap.full_state_dict(model)
    _loss(model, 10 + rank, poison=rank == 1).backward()  # NaN on rank 1 only
    out["raised"] = caught(opt.step)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in
                           gtp_wrap.full_state_dict(model).items())  # fmt: skip
    opt.zero_grad()
    # A NaN in one rank's rows of one shard: every rank names that weight, and only it.
    _loss(model, 20 + rank).backward()
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].mlp.down.weight.grad[0, 0] = float("inf")
    out["one_shard"] = gtp_wrap.nonfinite_grads(model)
    out["checked_once"] = caught(opt.step)  # checked already for this backward: no raise
    return out


def test_non_finite_gradients_are_named_on_every_rank() -> None:
    for r in cached_ranks(_cases, 2):
        assert r["finite"] == []
        assert r["raised"].startswith("NonFiniteError: the gradient of 'embed.weight' (and ")
        assert "after backward 2" in r["raised"] and r["unchanged"]
        assert r["one_shard"] == ["blocks.1.mlp.down.weight"]
        assert r["checked_once"] == "no error"


def test_one_process() -> None:
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), {"check_finite": True, "min_shard_numel": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, 0, poison=True).backward()
    assert gtp_wrap.nonfinite_grads(model)[0] == "embed.weight"
    model.zero_grad()
    _loss(model, 0, poison=True).backward()
    try:
        opt.step()
    except gtp_wrap.NonFiniteError as e:
        assert "'embed.weight'" in str(e) and "after backward 2" in str(e)
    else:
        raise AssertionError("no NonFiniteError")
