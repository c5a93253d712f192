"""gtp_wrap.optim.Muon: torch.optim.Muon (+ AdamW) in one process; on sharded weights, each
matrix orthogonalized once per step by one owner with two collectives per step, matching the
single-process optimizers; its momentum checkpointed and resharded."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import cached_ranks, local_rows, mesh_2d, optimizer_full, run_ranks

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.optim import Muon, muon_param_groups
from gtp_wrap.optim.newton_schulz import orthogonalize

# vocab 66: the embedding's rows do not divide by 4 (padding); per block, two same-shape
# matrices (gate, up) and two layers of each: batched orthogonalizations.
CFG = GPTConfig(vocab=66, d=32, layers=2, heads=4, ffn=48, max_seq=16)
# The 32 x 32 attention outputs (1024 elements) stay replicated: matrices with an owner too.
POLICY = {"min_shard_numel": 1100}
LR = 0.02


def _reference(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's own: Muon on the >= 2-D parameters, AdamW (Muon's defaults for it) on the rest."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [
        torch.optim.Muon(matrices, lr=LR),
        torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
    ]


def _loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (rows, 9), generator=torch.Generator().manual_seed(step))


def test_one_process_is_torch_muon_plus_adamw() -> None:
    torch.manual_seed(0)
    model, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(model.state_dict())
    opt, refs = Muon(model.parameters(), lr=LR), _reference(ref)
    for step in range(3):
        _loss(model, _batch(step, 4)).backward()
        _loss(ref, _batch(step, 4)).backward()
        for o in (opt, *refs):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert opt.orthogonalized == 3 * sum(p.ndim >= 2 for p in model.parameters())


def test_batched_newton_schulz_is_torchs_per_matrix() -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(3, 40, 24)
    want = torch.stack([_zeropower_via_newtonschulz(m, (3.4445, -4.775, 2.0315), 5, 1e-7)
                        for m in g])  # fmt: skip
    assert torch.equal(orthogonalize(g, (3.4445, -4.775, 2.0315), 5, 1e-7), want)


@contextlib.contextmanager
def _counting_collectives() -> Iterator[list[str]]:
    """Every torch.distributed collective called inside, by name."""
    names = ["all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
             "broadcast", "reduce_scatter_tensor", "scatter", "gather"]  # fmt: skip
    calls: list[str] = []
    saved = {n: getattr(dist, n) for n in names}

    def counted(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counted(n))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _train(rank: int, world: int, dp: int, given_grads: bool) -> dict:
    """3 steps of Muon on the wrapped model (dp x gtp), against torch's optimizers on the
    unwrapped one trained on every rank's batch; with `given_grads`, both are handed the same
    gradients instead (each rank its box of them), so that every input of Newton-Schulz is
    the same bit for bit."""
    mesh = mesh_2d(dp, world // dp) if dp > 1 else None
    torch.manual_seed(0)
    model, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(model.state_dict())
    GTPWrap(model, POLICY, mesh=mesh)
    opt, refs = Muon(model.parameters(), lr=LR), _reference(ref)
    collectives = []
    for step in range(3):
        if given_grads:
            g = torch.Generator().manual_seed(step)
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = torch.randn(q.shape, generator=g)
                p.grad = local_rows(p, q.grad).clone()
        else:
            idx = _batch(step, 2 * world)
            _loss(model, idx[2 * rank : 2 * rank + 2]).backward()
            _loss(ref, idx).backward()
        with _counting_collectives() as calls:
            opt.step()
        collectives.append(len(calls))
        for o in refs:
            o.step()
        for o in (opt, *refs):
            o.zero_grad()
    full = gtp_wrap.full_state_dict(model)
    with torch._C.DisableTorchFunctionSubclass():
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "diff": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
        "local": local,
        "orthogonalized": opt.orthogonalized,
        "matrices": sum(p.ndim >= 2 for p in ref.parameters()),
        "collectives": collectives,
        "load": opt.ns_load(),
        "replicated": [n for n, p in model.named_parameters()
                       if type(getattr(p, "gtp_weight", None)).__name__ != "ShardedWeight"],
    }  # fmt: skip


def _meshes(rank: int, world: int) -> dict:
    return {
        (dp, given): _train(rank, world, dp, given)
        for dp in ((1,) if world == 2 else (1, 2))
        for given in (True, False)
    }


@pytest.mark.parametrize("world,dp", [(2, 1), (4, 1), (4, 2)])
def test_owners_match_torch_muon_with_two_collectives_per_step(world: int, dp: int) -> None:
    spawned = cached_ranks(_meshes, world, timeout=300.0)
    results = [r[dp, True] for r in spawned]
    for r in results:
        assert r["diff"] == 0.0  # the same gradients: torch's values, bit for bit
        assert r["collectives"] == [2, 2, 2]  # one all-to-all each way, for every matrix
    for r in (r[dp, False] for r in spawned):
        # Trained: GTP's reduce-scatter sums the gradients in another order than one process
        # does; Newton-Schulz rounds its input to bf16, where an element may then round to the
        # neighbouring value (a relative 4e-3 of it), and AdamW's normalized step turns the
        # sign of a near-zero gradient into a whole lr. The weights agree to 1e-4 .. 2e-3,
        # depending on the CPU's kernels; the case above, with the same gradients, is exact.
        assert r["diff"] < 5e-3, r["diff"]
    # Each matrix orthogonalized once per step, over all ranks together.
    assert sum(r["orthogonalized"] for r in results) == 3 * results[0]["matrices"]
    # Owners balanced as greedy scheduling promises: the most loaded rank carries at most one
    # matrix's cost (the costliest, 3 x 32 x 32^2 here) more than the least loaded one.
    load = results[0]["load"]
    assert len(load) == world and sum(load) > 0
    assert max(load) - min(load) <= 96 * 32 * 32
    # Replicas hold the same weights, bitwise: replicated parameters on every rank, and each
    # shard on the ranks of its dp replica group (the same gtp coordinate).
    gtp = world // dp
    for name, value in results[0]["local"].items():
        for rank, r in enumerate(results):
            holder = value if name in r["replicated"] else results[rank % gtp]["local"][name]
            assert torch.equal(r["local"][name], holder), (name, rank)


def _saved_at_two(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), POLICY)
    opt = Muon(model.parameters(), lr=LR)
    for step in range(2):
        _loss(model, _batch(10 * step + rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    gtp_wrap.checkpoint.save(Path(root), model, opt, step=2)
    return {"model": gtp_wrap.full_state_dict(model), "optim": optimizer_full(model, opt)}


def _loaded_at_four(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(1)
    model = GTPWrap(GPT(CFG), POLICY)
    opt = Muon(model.parameters(), lr=LR)
    gtp_wrap.checkpoint.load(gtp_wrap.checkpoint.latest(Path(root)), model, opt)  # type: ignore[arg-type]
    return {"model": gtp_wrap.full_state_dict(model), "optim": optimizer_full(model, opt)}


def test_momentum_reshards_from_two_ranks_to_one_and_four() -> None:
    root = tempfile.mkdtemp(prefix=f"gtp_muon_{os.getpid()}_")
    try:
        saved = run_ranks(_saved_at_two, 2, root)[0]
        assert any(k.endswith("/momentum_buffer") for k in saved["optim"])
        plain = GPT(CFG)
        opt = Muon(plain.parameters(), lr=LR)
        gtp_wrap.checkpoint.load(gtp_wrap.checkpoint.latest(Path(root)), plain, opt)  # type: ignore[arg-type]
        loaded = [{"model": plain.state_dict(), "optim": optimizer_full(plain, opt)}]
        loaded += run_ranks(_loaded_at_four, 4, root)
        for got in loaded:
            for part in ("model", "optim"):
                assert got[part].keys() == saved[part].keys()
                for k, v in saved[part].items():
                    assert torch.equal(got[part][k], v), k
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_param_groups_send_embeddings_to_adamw_by_fqn() -> None:
    model = GPT(CFG)
    groups = muon_param_groups(model, adamw=["embed.*"], lr=0.05)
    opt = Muon(groups, lr=LR)
    muon, adamw = opt.param_groups
    assert muon["use_muon"] and muon["lr"] == 0.05 and not adamw["use_muon"]
    assert model.embed.weight in adamw["params"] and adamw["weight_decay"] == 0.0
    assert adamw["betas"] == (0.9, 0.95) and adamw["eps"] == 1e-8
    with pytest.raises(ValueError, match="orthogonalizes matrices"):
        Muon([{"params": [model.norm.weight], "use_muon": True}])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_batched_newton_schulz_on_the_gpu_is_torchs_per_matrix() -> None:
    """On the GPU, whether batched GEMMs round as torch's per-matrix ones do (the owners
    orthogonalize same-shape matrices as one batch): printed, and held to bf16 rounding."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(4, 2048, 5632, device="cuda")
    coefficients = (3.4445, -4.775, 2.0315)
    want = torch.stack([_zeropower_via_newtonschulz(m, coefficients, 5, 1e-7) for m in g])
    got = orthogonalize(g, coefficients, 5, 1e-7)
    diff = (got.float() - want.float()).abs().max().item()
    print(f"batched NS on {torch.cuda.get_device_name()}: bitwise {torch.equal(got, want)}, "
          f"max diff {diff:.3g}")  # fmt: skip
    assert diff < 0.02  # the update's elements are ~0.01-1; one bf16 step of them at most


def _readme(rank: int, world: int) -> dict:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Muon (`gtp_wrap.optim.Muon`)", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    code = code.replace('dist.init_process_group("gloo")', "pass")
    code = code.replace("print(opt.orthogonalized", "shown = (opt.orthogonalized")
    code = code.replace("loss.backward()", "loss.backward()\n    losses.append(loss.item())")
    scope: dict = {"losses": []}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    return {"losses": scope["losses"], "shown": scope["shown"]}


def test_readme_snippet_runs_muon_on_two_ranks() -> None:
    results = run_ranks(_readme, 2)
    matrices = 2 * 5  # qkv, o, gate, up, down per block; the embedding (tied head) on AdamW
    assert sum(r["shown"][0] for r in results) == 3 * matrices
    for r in results:
        assert len(r["losses"]) == 3 and r["shown"][1] == 6 and len(r["shown"][2]) == 2


def test_named_parameters_and_sets() -> None:
    model = GPT(CFG)
    opt = Muon(model.named_parameters(), lr=LR)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[0]["param_names"][0] == "embed.weight"
    with pytest.raises(TypeError, match="ordered collection"):
        Muon(set(model.parameters()))
