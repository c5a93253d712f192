"""CUDA-graph capture of GTP steps: graphed training equals eager training, bit for bit.

The graph replays exactly the kernels and collectives the eager step launched, on the same
inputs, so losses and parameters must match exactly (no tolerance). CPU runs only check the
refusal; the rest needs 2 GPUs (NCCL).
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from graph_cases import (
    CFG,
    OPTIMIZERS,
    POLICY,
    RoutedGPT,
    batch_of,
    bf16_gpt,
    fresh,
    regions_run,
    train_graphed,
)
from harness import cached_ranks, run_ranks

import gtp_wrap
from gtp_wrap import GraphCaptureError, GTPWrap
from gtp_wrap.app.model import GPT

# Two ranks where two GPUs exist; on one GPU the same bodies run as a world of one (no
# collectives, but the same capture, replay and host bookkeeping).
GPUS = min(2, torch.cuda.device_count())
gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")


def test_refused_on_cpu() -> None:
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), POLICY)
    with pytest.raises(GraphCaptureError, match="needs a CUDA device"):
        gtp_wrap.graph_step(model, lambda x: model(x).sum().backward())
    with pytest.raises(GraphCaptureError, match="needs a CUDA device"):
        gtp_wrap.graph_region(model, model.blocks[0], (torch.zeros(1, 4, CFG.d),))
    with pytest.raises(GraphCaptureError, match="at least two eager steps"):
        gtp_wrap.graph_step(model, lambda x: None, warmup=1)


def _graphed_vs_eager(rank: int, world: int) -> dict:
    out = {}
    for optimizer in OPTIMIZERS:
        try:
            out[optimizer] = {"eager": train_graphed(rank, False, optimizer)}
            out[optimizer]["graphed"] = train_graphed(rank, True, optimizer)
        except Exception:
            out[optimizer] = {"error": traceback.format_exc()}
    return out


@gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_graphed_step_equals_eager(optimizer: str) -> None:
    for rank, per_rank in enumerate(_results()):
        got = per_rank[optimizer]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        eager, graphed = got["eager"], got["graphed"]
        assert graphed["losses"] == eager["losses"]
        for k, v in eager["state"].items():
            assert torch.equal(graphed["state"][k], v), k
        assert torch.equal(graphed["evals"], eager["evals"])
        # Gather buffers are made in the eager warm-up steps; capture and replays add none.
        assert len(set(graphed["pool"][2:])) == 1, graphed["pool"]
        assert graphed["ws"] == 0  # NCCL: no copy-engine workspace


def _results() -> list:
    return cached_ranks(_graphed_vs_eager, GPUS, timeout=200, backend="nccl")


def _host_sync_in_step(rank: int, world: int) -> str:
    device = torch.device("cuda", rank)
    model, _ = fresh(device, capturable=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss.item()  # a host synchronization: cannot be captured

    run = gtp_wrap.graph_step(model, step, warmup=2)
    run(*batch_of(rank, 0, device))
    try:  # the last warm-up step refuses what capture would
        run(*batch_of(rank, 1, device))
    except GraphCaptureError as e:
        return str(e)
    return "no error"


@gpu
def test_host_sync_is_named_on_every_rank() -> None:
    for message in run_ranks(_host_sync_in_step, GPUS, timeout=120, backend="nccl"):
        assert "_local_scalar_dense" in message, message
        assert ".item()" in message, message


def _partial(rank: int, world: int) -> dict:
    out: dict = {}
    try:
        device = torch.device("cuda", rank)
        torch.manual_seed(0)
        model = GTPWrap(RoutedGPT(CFG).to(device), POLICY)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()

        run = gtp_wrap.graph_step(model, step, warmup=2)
        run(*batch_of(rank, 0, device))
        try:  # the last warm-up step already refuses the data-dependent indexing
            run(*batch_of(rank, 1, device))
            out["whole_step"] = "no error"
        except GraphCaptureError as e:
            out["whole_step"] = str(e)
        out["routed"] = [regions_run(rank, lambda: RoutedGPT(CFG), g) for g in (None, 0)]
        out["bf16"] = [regions_run(rank, bf16_gpt, g) for g in (None, 1)]
    except Exception:
        out["error"] = traceback.format_exc()
    return out


@gpu
def test_partial_capture_equals_eager() -> None:
    for rank, got in enumerate(run_ranks(_partial, GPUS, timeout=100, backend="nccl")):
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        assert "stopped at 'index" in got["whole_step"], got["whole_step"]
        for model in ("routed", "bf16"):
            eager, regions = got[model]
            assert regions["losses"] == eager["losses"], model
            for k, v in eager["state"].items():
                assert torch.equal(regions["state"][k], v), (model, k)


def _region_hooks(rank: int, world: int) -> dict:
    """Post-accumulate-grad hooks on a graphed region's weight and on an eager one."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG).to(device), POLICY)
    dtype = torch.bfloat16
    x = torch.zeros(2, 16, CFG.d, device=device, dtype=dtype, requires_grad=True)
    cos, sin = (c[:16].to(dtype) for c in (model.cos, model.sin))
    calls: dict[str, list[bool]] = {"region": [], "eager": []}
    weights = {"region": model.blocks[-1].mlp.up.weight, "eager": model.blocks[0].mlp.up.weight}
    for name, w in weights.items():
        w.register_post_accumulate_grad_hook(
            lambda p, name=name: calls[name].append(p.grad is not None)
        )
    gtp_wrap.graph_region(model, model.blocks[-1], (x, cos, sin))
    for i in range(3):
        idx, y = batch_of(rank, i, device)
        F.cross_entropy(model(idx).float().flatten(0, 1), y.flatten()).backward()
        model.zero_grad(set_to_none=True)
    return calls


@gpu
def test_region_weight_hooks_run_once_per_step() -> None:
    """Once per real backward, with the gradient in place: not in the region's warm-up and
    capture, and not skipped for the weights a replay gives gradients."""
    for calls in run_ranks(_region_hooks, GPUS, timeout=120, backend="nccl"):
        assert calls == {"region": [True] * 3, "eager": [True] * 3}, calls
