"""Expert stacks over the expert mesh (policy moe): sharded over egtp, partitioned over ep with
tokens exchanged by all-to-all, against the unwrapped reference MoE trained on every rank's
batch; one gather per stack per pass whatever the routing; checkpoints resharded between expert
shapes; and the configurations refused at wrap."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import cached_ranks, caught, expert_gathers_per_pass, run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.config.policy import resolve_policy

CFG = GPTConfig(vocab=64, d=32, layers=2, heads=4, ffn=48, max_seq=16, experts=4, top_k=2,
                moe_ffn=16, shared_expert=True)  # fmt: skip
MOE = resolve_policy(Path(__file__).parents[1] / "configs" / "policy" / "moe.yaml")
POLICY = {
    "rules": MOE.rules,
    "gather_per_block": MOE.gather_per_block,
    "expert_parallel": MOE.expert_parallel,
    "min_shard_numel": 0,
}
STACKS = ("gate_up", "down")


def _route(model: nn.Module, rank: int, skew: str) -> list:
    """Routing that differs per rank: under "rank0", rank 0 sends its tokens to experts 0 and 1
    only (the others route as the router says); under "first", every rank does, so the ranks
    holding experts 2 and 3 get no token at all."""
    bias = torch.zeros(CFG.experts)
    if rank == 0 or skew == "first":
        bias[:2] = torch.tensor([30.0, 20.0])
    return [b.mlp.router.register_forward_hook(lambda m, i, o: o + bias) for b in model.blocks]


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()) + model.aux_loss()


def _train(rank: int, world: int, dense: tuple[int, int], ep: int, egtp: int, skew: str) -> dict:
    """3 AdamW steps with clipping on a (dp, gtp) x (edp, ep, egtp) mesh against the unwrapped
    model trained on every rank's batch (each routed as its rank routes it)."""
    mesh, expert_mesh = gtp_wrap.make_mesh(dp=dense[0], gtp=dense[1], ep=ep, egtp=egtp)
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(0)
    ref = GPT(CFG)
    GTPWrap(model, POLICY, mesh=mesh, expert_mesh=expert_mesh)
    _route(model, rank, skew)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        if step == 1:  # the chains are recorded: count the steps that follow them
            gtp_wrap.reset_stats(model)
        idx = torch.randint(0, CFG.vocab, (2 * world, 9),
                            generator=torch.Generator().manual_seed(step))  # fmt: skip
        _loss(model, idx[rank * 2 : rank * 2 + 2]).backward()
        total = torch.zeros(())
        for r in range(world):
            hooks = _route(ref, r, skew)
            total = total + _loss(ref, idx[r * 2 : r * 2 + 2]) / world
            for h in hooks:
                h.remove()
        total.backward()
        norms.append(
            (gtp_wrap.clip_grad_norm_(model, 1.0).item(),
             torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        )  # fmt: skip
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full, want = gtp_wrap.full_state_dict(model), ref.state_dict()
    per_pass = expert_gathers_per_pass(model)
    w = next(w for w in engine_of(model).weights if w.fqn == "blocks.0.mlp.experts.gate_up")
    stats = gtp_wrap.stats(model)
    return {
        "expert_gathers": (stats["expert_gathers"], stats["prefetched_expert_gathers"]),
        "diff": max((full[k] - v).abs().max().item() for k, v in want.items()),
        "norms": norms,
        "per_pass": per_pass,
        "group": (w.axis.name, w.axis.size, w.replicas.name, w.replicas.size),
        "local_shape": list(w.param.shape),
        "dtensor": list(model.state_dict()["blocks.0.mlp.experts.gate_up"].shape),
        "tokens": model.tokens_per_expert().tolist(),
    }


# (dense (dp, gtp), ep, egtp, skew): every expert shape of the issue on 2 and 4 ranks.
TWO = {
    "egtp2": ((1, 2), 1, 2, "rank0"),
    "ep2": ((1, 2), 2, 1, "rank0"),
}
FOUR = {
    "ep2_egtp2": ((2, 2), 2, 2, "rank0"),
    "ep2_edp2": ((1, 4), 2, 1, "first"),
    "egtp2_edp2": ((2, 2), 1, 2, "rank0"),
}


def _cases(rank: int, world: int) -> dict:
    cases = TWO if world == 2 else FOUR
    return {name: _train(rank, world, *case) for name, case in cases.items()}


@pytest.mark.parametrize("world,name", [(2, n) for n in TWO] + [(4, n) for n in FOUR])
def test_expert_shapes_train_exactly(world: int, name: str) -> None:
    results = cached_ranks(_cases, world, timeout=300.0)
    dense, ep, egtp, _ = (TWO if world == 2 else FOUR)[name]
    for r in (res[name] for res in results):
        assert r["diff"] < 1e-4, r["diff"]  # AdamW over 3 steps, as in test_moe
        for got, want in r["norms"]:  # clipping counts each expert shard once
            assert abs(got - want) < 1e-4 * want
        assert r["group"] == ("egtp", egtp, "edp", world // (ep * egtp))
        assert r["local_shape"] == [CFG.experts // ep, -(-2 * CFG.moe_ffn // egtp), CFG.d]
        assert r["dtensor"] == [CFG.experts, 2 * CFG.moe_ffn, CFG.d]  # the logical stack
        # One gather per stack per pass (none at all where egtp has one rank).
        once = [0] if egtp == 1 else [1]
        assert r["per_pass"] == {"PassKind.FORWARD": once, "PassKind.BACKWARD": once}
        # 2 steps x 2 passes x 2 layers x 2 stacks, each issued ahead of its use (the
        # previous chain group's first use issued it: attention's, or the previous layer's).
        assert r["expert_gathers"] == ((0, 0) if egtp == 1 else (16, 16))


def test_a_rank_whose_experts_get_no_token_still_trains_them_to_zero_gradient() -> None:
    """Under "first" every token goes to experts 0 and 1 (ep rank 0): ep rank 1's experts get
    none, and training still matches the reference (above); here, that the routing did."""
    for res in cached_ranks(_cases, 4, timeout=300.0):
        for block in res["ep2_edp2"]["tokens"]:
            assert block[2:] == [0, 0] and sum(block) > 0


def _reshard(rank: int, world: int) -> dict:
    """Save at ep2 x egtp2 after a step, load at egtp4, into the unwrapped model, and back from
    egtp4 into ep2 x egtp2: the weights and the optimizer state, checked by a further step."""
    root = Path(tempfile.gettempdir()) / f"gtp_experts_ckpt_{os.getppid()}"
    out = {}

    def wrapped(ep: int, egtp: int) -> tuple[GPT, torch.optim.Optimizer]:
        mesh, expert_mesh = gtp_wrap.make_mesh(gtp=4, ep=ep, egtp=egtp)
        torch.manual_seed(0)
        model = GTPWrap(GPT(CFG), POLICY, mesh=mesh, expert_mesh=expert_mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)  # type: ignore[return-value]

    def step(model: GPT, opt: torch.optim.Optimizer, seed: int) -> None:
        idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
        _loss(model, idx).backward()
        opt.step()
        opt.zero_grad()

    a, a_opt = wrapped(2, 2)
    step(a, a_opt, rank)
    saved = gtp_wrap.checkpoint.save(root / "a", a, a_opt, step=1)
    b, b_opt = wrapped(1, 4)
    gtp_wrap.checkpoint.load(saved, b, b_opt)
    plain = GPT(CFG)
    gtp_wrap.checkpoint.load(saved, plain)
    want = gtp_wrap.full_state_dict(a)
    out["into_egtp4"] = max((gtp_wrap.full_state_dict(b)[k] - v).abs().max().item()
                            for k, v in want.items())  # fmt: skip
    out["into_plain"] = all(torch.equal(plain.state_dict()[k], v) for k, v in want.items())
    step(a, a_opt, 10 + rank)
    step(b, b_opt, 10 + rank)
    want = gtp_wrap.full_state_dict(a)
    out["stepped"] = max((gtp_wrap.full_state_dict(b)[k] - v).abs().max().item()
                         for k, v in want.items())  # fmt: skip
    saved = gtp_wrap.checkpoint.save(root / "b", b, b_opt, step=2)
    c, c_opt = wrapped(2, 2)
    gtp_wrap.checkpoint.load(saved, c, c_opt)
    want = gtp_wrap.full_state_dict(b)
    out["back"] = max((gtp_wrap.full_state_dict(c)[k] - v).abs().max().item()
                      for k, v in want.items())  # fmt: skip
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


def test_checkpoints_reshard_between_expert_shapes() -> None:
    for r in run_ranks(_reshard, 4, timeout=300.0):
        assert r["into_egtp4"] == 0.0 and r["into_plain"] and r["back"] == 0.0
        assert r["stepped"] < 1e-6  # the optimizer state came along


def _meshes_under_meta() -> str:
    """Both meshes, made where a model to wrap on the meta device is built."""
    with torch.device("meta"):
        return caught(lambda: gtp_wrap.make_mesh(gtp=2, ep=2, layout="gtp_outer"))


def _refused(rank: int, world: int) -> dict:
    mesh, expert_mesh = gtp_wrap.make_mesh(gtp=2, ep=2)
    three = dataclasses.replace(CFG, experts=6)
    three_ep = gtp_wrap.make_mesh(gtp=2, ep=2)
    no_ep_module = {**POLICY, "expert_parallel": ["Attention"]}
    return {
        "odd_experts": caught(lambda: GTPWrap(GPT(dataclasses.replace(CFG, experts=3)),
                                              POLICY, mesh=mesh, expert_mesh=expert_mesh)),
        "too_big": caught(lambda: gtp_wrap.make_mesh(gtp=2, ep=4)),
        "not_dividing": caught(lambda: gtp_wrap.make_mesh(gtp=2, ep=1, egtp=3)),
        "layout": caught(lambda: gtp_wrap.make_mesh(gtp=2, layout="diagonal")),
        "under_meta": _meshes_under_meta(),
        "names": caught(lambda: GTPWrap(GPT(CFG), POLICY, mesh=mesh, expert_mesh=mesh)),
        "no_module": caught(lambda: GTPWrap(GPT(CFG), no_ep_module, mesh=mesh,
                                            expert_mesh=expert_mesh)),
        "none": caught(lambda: GTPWrap(GPT(CFG), {**POLICY, "expert_parallel": []}, mesh=mesh,
                                       expert_mesh=expert_mesh)),
        "per_block": caught(lambda: GTPWrap(GPT(CFG), {**POLICY, "gather_per_block": ["Experts"]},
                                            mesh=mesh, expert_mesh=expert_mesh)),
        "later_per_block": caught(lambda: gtp_wrap.gather_per_block(
            GTPWrap(GPT(CFG), POLICY, mesh=mesh, expert_mesh=expert_mesh), "Experts")),
        "fine": caught(lambda: GTPWrap(GPT(three), POLICY, mesh=three_ep[0],
                                       expert_mesh=three_ep[1])),
    }  # fmt: skip


def test_bad_expert_meshes_are_refused_at_wrap() -> None:
    r = cached_ranks(_refused, 2)[0]
    assert "cannot be split over ep=2" in r["odd_experts"] and "multiple of ep" in r["odd_experts"]
    for refused in (r["too_big"], r["not_dividing"]):
        assert refused.startswith("WrapError") and "ep x egtp must divide the world of 2" in refused
    assert "layout='diagonal' is not one of gtp_inner, gtp_outer" in r["layout"]
    assert r["under_meta"] == "no error"
    assert "dims named from ('edp', 'ep', 'egtp')" in r["names"]
    assert "not among the policy's expert_parallel ['Attention']" in r["no_module"]
    assert "no module matches the policy's expert_parallel []" in r["none"]
    assert (
        "'blocks.0.mlp.experts' is in the policy's expert_parallel and gather_per_block"
        in (r["per_block"])
    )
    assert "exchanges its tokens over ep" in r["later_per_block"]
    assert r["fine"] == "no error"


def test_egtp_rules_are_checked_when_made() -> None:
    with pytest.raises(gtp_wrap.PolicyError, match="group='ep'"):
        gtp_wrap.LayerRule("*.experts.*", group="ep")  # type: ignore[arg-type]
    with pytest.raises(gtp_wrap.PolicyError, match="must shard"):
        gtp_wrap.LayerRule("*.experts.*", action="replicate", group="egtp")
    with pytest.raises(gtp_wrap.PolicyError, match="expert_parallel must be a list"):
        gtp_wrap.GTPPolicy(expert_parallel="Experts")  # type: ignore[arg-type]


def _readme(rank: int, world: int, shape: str) -> tuple[list[float], str]:
    """The README's expert-parallelism snippet (the process group is the harness's), at its
    own ep2 x egtp2 or with the experts over egtp4: the losses and describe's table."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Expert parallelism and the expert group", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    code = code.replace('dist.init_process_group("gloo")', "pass")
    code = code.replace("ep=2, egtp=2", shape)
    code = code.replace("print(gtp_wrap.describe(model))", "table = str(gtp_wrap.describe(model))")
    code = code.replace(".backward()", ".backward()\n    losses.append(loss.item())")
    scope: dict = {"losses": []}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    return scope["losses"], scope["table"]


def _readme_both(rank: int, world: int) -> list:
    return [_readme(rank, world, "ep=2, egtp=2"), _readme(rank, world, "ep=1, egtp=4")]


def test_readme_snippet_trains_as_the_expert_group_alone() -> None:
    """ep2 x egtp2 takes the steps that egtp4 takes (the same data ranks, the same model)."""
    both = run_ranks(_readme_both, 4)
    ep, alone = [r[0] for r in both], [r[1] for r in both]
    for (losses, table), (want, _) in zip(ep, alone):
        assert len(losses) == 3 and losses == pytest.approx(want, rel=1e-5)
        row = next(line for line in table.splitlines() if "experts.gate_up" in line)
        assert "4x64x64  shard(1), ep S(0) over 2  float32  float32  egtp=2" in row
        gathered = r"experts.gate_up +4x64x64 +shard\(1\) +float32 +float32 +egtp=4"
        assert re.search(gathered, alone[0][1])


def _failing_peer(rank: int, world: int) -> str:
    """Rank 1 raises in its router at the second step and stays alive: rank 0, in the token
    all-to-all by then, must name the failure instead of waiting for it."""
    mesh, expert_mesh = gtp_wrap.make_mesh(gtp=2, ep=2)
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), POLICY, mesh=mesh, expert_mesh=expert_mesh)
    idx = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    _loss(model, idx).backward()
    if rank == 1:

        def fail(*_: object) -> None:
            raise ValueError("a bad batch on rank 1")

        model.blocks[0].mlp.router.register_forward_hook(fail)
    began = time.monotonic()
    try:
        _loss(model, idx).backward()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the test asserts on the name and message
        if rank == 1:
            time.sleep(8)  # alive: rank 0 must learn of the failure, not of a closed socket
        return f"{time.monotonic() - began:.1f} {type(e).__name__}: {e}"


_failing_peer.leaves_group_broken = True  # type: ignore[attr-defined]


def test_a_peer_failing_before_the_token_exchange_is_named() -> None:
    first, second = run_ranks(_failing_peer, 2, timeout=120.0)
    assert "ValueError: a bad batch on rank 1" in second
    seconds, error = first.split(" ", 1)
    assert error.startswith("PeerFailedError") and "rank 1" in error, error
    assert float(seconds) < 8  # named while rank 1 still lives


def _chains_of_small_groups(rank: int, world: int) -> dict:
    """group_numel=0 (a collective per weight) still gathers a layer's stacks as one; and how
    far each use's prefetch reaches (the MoE layers run on gathered weights)."""
    torch.manual_seed(0)
    model = GTPWrap(GPT(CFG), {**POLICY, "group_numel": 0})
    for step in range(2):
        _loss(model, _batch(step)).backward()
    engine = engine_of(model)
    out: dict = {"reach": {}}
    for key, chain in engine.passes.chains.items():
        groups: dict[int, list[str]] = {}
        for position, index in enumerate(chain.order):
            groups.setdefault(chain.group_of[position], []).append(engine.weights[index].fqn)
        out[str(key[0])] = [g for g in groups.values() if any(".experts." in f for f in g)]
        # per use: (weight, its group, the last group of the block call its prefetch reaches)
        out["reach"][key[0].value] = [
            (engine.weights[index].fqn, chain.group_of[p], chain.reach[p])
            for p, index in enumerate(chain.order)
        ]
    return out


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


def test_a_moe_block_prefetches_the_whole_next_block() -> None:
    """Each MoE layer runs on gathered weights and is three groups (router, expert stacks over
    egtp, shared expert); while one runs, the prefetch reaches to the end of the next one's
    call (runtime/chain.py, Chain.reach), in both passes; after the last, nothing more."""
    for r in cached_ranks(_chains_of_small_groups, 2):
        for kind, uses in r["reach"].items():
            group = {name: g for name, g, _ in uses}
            last_of = {i: group[f"blocks.{i}.mlp.shared.down.weight"] for i in (0, 1)}
            first, second = (0, 1) if kind == "forward" else (1, 0)
            for name, _, reach in uses:
                if name.startswith(f"blocks.{first}.mlp."):
                    assert reach == last_of[second], (kind, name)
                if name.startswith(f"blocks.{second}.mlp."):
                    assert reach == -1, (kind, name)
            stacks = [g for name, g, _ in uses if ".experts." in name]
            assert len(set(stacks)) == 2  # a layer's two stacks, one group


def test_a_layers_expert_stacks_are_one_collective_whatever_group_numel() -> None:
    for r in cached_ranks(_chains_of_small_groups, 2):
        for key, groups in r.items():
            if key == "reach":
                continue
            assert sorted(sorted(g) for g in groups) == [
                [f"blocks.{i}.mlp.experts.down", f"blocks.{i}.mlp.experts.gate_up"] for i in (0, 1)
            ]


def _compiled_ep(rank: int, world: int) -> dict:
    """3 AdamW steps of the MoE GPT at ep 2, eager and under gtp_wrap.compile, each step on new
    tokens (a new routing): the losses, Dynamo's compiled frames after each step, and the
    warnings compiling raised."""
    out: dict = {}
    for compiled in (False, True):
        mesh, expert_mesh = gtp_wrap.make_mesh(gtp=2, ep=2)
        torch.manual_seed(0)
        model = GTPWrap(GPT(CFG), POLICY, mesh=mesh, expert_mesh=expert_mesh)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        if compiled:
            gtp_wrap.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1 + rank)
        losses, frames = [], []
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            for _ in range(3):
                loss = _loss(model, torch.randint(0, CFG.vocab, (2, CFG.max_seq), generator=data))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                frames.append(torch._dynamo.utils.counters["frames"]["total"])
        out[compiled] = {"losses": losses, "frames": frames,
                         "warnings": [str(w.message) for w in caught_warnings]}  # fmt: skip
    return out


def test_a_compiled_expert_parallel_moe_compiles_once_whatever_the_routing() -> None:
    """Traced by Dynamo, the token exchange broke the graph at the watch's clock (a warning on
    every run) and the experts after it compiled again for each new token count (found by a
    new user). The dispatch runs eager: the first step's graphs serve every later routing."""
    for r in run_ranks(_compiled_ep, 2):
        eager, compiled = r[False], r[True]
        assert compiled["frames"][0] > 0, compiled
        assert compiled["frames"] == [compiled["frames"][0]] * 3, compiled["frames"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert not [w for w in compiled["warnings"] if "Dynamo" in w], compiled["warnings"]


BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _precisions_beside_local_weights(rank: int, world: int, layout: str) -> dict:
    """3 AdamW steps, per precision policy, where one kind of weight is sharded over a group of
    one and gathers nothing: the expert stacks ("local_experts": ep 2, egtp 1, beside dense
    weights over gtp 2) or the dense weights ("local_dense": dp 2, gtp 1, beside expert stacks
    over egtp 2). The losses, the bytes gathered, the memory of the compute copies, the local
    weights' shard bytes in bf16, whether each local weight's copy is its shard in bf16 after
    the steps, and the warnings of the wrap."""
    dense, ep, egtp = {"local_experts": ((1, 2), 2, 1), "local_dense": ((2, 1), 1, 2)}[layout]
    out = {}
    for name, extra in {
        "bf16": BF16,
        "bf16_copy": BF16 | {"compute_copy": True},
        "fp8": BF16 | {"gather_dtype": "fp8"},
        "fp8_gemm": BF16 | {"gather_dtype": "fp8", "fp8_matmul": True},
        "nvfp4": BF16 | {"gather_dtype": "nvfp4"},
    }.items():
        mesh, expert_mesh = gtp_wrap.make_mesh(dp=dense[0], gtp=dense[1], ep=ep, egtp=egtp)
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as wrap_warnings:
            warnings.simplefilter("always")
            model = GTPWrap(GPT(CFG), POLICY | extra, mesh=mesh, expert_mesh=expert_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            idx = torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(step))
            loss = _loss(model, idx[rank * 2 : rank * 2 + 2])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        engine = engine_of(model)
        engine.casts.refresh()  # as the next pass would begin
        local = [w for w in engine.weights if w.axis.size == 1]
        with torch._C.DisableTorchFunctionSubclass():
            fresh = all(torch.equal(w.local, w.param.to(torch.bfloat16)) for w in local)
        out[name] = {
            "losses": losses,
            "gathered": gtp_wrap.stats(model)["bytes_gathered"],
            "fp8_matmuls": gtp_wrap.stats(model)["fp8_matmuls"],
            "copy_bytes": engine.casts.storage.copy_bytes,
            "local_bf16_bytes": sum(2 * w.geometry.slot_numel for w in local),
            "fresh": fresh,
            "warnings": [str(w.message) for w in wrap_warnings],
            "gathers": {row.gathers for row in gtp_wrap.describe(model).rows if row.sharded},
        }
    return out


@pytest.mark.parametrize("layout", ["local_experts", "local_dense"])
def test_gathers_and_copies_are_chosen_per_weight_beside_a_group_of_one(layout: str) -> None:
    """Expert stacks over egtp = 1 gather nothing; the dense weights beside them over gtp = 2
    do (and the other way round). Precision was chosen for the engine from its smallest group:
    fp8 and nvfp4 gathers were refused, and bf16 kept a compute copy of every shard (found by
    a new user). Now only the weights over a group of one keep a copy, current after every
    step, and the others gather packed slots."""
    for r in run_ranks(_precisions_beside_local_weights, 2, layout):
        bf16, kept = r["bf16"], r["bf16_copy"]
        assert bf16["losses"] == kept["losses"]  # the same bf16 values, cast on the way
        tail = bf16["copy_bytes"] - bf16["local_bf16_bytes"]  # the flat's end, on 128 elements
        assert bf16["local_bf16_bytes"] > 0 and 0 <= tail < 2 * 128
        assert kept["copy_bytes"] > bf16["copy_bytes"]  # the gathered shards' copy too
        assert bf16["gathered"] == kept["gathered"]
        for packed, ratio in (("fp8", 1.031 / 2), ("nvfp4", 0.5628 / 2)):
            got = r[packed]
            assert got["gathered"] == pytest.approx(ratio * bf16["gathered"], rel=0.03), packed
            assert got["copy_bytes"] == bf16["copy_bytes"]  # the local weights' copy only
            assert got["losses"] == pytest.approx(bf16["losses"], rel=2e-2), packed
        assert all(case["fresh"] for case in r.values())
        for case, wire in (("bf16", "bfloat16"), ("fp8", "fp8"), ("nvfp4", "nvfp4")):
            assert r[case]["gathers"] == {wire, None}, r[case]["gathers"]  # None: group of one
        local_linears = "keep bf16 GEMMs, because they are sharded over a group of one rank"
        warned = any(local_linears in w for w in r["fp8_gemm"]["warnings"])
        assert warned == (layout == "local_dense"), r["fp8_gemm"]["warnings"]
        assert (r["fp8_gemm"]["fp8_matmuls"] > 0) == (layout == "local_experts")
