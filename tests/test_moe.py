"""The reference mixture of experts: its routing and experts against a per-token computation,
its grouped GEMM's gradients, and GTP on its stacked experts (policy moe) against the unwrapped
model when the ranks route their tokens to different experts."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import cached_ranks, expert_gathers_per_pass, run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.model import GPT, GPTConfig, MoE, _LoopGroupedMM, grouped_mm
from gtp_wrap.config.policy import resolve_policy

CFG = GPTConfig(vocab=64, d=32, layers=2, heads=4, ffn=48, max_seq=16, experts=4, top_k=2,
                moe_ffn=16, shared_expert=True)  # fmt: skip
MOE_YAML = Path(__file__).parents[1] / "configs" / "policy" / "moe.yaml"
MOE = resolve_policy(MOE_YAML)
POLICY = {"rules": MOE.rules, "gather_per_block": MOE.gather_per_block, "min_shard_numel": 0}


def _per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output token by token: the top-k experts' SwiGLU outputs, weighted by their
    renormalized router probabilities, plus the shared expert."""
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        probs = moe.router(t).softmax(-1)
        weights, chosen = probs.topk(moe.top_k)
        y = torch.zeros_like(t)
        for w, e in zip(weights / weights.sum(), chosen.tolist()):
            gate, up = (moe.experts.gate_up[e] @ t).chunk(2)
            y = y + w * (moe.experts.down[e] @ (F.silu(gate) * up))
        if moe.shared is not None:
            y = y + moe.shared(t)
        out.append(y)
    return torch.stack(out).view_as(x)


def test_moe_matches_a_per_token_computation() -> None:
    torch.manual_seed(0)
    moe = MoE(CFG).double()
    x = torch.randn(2, 5, CFG.d, dtype=torch.float64)
    torch.testing.assert_close(moe(x), _per_token(moe, x))
    counts = moe.tokens_per_expert
    assert counts.sum() == 2 * 5 * CFG.top_k
    # The Switch Transformer's load-balancing loss.
    probs = moe.router(x.reshape(-1, CFG.d)).softmax(-1).mean(0)
    want = CFG.aux_loss_coef * CFG.experts * (counts / counts.sum() * probs).sum()
    torch.testing.assert_close(moe.aux_loss, want.float())  # the router computes in fp32


def test_loop_grouped_gemm_gradients() -> None:
    """Experts with and without tokens, against finite differences."""
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 4])
    assert torch.autograd.gradcheck(lambda a, b: _LoopGroupedMM.apply(a, b, counts), (x, w))


def _skewed(model: nn.Module, rank: int) -> list:
    """Route rank 0's tokens to experts 0 and 1 only; rank 1's as the router says."""
    bias = torch.zeros(CFG.experts)
    if rank == 0:
        bias[:2] = torch.tensor([30.0, 20.0])
    return [b.mlp.router.register_forward_hook(lambda m, i, o: o + bias) for b in model.blocks]


def _loss(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()) + model.aux_loss()


def _moe_ranks(rank: int, world: int) -> dict:
    """3 AdamW steps with routing that differs per rank, against the unwrapped model on both
    ranks' halves (each routed as its rank routes it); the chains; the tokens per expert."""
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(0)
    ref = GPT(CFG)
    GTPWrap(model, POLICY)
    _skewed(model, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        idx = torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(step))
        _loss(model, idx[rank * 2 : rank * 2 + 2]).backward()
        total = torch.zeros(())
        for r in range(world):
            hooks = _skewed(ref, r)
            total = total + _loss(ref, idx[r * 2 : r * 2 + 2]) / world
            for h in hooks:
                h.remove()
        total.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full, want = gtp_wrap.full_state_dict(model), ref.state_dict()
    stacks = {w.fqn for w in engine_of(model).weights if ".experts." in w.fqn}
    per_pass = expert_gathers_per_pass(model)
    return {
        "diff": max((full[k] - v).abs().max().item() for k, v in want.items()),
        "stacks": sorted(stacks),
        "per_pass": per_pass,
        "tokens": model.tokens_per_expert().tolist(),
    }


def _results() -> list[dict]:
    return cached_ranks(_moe_ranks, 2)


def test_expert_stacks_train_exactly_when_ranks_route_differently() -> None:
    r0, r1 = _results()
    assert r0["diff"] < 1e-4 and r1["diff"] < 1e-4  # AdamW over 3 steps, as elsewhere
    for block in r0["tokens"]:  # rank 0 used two experts only; rank 1 more
        assert block[2:] == [0, 0] and block[:2] != [0, 0]
    assert any(sum(c > 0 for c in block) > 2 for block in r1["tokens"])


def test_each_expert_stack_is_gathered_once_per_pass() -> None:
    for r in _results():
        assert r["stacks"] == [f"blocks.{i}.mlp.experts.{s}" for i in (0, 1)
                               for s in ("down", "gate_up")]  # fmt: skip
        assert r["per_pass"] == {"PassKind.FORWARD": [1], "PassKind.BACKWARD": [1]}


@pytest.mark.parametrize("bad", [{"top_k": 5}, {"top_k": 0}])
def test_bad_moe_configs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="top_k"):
        GPTConfig(experts=4, **bad)


def test_readme_snippet_trains_the_moe() -> None:
    """The README's mixture-of-experts snippet, in one process: it trains, and counts
    2 x 32 x 4 sequences' routed slots per block."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Mixture of experts (reference model)", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's mixture-of-experts section has no python block"
    code = match.group(1).replace(
        "print(model.tokens_per_expert())", "counts = model.tokens_per_expert()"
    )
    code = code.replace("opt.step()", "opt.step()\n    losses.append(loss.item())")
    scope: dict = {"losses": []}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert len(scope["losses"]) == 3 and all(math.isfinite(x) for x in scope["losses"])
    assert scope["counts"].shape == (2, 4) and (scope["counts"].sum(1) == 4 * 32 * 2).all()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper GPU (torch._grouped_mm)",
)
def test_grouped_gemm_on_hopper_matches_the_loop() -> None:
    """The GPU path (one torch._grouped_mm) against the loop, forward and backward, in bf16;
    experts with and without tokens."""
    torch.manual_seed(0)
    x = torch.randn(40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([10, 0, 25, 5], device="cuda")
    grad = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)
    outs = []
    for grouped in (True, False):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = (grouped_mm if grouped else _LoopGroupedMM.apply)(xi, wi.transpose(1, 2), counts)
        y.backward(grad)
        outs.append((y.float(), xi.grad.float(), wi.grad.float()))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


class _LoopMoE(nn.Module):
    """Experts as a ModuleList, run only when routing sends them tokens (the loop of many MoE
    codebases): which weights a call uses depends on the data."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 32, bias=False), nn.SiLU(), nn.Linear(32, d, bias=False))
            for _ in range(n)
        )
        self.skew = torch.zeros(n)  # added to the router's logits: a rank's own routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = (self.router(x) + self.skew).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = (chosen == i).nonzero().squeeze(-1)
            if idx.numel():
                out[idx] = expert(x[idx])
        return out


class _LoopNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16, bias=False)
        self.moe = _LoopMoE()
        self.out = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def _hf_moe(kind: str):  # -> a small random HF MoE for causal LM, its experts looped in Python
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2)  # fmt: skip
    if kind == "mixtral":
        config = MixtralConfig(intermediate_size=64, num_local_experts=4, **common)
        cls = MixtralForCausalLM
    else:  # a shared expert beside the routed ones
        config = Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                shared_expert_intermediate_size=32, **common)  # fmt: skip
        cls = Qwen2MoeForCausalLM
    config._experts_implementation = "eager"  # a loop over the experts that got tokens
    return cls(config)


def _skew_router(model: nn.Module, on: list[bool]) -> None:
    """While on[0], every router sends all tokens to experts 0 and 1."""
    for layer in model.model.layers:
        gate = layer.mlp.gate
        plain = gate.forward

        def forward(x: torch.Tensor, plain=plain, gate=gate):  # type: ignore[no-untyped-def]
            if not on[0]:
                return plain(x)
            logits = F.linear(x.reshape(-1, x.shape[-1]), gate.weight)
            probs = (logits + torch.tensor([30.0, 20.0, 0.0, 0.0])).softmax(-1)
            top, chosen = probs.topk(2, dim=-1)
            return logits, top / top.sum(-1, keepdim=True), chosen

        gate.forward = forward


def _routed_loops(rank: int, world: int) -> dict:
    """Per-block gathers (gather_per_block on the MoE layers) of models whose expert loops skip
    experts without tokens, with rank 0 routing to two experts and rank 1 as its router says:
    the largest weight difference from the unwrapped model after 3 SGD steps."""
    out = {}
    torch.manual_seed(0)
    model, ref = _LoopNet(), _LoopNet()
    ref.load_state_dict(model.state_dict())
    GTPWrap(model, {"min_shard_numel": 0, "collective_timeout_s": 60})
    gtp_wrap.gather_per_block(model, blocks=[model.moe])
    skews = [torch.tensor([100.0, 0, 0, 0]), torch.zeros(4)]
    model.moe.skew = skews[rank]
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def loop_loss(m: nn.Module, r: int) -> torch.Tensor:
        m.moe.skew = skews[r]
        return m(x[r * 4 : r * 4 + 4]).square().mean()

    out["module_list"] = _train_sgd(model, ref, lambda m, r: loop_loss(m, r), rank, world)
    # Twice through one graph (retain_graph): each backward gathers the block once again.
    loss = loop_loss(model, rank)
    counts = []
    for retain in (True, False):
        gtp_wrap.reset_stats(model)
        loss.backward(retain_graph=retain)
        counts.append(gtp_wrap.stats(model)["gathers"])
    out["retain"] = counts

    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    for kind in ("mixtral", "qwen2_moe"):
        torch.manual_seed(0)
        model = _hf_moe(kind)
        torch.manual_seed(0)
        ref = _hf_moe(kind)
        GTPWrap(model, POLICY | {"collective_timeout_s": 60})  # moe.yaml: MoE layers per block
        on_ref = [False]
        _skew_router(model, [rank == 0])
        _skew_router(ref, on_ref)

        def hf_loss(m: nn.Module, r: int, on_ref: list[bool] = on_ref) -> torch.Tensor:
            on_ref[0] = r == 0
            logits = m(input_ids=idx[r * 2 : r * 2 + 2, :-1]).logits
            return F.cross_entropy(logits.flatten(0, 1), idx[r * 2 : r * 2 + 2, 1:].flatten())

        out[kind] = _train_sgd(model, ref, hf_loss, rank, world)
        engine = engine_of(model)
        name = {w.index: w.fqn for w in engine.weights}
        stacks = [w.fqn for w in engine.weights if ".experts." in w.fqn]
        out[f"{kind}_per_pass"] = sorted(
            {
                sum(name[i] == s for i in c.order)
                for c in engine.passes.chains.values()
                for s in stacks
            }
        )
    return out


def _train_sgd(model: nn.Module, ref: nn.Module, loss, rank: int, world: int) -> float:  # type: ignore[no-untyped-def]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for _ in range(3):
        loss(model, rank).backward()
        (sum(loss(ref, r) for r in range(world)) / world).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    full, want = gtp_wrap.full_state_dict(model), ref.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in want.items())


def test_each_backward_through_a_retained_graph_gathers_a_block_once() -> None:
    """retain_graph: the second backward gathers what the first did, on both ranks, though
    their blocks saved views of different experts."""
    counts = [r["retain"] for r in cached_ranks(_routed_loops, 2)]
    assert counts[0] == counts[1] and counts[0][0] == counts[0][1] > 0, counts


def test_a_single_expert_keeps_the_router_learning() -> None:
    """top_k=1: the chosen expert is weighted by its router probability (not renormalized to
    1), so the main loss reaches the router."""
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(CFG, top_k=1, aux_loss_coef=0.0))
    moe(torch.randn(2, 5, CFG.d)).square().sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["module_list", "mixtral", "qwen2_moe"])
def test_expert_loops_that_skip_experts_train_exactly_per_block(kind: str) -> None:
    """The experts one rank's tokens skip are still gathered with the block, in forward and
    backward (see [Note: a block's weights come back together]): no hang, exact weights, and
    for HF's eager loop (which indexes a stack per expert) one gather per stack per pass."""
    for r in cached_ranks(_routed_loops, 2):
        assert r[kind] < 1e-5, r
        if kind != "module_list":
            assert r[f"{kind}_per_pass"] == [1], r


def test_gather_per_block_in_the_policy() -> None:
    """A policy's gather_per_block: checked when made, and a warning when it names no module
    of the model."""
    with pytest.raises(gtp_wrap.PolicyError, match="gather_per_block must be a list"):
        gtp_wrap.GTPPolicy(gather_per_block="MoE")  # type: ignore[arg-type]
    with pytest.warns(gtp_wrap.PolicyWarning, match=r"gather_per_block \['Nothing'\] matched no"):
        GTPWrap(GPT(CFG), {"gather_per_block": ["Nothing"], "min_shard_numel": 0})


def _expert_checkpoint(rank: int, world: int) -> bool:
    """The reference MoE saved with its stacks sharded (rows of each [E, out, in] stack over 2
    ranks) loads bitwise into the unwrapped model on every rank."""
    root = Path(tempfile.gettempdir()) / f"gtp_moe_ckpt_{os.getppid()}"
    torch.manual_seed(0)
    model = GPT(CFG)
    GTPWrap(model, POLICY)
    idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(rank))
    _loss(model, idx).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    saved = gtp_wrap.checkpoint.save(root, model, step=1)
    want = gtp_wrap.full_state_dict(model)
    plain = GPT(CFG)
    gtp_wrap.checkpoint.load(saved, plain)
    same = all(torch.equal(plain.state_dict()[k], v) for k, v in want.items())
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return same


def test_sharded_expert_stacks_checkpoint_into_the_unwrapped_model() -> None:
    assert all(run_ranks(_expert_checkpoint, 2))


def _moe_losses(compiled: bool, steps: int = 3) -> tuple[list[float], list[int]]:
    """The losses of `steps` AdamW steps of the MoE GPT at world 1, each on new tokens (a new
    routing), and, compiled, how many frames Dynamo had compiled (recompiles too) after each."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d=128, layers=4, heads=4, ffn=344, max_seq=32, experts=8,
                    top_k=2, moe_ffn=128)  # configs/model/moe_tiny.yaml's shapes  # fmt: skip
    model = GTPWrap(GPT(cfg), POLICY)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if compiled:
        gtp_wrap.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses, frames = [], []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab, (2, cfg.max_seq), generator=data)
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        frames.append(torch._dynamo.utils.counters["frames"]["total"])
    return losses, frames


def test_a_compiled_moe_compiles_in_its_first_step_whatever_the_routing() -> None:
    """The loop grouped GEMM (CPU, and GPUs without the bf16 Hopper `torch._grouped_mm`) runs
    only the experts that got tokens. Traced by Dynamo, every new routing compiled the block
    again, until the recompile limit sent it back to eager (found running gtp-train
    model=moe_tiny trainer.compile=true for 10 steps). Kept eager, it is a graph break: the
    graphs of the first step serve every later routing, with eager's losses."""
    eager, _ = _moe_losses(compiled=False)
    compiled, frames = _moe_losses(compiled=True)
    assert frames[0] > 0 and frames == [frames[0]] * len(frames), frames
    assert compiled == pytest.approx(eager, rel=1e-5)
