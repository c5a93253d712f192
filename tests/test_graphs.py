"""CUDA-graph capture of GTP steps: graphed training equals eager training, bit for bit.

The graph replays exactly the kernels and collectives the eager step launched, on the same
inputs, so losses and parameters must match exactly (no tolerance). CPU runs only check the
refusal; the rest needs 2 GPUs (NCCL).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks

import gtp_wrap
from gtp_wrap import GraphCaptureError, GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.model import GPT, GPTConfig

CFG = GPTConfig(vocab=96, d=64, layers=3, heads=4, ffn=172, max_seq=32)
POLICY = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
STEPS = 20
gpu = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_refused_on_cpu() -> None:
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), POLICY)
    with pytest.raises(GraphCaptureError, match="needs a CUDA device"):
        gtp_wrap.graph_step(model, lambda x: model(x).sum().backward())
    with pytest.raises(GraphCaptureError, match="needs a CUDA device"):
        gtp_wrap.graph_region(model, model.blocks[0], (torch.zeros(1, 4, CFG.d),))
    with pytest.raises(GraphCaptureError, match="at least two eager steps"):
        gtp_wrap.graph_step(model, lambda x: None, warmup=1)


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, CFG.vocab, (2, 17), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


# Where the optimizer step runs: captured with the step (foreach kernels or the fused one, both
# built capturable), or eagerly after each replay.
OPTIMIZERS = ("capturable", "fused", "outside")


def _fresh(device: torch.device, capturable: bool, fused: bool = False, policy: dict = POLICY):
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG).to(device), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=capturable, fused=fused)
    return model, opt


def _train(rank: int, graphed: bool, optimizer: str, policy: dict = POLICY) -> dict:
    """STEPS steps of the reference GPT, eager or graphed; returns losses, weights, evals."""
    device = torch.device("cuda", rank)
    optimizer_in_graph = optimizer != "outside"
    model, opt = _fresh(device, optimizer_in_graph, optimizer == "fused", policy)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if optimizer_in_graph:
            opt.step()
        return loss.detach()

    run: Callable = gtp_wrap.graph_step(model, step) if graphed else step
    losses, pool_bytes = [], []
    for i in range(STEPS):
        loss = run(*_batch(rank, i, device))
        if not optimizer_in_graph:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        pool_bytes.append(engine_of(model).gatherer.eager.total_bytes)
    with torch.no_grad():  # an eager pass after replays sees the replayed optimizer's weights
        evals = model(_batch(rank, 99, device)[0]).float().cpu()
    full = {k: v.cpu() for k, v in gtp_wrap.full_state_dict(model).items()}
    workspace = gtp_wrap.stats(model)["workspace_bytes"]
    return {"losses": losses, "state": full, "evals": evals, "pool": pool_bytes, "ws": workspace}


def _graphed_vs_eager(rank: int, world: int) -> dict:
    out = {}
    for optimizer in OPTIMIZERS:
        try:
            out[optimizer] = {"eager": _train(rank, False, optimizer)}
            out[optimizer]["graphed"] = _train(rank, True, optimizer)
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


_cache: list = []


def _results() -> list:
    if not _cache:
        _cache.append(run_ranks(_graphed_vs_eager, 2, timeout=200, backend="nccl"))
    return _cache[0]


def _host_sync_in_step(rank: int, world: int) -> str:
    device = torch.device("cuda", rank)
    model, _ = _fresh(device, capturable=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        return loss.item()  # a host synchronization: cannot be captured

    run = gtp_wrap.graph_step(model, step, warmup=2)
    run(*_batch(rank, 0, device))
    try:  # the last warm-up step refuses what capture would
        run(*_batch(rank, 1, device))
    except GraphCaptureError as e:
        return str(e)
    return "no error"


@gpu
def test_host_sync_is_named_on_every_rank() -> None:
    for message in run_ranks(_host_sync_in_step, 2, timeout=120, backend="nccl"):
        assert "_local_scalar_dense" in message, message
        assert ".item()" in message, message


class RoutedGPT(GPT):
    """The reference GPT with a data-dependent step after its first block: the tokens whose
    activations have an above-median norm go through one more (sharded) Linear. How many do
    depends on the data, so the whole step cannot be captured; the blocks can."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.router = torch.nn.Linear(cfg.d, cfg.d, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        cos, sin = (c[: idx.shape[1]].to(x.dtype) for c in (self.cos, self.sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i == 0:
                norms = x.float().norm(dim=-1)
                mask = norms > norms.median()
                x = x.index_put((mask,), self.router(x[mask]), accumulate=True)
        return self.head(self.norm(x))


def _regions_run(
    rank: int, build: Callable[[], GPT], first_graphed: int | None, policy: dict = POLICY
) -> dict:
    """STEPS eager training steps, with the blocks from `first_graphed` on captured as graphed
    regions (None: all eager)."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = GTPWrap(build().to(device), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if first_graphed is not None:
        dtype = torch.bfloat16  # the compute dtype: what the blocks receive
        x = torch.zeros(2, 16, CFG.d, device=device, dtype=dtype, requires_grad=True)
        cos, sin = (c[:16].to(dtype) for c in (model.cos, model.sin))
        for block in model.blocks[first_graphed:]:
            gtp_wrap.graph_region(model, block, (x, cos, sin))
    losses = []
    for i in range(STEPS):
        x, y = _batch(rank, i, device)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    full = {k: v.cpu() for k, v in gtp_wrap.full_state_dict(model).items()}
    return {"losses": losses, "state": full}


def _bf16_gpt() -> GPT:
    """bf16 parameters reduced in fp32: gradients go through staging buffers."""
    return GPT(CFG).to(torch.bfloat16)


def _partial(rank: int, world: int) -> dict:
    out: dict = {}
    try:
        device = torch.device("cuda", rank)
        torch.manual_seed(0)
        model = GTPWrap(RoutedGPT(CFG).to(device), POLICY)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()

        run = gtp_wrap.graph_step(model, step, warmup=2)
        run(*_batch(rank, 0, device))
        try:  # the last warm-up step already refuses the data-dependent indexing
            run(*_batch(rank, 1, device))
            out["whole_step"] = "no error"
        except GraphCaptureError as e:
            out["whole_step"] = str(e)
        out["routed"] = [_regions_run(rank, lambda: RoutedGPT(CFG), g) for g in (None, 0)]
        out["bf16"] = [_regions_run(rank, _bf16_gpt, g) for g in (None, 1)]
    except Exception:
        out["error"] = traceback.format_exc()
    return out


@gpu
def test_partial_capture_equals_eager() -> None:
    for rank, got in enumerate(run_ranks(_partial, 2, timeout=100, backend="nccl")):
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
        idx, y = _batch(rank, i, device)
        F.cross_entropy(model(idx).float().flatten(0, 1), y.flatten()).backward()
        model.zero_grad(set_to_none=True)
    return calls


@gpu
def test_region_weight_hooks_run_once_per_step() -> None:
    """Once per real backward, with the gradient in place: not in the region's warm-up and
    capture, and not skipped for the weights a replay gives gradients."""
    for calls in run_ranks(_region_hooks, 2, timeout=120, backend="nccl"):
        assert calls == {"region": [True] * 3, "eager": [True] * 3}, calls
