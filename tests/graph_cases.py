"""The graphed training runs: the reference GPT trained eagerly or through graph_step /
graph_region on CUDA (test_graphs on NCCL, test_copy_engine through the copy engine)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.model import GPT, GPTConfig

CFG = GPTConfig(vocab=96, d=64, layers=3, heads=4, ffn=172, max_seq=32)


POLICY = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}


STEPS = 20


def batch_of(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, CFG.vocab, (2, 17), generator=g).to(device)
    return idx[:, :-1], idx[:, 1:]


# Where the optimizer step runs: captured with the step (foreach kernels or the fused one, both
# built capturable), or eagerly after each replay.
OPTIMIZERS = ("capturable", "fused", "outside")


def fresh(device: torch.device, capturable: bool, fused: bool = False, policy: dict = POLICY):
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG).to(device), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=capturable, fused=fused)
    return model, opt


def train_graphed(rank: int, graphed: bool, optimizer: str, policy: dict = POLICY) -> dict:
    """STEPS steps of the reference GPT, eager or graphed; returns losses, weights, evals."""
    device = torch.device("cuda", rank)
    optimizer_in_graph = optimizer != "outside"
    model, opt = fresh(device, optimizer_in_graph, optimizer == "fused", policy)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if optimizer_in_graph:
            opt.step()
        return loss.detach()

    run: Callable = gtp_wrap.graph_step(model, step) if graphed else step
    losses, pool_bytes = [], []
    for i in range(STEPS):
        loss = run(*batch_of(rank, i, device))
        if not optimizer_in_graph:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        pool_bytes.append(engine_of(model).gatherer.eager.total_bytes)
    with torch.no_grad():  # an eager pass after replays sees the replayed optimizer's weights
        evals = model(batch_of(rank, 99, device)[0]).float().cpu()
    full = {k: v.cpu() for k, v in gtp_wrap.full_state_dict(model).items()}
    workspace = gtp_wrap.stats(model)["workspace_bytes"]
    return {"losses": losses, "state": full, "evals": evals, "pool": pool_bytes, "ws": workspace}


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


def block_sample_args(model: GPT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a block of the wrapped reference GPT takes, for graph_region's sample_args: a
    batch-2, 16-token activation in the compute dtype (bf16), and the RoPE tables."""
    dtype = torch.bfloat16
    x = torch.zeros(2, 16, CFG.d, device=model.cos.device, dtype=dtype, requires_grad=True)
    cos, sin = (c[:16].to(dtype) for c in (model.cos, model.sin))
    return x, cos, sin


def train_eager(
    model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int
) -> list[float]:
    """`steps` eager training steps on the reference batches; their losses."""
    device = next(model.parameters()).device
    losses = []
    for i in range(steps):
        x, y = batch_of(rank, i, device)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def regions_run(
    rank: int, build: Callable[[], GPT], first_graphed: int | None, policy: dict = POLICY
) -> dict:
    """STEPS eager training steps, with the blocks from `first_graphed` on captured as graphed
    regions (None: all eager)."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    model = GTPWrap(build().to(device), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if first_graphed is not None:
        for block in model.blocks[first_graphed:]:
            gtp_wrap.graph_region(model, block, block_sample_args(model))
    losses = train_eager(model, opt, rank, STEPS)
    full = {k: v.cpu() for k, v in gtp_wrap.full_state_dict(model).items()}
    return {"losses": losses, "state": full}


def bf16_gpt() -> GPT:
    """bf16 parameters reduced in fp32: gradients go through staging buffers."""
    return GPT(CFG).to(torch.bfloat16)
