"""Parity: GTP training equals unsharded training on the concatenation of all ranks' batches.

Every case trains a few AdamW steps on a global batch of 8 samples split evenly over the data
ranks, and compares parameters, losses, eval outputs and grad norms with a single-process
reference trained on the whole batch. All cases of one mesh run in one spawn (cached), so the
suite spawns each mesh once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from models import CalledTwice, ConvNet, OutsideRead, SameShapeReads, TinyGPT
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gtp_wrap
from gtp_wrap import GTPWrap

GLOBAL_BATCH = 8
STEPS = 3
SHARD_ALL = {"min_shard_numel": 0}


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    kind: str  # "tokens", "vectors" or "images": what data the model eats
    policy: dict = dataclasses.field(default_factory=lambda: SHARD_ALL)
    seq_lens: tuple[int, ...] = (8, 8, 8)
    micro_batches: int = 1
    eval_between: bool = False
    clip: float | None = None


CASES = {
    "gpt_tied": Case(TinyGPT, "tokens", clip=0.5),
    "outside_read": Case(OutsideRead, "vectors"),
    "same_shape_reads": Case(SameShapeReads, "vectors"),
    "called_twice": Case(CalledTwice, "vectors"),
    "conv": Case(
        ConvNet,
        "images",
        policy={
            "min_shard_numel": 0,
            "rules": [
                {"match": "convs.2.weight", "action": "shard", "dim": 1},
                {"match": "Conv2d"},
                {"match": "Linear"},
            ],
        },
    ),
    "checkpoint": Case(functools.partial(TinyGPT, ckpt=True), "tokens"),
    "no_sync": Case(TinyGPT, "tokens", micro_batches=2),
    "eval_between": Case(TinyGPT, "tokens", eval_between=True),
    "seq_change": Case(TinyGPT, "tokens", seq_lens=(8, 12, 5)),
    "prefetch2_unaligned": Case(
        functools.partial(TinyGPT, ckpt=True),
        "tokens",
        policy={"min_shard_numel": 0, "prefetch_depth": 2, "pad_for_alignment": False},
    ),
    "sum_reduction": Case(
        TinyGPT, "tokens", policy={"min_shard_numel": 0, "loss_reduction": "sum"}
    ),
}
MESHES = {"1": 1, "2": 2, "4": 4, "2x2": 4}


def _batch(case: Case, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    n = GLOBAL_BATCH
    if case.kind == "tokens":
        t = case.seq_lens[step % len(case.seq_lens)]
        return torch.randint(0, 48, (n, t), generator=g), torch.randint(0, 48, (n, t), generator=g)
    if case.kind == "images":
        return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)
    return torch.randn(n, 12 if case.build is OutsideRead else 16, generator=g), torch.randn(
        n, 4, generator=g
    )


def _loss(case: Case, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case.kind == "tokens":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    if case.kind == "images":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def _model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.build()


def _train(
    case: Case, model: nn.Module, rank: int, world: int, wrapped: bool, loss_scale: float = 1.0
) -> dict:
    """The training loop both sides run; the wrapped side sees its slice of every batch.

    `loss_scale` lets the reference match loss_reduction="sum": summing the ranks' mean-loss
    grads is the global mean-loss grad times the number of data ranks.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    out: dict[str, list] = {"losses": [], "evals": [], "norms": []}
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(case.micro_batches):
            x, y = (t[rows].to(device) for t in _batch(case, step, micro))
            last = micro == case.micro_batches - 1
            sync = contextlib.nullcontext() if (last or not wrapped) else gtp_wrap.no_sync(model)
            with sync:
                loss = _loss(case, model(x), y) / case.micro_batches
                (loss * loss_scale).backward()
            total += loss.item()
        out["losses"].append(total)
        if case.clip is not None:
            norm = (
                gtp_wrap.clip_grad_norm_(model, case.clip)
                if wrapped
                else torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            )
            out["norms"].append(float(norm))
        opt.step()
        if case.eval_between:
            model.eval()
            with torch.no_grad():
                out["evals"].append(model(_batch(case, 99, 0)[0].to(device)).cpu())
            model.train()
    return out


def _mesh(kind: str):
    if kind == "2x2":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "gtp"))
    return None


def _all_cases(rank: int, world: int, mesh_kind: str) -> dict:
    mesh = _mesh(mesh_kind)
    results = {}
    for name, case in CASES.items():
        try:
            model = GTPWrap(_model(case), case.policy, mesh=mesh)
            res = _train(case, model, rank, world, wrapped=True)
            losses = torch.tensor(res["losses"])
            dist.all_reduce(losses)
            res["losses"] = (losses / world).tolist()
            res["params"] = gtp_wrap.full_state_dict(model)
            res["stats"] = {k: v for k, v in gtp_wrap.stats(model).items() if isinstance(v, int)}
            results[name] = res
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


@functools.cache
def _results(mesh_kind: str) -> list[dict]:
    return run_ranks(_all_cases, MESHES[mesh_kind], mesh_kind, timeout=400)


@functools.cache
def _reference(name: str, data_ranks: int) -> dict:
    case = CASES[name]
    model = _model(case)
    summed = case.policy.get("loss_reduction") == "sum"
    res = _train(case, model, 0, 1, wrapped=False, loss_scale=data_ranks if summed else 1.0)
    res["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("name", list(CASES))
def test_parity(mesh_kind: str, name: str) -> None:
    ref = _reference(name, MESHES[mesh_kind])
    for rank, per_case in enumerate(_results(mesh_kind)):
        got = per_case[name]
        assert "error" not in got, f"rank {rank} failed:\n{got.get('error')}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert got["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
        for a, b in zip(got["evals"], ref["evals"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-6)
        if MESHES[mesh_kind] > 1 and mesh_kind != "1":
            assert got["stats"]["gathers"] > 0, "nothing was sharded"
