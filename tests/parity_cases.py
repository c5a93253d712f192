"""The parity cases: small models trained a few AdamW steps on a global batch split over the
data ranks, against a single-process reference on the whole batch (test_parity on gloo,
test_gpu on NCCL)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from models import CalledTwice, ConvNet, OutsideRead, SameShapeReads, TinyGPT
from torch import nn
from torch.nn.utils import get_total_norm

import gtp_wrap

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


def batch_of(case: Case, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def loss_of(case: Case, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case.kind == "tokens":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    if case.kind == "images":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def model_of(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.build()


def train_case(
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
            x, y = (t[rows].to(device) for t in batch_of(case, step, micro))
            last = micro == case.micro_batches - 1
            sync = contextlib.nullcontext() if (last or not wrapped) else gtp_wrap.no_sync(model)
            with sync:
                loss = loss_of(case, model(x), y) / case.micro_batches
                (loss * loss_scale).backward()
            total += loss.item()
        out["losses"].append(total)
        if case.clip is not None:
            # The norm alone (for logging), as torch's get_total_norm gives it unwrapped.
            out["norms"].append(
                float(gtp_wrap.grad_norm(model))
                if wrapped
                else float(
                    get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                )
            )
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
                out["evals"].append(model(batch_of(case, 99, 0)[0].to(device)).cpu())
            model.train()
    return out
