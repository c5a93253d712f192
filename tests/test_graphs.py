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
    block_sample_args,
    fresh,
    regions_run,
    train_eager,
    train_graphed,
)
from harness import cached_ranks, run_ranks

import gtp_wrap
from gtp_wrap import GraphCaptureError, GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.model import GPT
from gtp_wrap.core.weight import ShardedWeight
from gtp_wrap.runtime.chain import PassKind

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


def _failed_capture(rank: int, world: int) -> dict:
    """A region whose forward raises in its capture (the call after its warm-ups), then eager
    training of the same model, against a model that never tried."""
    device = torch.device("cuda", rank)
    out: dict = {}
    try:
        model, opt = fresh(device, capturable=False)
        block = model.blocks[-1]
        calls = [0]
        forward = block.forward

        def failing(*args: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 4:  # warmup=3 runs first: this is the capture's call
                raise RuntimeError("the block failed while captured")
            return forward(*args)

        block.forward = failing  # type: ignore[method-assign]
        try:
            gtp_wrap.graph_region(model, block, block_sample_args(model), warmup=3)
        except GraphCaptureError as error:
            out["raised"] = str(error)
        del block.forward  # the class's forward again
        engine = engine_of(model)
        out["open_passes"] = len(engine.passes.stack)
        # The forward chain the warm-ups recorded for the region's scope (only weights
        # gathered over several ranks are recorded): a failed pass must not replace it.
        out["region_chain"] = [
            list(chain.order)
            for (kind, scope, _), chain in engine.passes.chains.items()
            if scope is not None and kind is PassKind.FORWARD
        ]
        ref, ref_opt = fresh(device, capturable=False)
        for name, (m, o) in {"after": (model, opt), "reference": (ref, ref_opt)}.items():
            losses = train_eager(m, o, rank, 3)
            out[name] = {"losses": losses, "state": gtp_wrap.full_state_dict(m)}
        out["block_weights"] = sorted(
            p.gtp_weight.index
            for p in block.parameters()
            if isinstance(getattr(p, "gtp_weight", None), ShardedWeight)
        )
    except Exception:
        out["error"] = traceback.format_exc()
    return out


@gpu
def test_a_failed_region_capture_leaves_the_model_training_eagerly() -> None:
    """The capture's error reaches the caller, no pass stays open, the region's chain is
    the warm-ups' (its gathered weights, not the failed pass's empty record), and the model
    then trains as one that never tried."""
    for rank, got in enumerate(run_ranks(_failed_capture, GPUS, timeout=100, backend="nccl")):
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        raised = got["raised"]  # the capture's error, naming the block's own as its cause
        assert "forward cannot be captured" in raised, raised
        assert raised.endswith("Cause: the block failed while captured"), raised
        assert got["open_passes"] == 0
        if GPUS > 1:  # a world of one gathers nothing, so records no chains
            assert [sorted(c) for c in got["region_chain"]] == [got["block_weights"]]
        assert got["after"]["losses"] == got["reference"]["losses"]
        for k, v in got["reference"]["state"].items():
            assert torch.equal(got["after"]["state"][k], v), k


def _region_on_gathered_block(rank: int, world: int) -> dict:
    """A graphed region over a block on gathered weights: run eagerly when called on its own,
    replayed in the model's steps; against the same model with no region."""
    device = torch.device("cuda", rank)
    out: dict = {}
    try:
        results = {}
        for name in ("blocks", "region"):
            model, opt = fresh(device, capturable=False)
            x0, cos, sin = block_sample_args(model)
            gtp_wrap.gather_per_block(model)
            if name == "region":
                gtp_wrap.graph_region(model, model.blocks[-1], (x0, cos, sin))
            g = torch.Generator().manual_seed(7 + rank)
            x = torch.randn(x0.shape, generator=g).to(device, x0.dtype).requires_grad_()
            alone = model.blocks[-1](x, cos, sin)  # outside the model's forward: eager
            alone.float().square().sum().backward()
            results[name] = {"alone": alone.detach().float().cpu(), "x_grad": x.grad.cpu()}
            opt.zero_grad(set_to_none=True)
            results[name]["losses"] = train_eager(model, opt, rank, 3)
            if name == "region":  # the region's replay marks the model pass it ran in
                results[name]["replayed"] = model.blocks[-1].forward.func._replayed_in is not None
        out.update(results)
    except Exception:
        out["error"] = traceback.format_exc()
    return out


@gpu
def test_a_region_over_a_block_on_gathered_weights() -> None:
    """Called on its own, outside the model's forward, the region's block (which opens its own
    pass) gives what it gives without a region, output and input gradient; in training the
    region replays, and trains as the eager blocks do, bit for bit."""
    for rank, got in enumerate(
        run_ranks(_region_on_gathered_block, GPUS, timeout=100, backend="nccl")
    ):
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        blocks, region = got["blocks"], got["region"]
        assert torch.equal(region["alone"], blocks["alone"])
        assert torch.equal(region["x_grad"], blocks["x_grad"])
        assert region["replayed"]
        assert region["losses"] == blocks["losses"]
