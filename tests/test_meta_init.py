"""GTPWrap of a model built on the meta device: only this rank's part is allocated, and every
weight gets the unwrapped model's seeded values, bitwise, whatever the world, mesh and policy;
the memory of a wrap stays at the shards plus one weight."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import cached_ranks, caught, mesh_2d, run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from wrap_memory import LiveBytes  # noqa: E402 - the benchmark's own measure

CFG = GPTConfig(vocab=66, d=32, layers=2, heads=4, ffn=48, max_seq=16)
MOE = dataclasses.replace(CFG, experts=4, top_k=2, moe_ffn=16)
EXPERTS = {"rules": [{"match": "*.experts.*", "dim": 1, "group": "egtp"}, {"match": "Linear"},
                     {"match": "Embedding"}], "expert_parallel": ["Experts"]}  # fmt: skip


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    )  # fmt: skip


class _RandomStatsNorm(nn.BatchNorm1d):
    """Running statistics drawn at random (so their init's dtype shows in their values)."""

    def reset_running_stats(self) -> None:
        super().reset_running_stats()
        if self.track_running_stats:
            self.running_mean.uniform_(-0.5, 0.5)  # type: ignore[operator,union-attr]
            # Rounded after each op in a half dtype: an init run in one differs from one cast.
            self.running_var.uniform_(0.5, 2.0).mul_(3.3).add_(0.1)  # type: ignore[operator,union-attr]


class _Normed(nn.Module):
    """An embedding, a batch norm over its channels, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(66, 16)
        self.norm = _RandomStatsNorm(16)
        self.head = nn.Linear(16, 66, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(idx).transpose(1, 2)).transpose(1, 2))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: GPT(CFG),
    "moe": lambda: GPT(MOE),
    "llama": _llama,
    "normed": _Normed,
}


def _built(make: Callable[[], nn.Module], meta: bool) -> nn.Module:
    torch.manual_seed(0)
    if not meta:
        return make()
    with torch.device("meta"):
        return make()


def _compare(name: str, policy: dict, mesh: Any = None, expert_mesh: Any = None) -> dict:
    """The meta-built wrapped model against the unwrapped one built eagerly with the seed (every
    weight and buffer), and against that one wrapped the same way (a forward: the compute
    copies and casts were made from the values the replay wrote)."""
    ref = _built(MODELS[name], meta=False)
    model = GTPWrap(_built(MODELS[name], meta=True), policy, mesh=mesh, expert_mesh=expert_mesh,
                    device="cpu")  # fmt: skip
    full = gtp_wrap.full_state_dict(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}  # before a forward moves them
    eager = GTPWrap(_built(MODELS[name], meta=False), policy, mesh=mesh, expert_mesh=expert_mesh)
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    out = model(idx)
    want = eager(idx)
    if not isinstance(out, torch.Tensor):
        out, want = out.logits, want.logits
    return {
        "params": [
            k for k, v in ref.state_dict().items() if not torch.equal(full[k], v.to(full[k]))
        ],
        "buffers": [
            k for k, v in ref.named_buffers() if not torch.equal(buffers[k], v.to(buffers[k]))
        ],
        "forward": torch.equal(out, want),
    }


def _cases(rank: int, world: int) -> dict:
    policy = {"min_shard_numel": 0}
    out = {
        "gpt": _compare("gpt", policy),
        "llama": _compare("llama", policy),
        "gpt_bf16": _compare("gpt", {**policy, "param_dtype": "bfloat16"}),
        "gpt_fp8": _compare("gpt", {**policy, "param_dtype": "bfloat16", "gather_dtype": "fp8"}),
        "moe_egtp": _compare("moe", {**EXPERTS, **policy}),
        # The tied embedding and head replicated: the head's reset must not re-draw it.
        "normed_replicated": _compare("normed", {"min_shard_numel": 10**9}),
        # Statistics initialized in fp32, then cast, as the unwrapped model cast would.
        "normed_bf16_stats": _compare(
            "normed", {**policy, "param_dtype": "bfloat16", "norm_in_fp32": False}
        ),
    }
    if world == 4:
        out["gpt_2x2"] = _compare("gpt", policy, mesh=mesh_2d(2, 2))
        mesh, expert_mesh = gtp_wrap.make_mesh(gtp=4, ep=2, egtp=2, device_type="cpu")
        out["moe_ep2_egtp2"] = _compare("moe", {**EXPERTS, **policy}, mesh, expert_mesh)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_init_is_the_seeded_unwrapped_model_bitwise(world: int) -> None:
    results = [_cases(0, 1)] if world == 1 else cached_ranks(_cases, world, timeout=300.0)
    for r in results:
        assert len(r) == (7 if world < 4 else 9)
        for case, got in r.items():
            assert got == {"params": [], "buffers": [], "forward": True}, case


BIG = GPTConfig(vocab=4096, d=256, layers=4, heads=4, ffn=688, max_seq=32)


def _wrap_memory(rank: int, world: int, meta: bool) -> dict:
    torch.manual_seed(0)
    with LiveBytes() as live:
        if meta:
            with torch.device("meta"):
                model = GPT(BIG)
            GTPWrap(model, {"min_shard_numel": 0}, device="cpu")
        else:
            model = GTPWrap(GPT(BIG), {"min_shard_numel": 0})
    with torch._C.DisableTorchFunctionSubclass():
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() for p in GPT(BIG).parameters()) * 4
    return {"peak": live.peak, "kept": kept, "largest": largest}


def test_a_meta_wrap_allocates_shards_and_one_weight() -> None:
    """On 4 ranks: at most 1.1 x (this rank's shards and replicated parameters + the largest
    weight, staged whole). The same check on a model built whole first fails."""
    for r in run_ranks(_wrap_memory, 4, True):
        assert r["peak"] <= 1.1 * (r["kept"] + r["largest"]), r
        assert r["kept"] < BIG.n_params * 4 / 3  # a quarter of the model, and replicated norms
    whole = run_ranks(_wrap_memory, 2, False)[0]
    assert whole["peak"] > 1.1 * (whole["kept"] + whole["largest"])


def _refusals(rank: int, world: int) -> dict:
    with torch.device("meta"):
        different = GPT(CFG)

    def seeded_differently() -> None:
        torch.manual_seed(rank)
        GTPWrap(different, {"min_shard_numel": 0}, device="cpu")

    with torch.device("meta"):
        partly = GPT(CFG)
    partly.norm.to_empty(device="cpu")
    with torch.device("meta"):
        with_tp = GPT(CFG)
    mesh, _ = gtp_wrap.make_mesh(gtp=1, tp=2)
    tp = {"rules": [{"match": "blocks.*.attn.qkv", "tp": "colwise"}, {"match": "Linear"}]}
    seeds, notes = "no error", []
    try:
        seeded_differently()
    except gtp_wrap.WrapError as error:
        seeds, notes = str(error), getattr(error, "__notes__", [])
    return {
        "seeds": seeds,
        "seeds_notes": notes,
        "partly": caught(lambda: GTPWrap(partly, device="cpu")),
        "tp": caught(lambda: GTPWrap(with_tp, tp, mesh=mesh, device="cpu")),
        "not_meta": caught(lambda: GTPWrap(GPT(CFG), device="cpu")),
    }


def test_what_a_meta_wrap_cannot_do_is_refused() -> None:
    r = cached_ranks(_refusals, 2)[0]
    assert "random generators in different states" in r["seeds"]
    assert "build the model again (on the meta device)" in " ".join(r["seeds_notes"])
    assert "partly on the meta device" in r["partly"]
    assert "tensor parallelism is not supported yet" in r["tp"]
    assert "for a model built on the meta device" in r["not_meta"]


def _custom(rank: int, world: int) -> list[float]:
    """init_fn: every element is its row's index in the whole weight (norms: ones)."""

    def rows(module: nn.Module, name: str, local: torch.Tensor, offset: tuple[int, ...]) -> None:
        if local.dim() < 2:
            local.fill_(1.0)
            return
        index = torch.arange(local.shape[0], dtype=local.dtype) + offset[0]
        local.copy_(index.view(-1, *[1] * (local.dim() - 1)).expand_as(local))

    with torch.device("meta"):
        model = GPT(CFG)
    GTPWrap(model, {"min_shard_numel": 0}, device="cpu", init_fn=rows)
    full = gtp_wrap.full_state_dict(model)
    want = torch.arange(3 * CFG.d, dtype=torch.float32).view(-1, 1).expand(-1, CFG.d)
    return [(full["blocks.0.attn.qkv.weight"] - want).abs().max().item()]


def test_init_fn_writes_each_ranks_part_at_its_offset() -> None:
    for r in run_ranks(_custom, 2):
        assert r == [0.0]


def test_readme_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Models larger than one device", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    assert (tmp_path / "gpt.safetensors").stat().st_size > 0


def _graphed_training(rank: int, world: int, meta: bool) -> dict:
    """4 graph_step steps (bf16, AdamW in the graph) of a GPT built on the GPU, whole or on
    the meta device."""
    import torch.nn.functional as F

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    with torch.device("meta" if meta else device):
        model = GPT(CFG)
    policy = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    GTPWrap(model, policy, **({"device": device} if meta else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, capturable=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    run = gtp_wrap.graph_step(model, step, warmup=2)
    losses = []
    for i in range(4):
        idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(i))
        idx = idx.to(device)
        losses.append(run(idx[:, :-1], idx[:, 1:]).item())
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": {k: v.cpu() for k, v in
                                        gtp_wrap.full_state_dict(model).items()}}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_meta_on_the_gpu_is_the_gpu_build_and_graphs() -> None:
    """On a GPU the replay draws from the GPU's generator, as a build there does: the same
    weights, and the same graphed training."""
    meta = run_ranks(_graphed_training, 1, True, backend="nccl")[0]
    whole = run_ranks(_graphed_training, 1, False, backend="nccl")[0]
    assert meta["losses"] == whole["losses"]
    for k, v in whole["state"].items():
        assert torch.equal(meta["state"][k], v), k


def _checkpoint_round_trip(rank: int, world: int, root: str) -> bool:
    """A meta-built model trains a step, saves; another meta-built one (other seed) loads it."""
    import torch.nn.functional as F

    def meta_model(seed: int) -> GPT:
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = GPT(CFG)
        return GTPWrap(model, {"min_shard_numel": 0}, device="cpu")  # type: ignore[return-value]

    model = meta_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(rank))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    opt.step()
    saved = gtp_wrap.checkpoint.save(Path(root), model, opt, step=1)
    other = meta_model(1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    gtp_wrap.checkpoint.load(saved, other, other_opt)
    want = gtp_wrap.full_state_dict(model)
    return all(torch.equal(v, want[k]) for k, v in gtp_wrap.full_state_dict(other).items())


def test_meta_built_models_checkpoint_and_load(tmp_path: Path) -> None:
    assert all(run_ranks(_checkpoint_round_trip, 2, str(tmp_path)))


class _Attention(nn.Module):
    """torch's attention (its init is `_reset_parameters`), a Linear registered twice."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4)
        self.shared = nn.Linear(32, 32)
        self.again = self.shared
        self.out = nn.Linear(32, 16)


class _MaskInConstructor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))


class _ParentInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 64)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.lin.weight)  # a child's weight, from the parent


def _unusual(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = _Attention()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _Attention()
    GTPWrap(model, {"min_shard_numel": 0, "rules": [{"match": "Linear"},
                                                     {"match": "MultiheadAttention"}]},
            device="cpu")  # fmt: skip
    full = gtp_wrap.full_state_dict(model)
    out = {"attention": [k for k, v in ref.state_dict().items() if not torch.equal(full[k], v)]}
    for name, make in (("mask", _MaskInConstructor), ("parent", _ParentInit)):
        torch.manual_seed(0)
        with torch.device("meta"):
            built = make()
        out[name] = caught(lambda b=built: GTPWrap(b, {"min_shard_numel": 0}, device="cpu"))
    return out


def test_unusual_inits_replayed_or_refused() -> None:
    """torch's attention and a module registered twice are replayed exactly; an init written
    only in a constructor, or a parent's init of its child's weights, is refused by name."""
    for r in cached_ranks(_unusual, 2):
        assert r["attention"] == []
        assert "left ['mask'] uninitialized" in r["mask"]
        assert "the init of _ParentInit '' writes weights of its submodules" in r["parent"]


def test_load_pretrained_refuses_an_unwrapped_meta_model(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = GPT(CFG)
    with pytest.raises(gtp_wrap.CheckpointError, match="on the meta device: wrap it first"):
        gtp_wrap.load_pretrained(model, tmp_path)


def _tied_in_a_world_of_one(rank: int, world: int) -> list[str]:
    """A world of one rank (torch.distributed initialized): the tied head's init restages the
    embedding it shares, gathered over a group of one."""
    ref = _built(MODELS["gpt"], meta=False)
    model = GTPWrap(_built(MODELS["gpt"], meta=True), {"min_shard_numel": 0}, device="cpu")
    full = gtp_wrap.full_state_dict(model)
    return [k for k, v in ref.state_dict().items() if not torch.equal(full[k], v)]


def test_a_world_of_one_rank() -> None:
    assert run_ranks(_tied_in_a_world_of_one, 1) == [[]]
