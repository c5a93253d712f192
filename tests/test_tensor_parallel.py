"""GTP over torch's tensor parallelism: a ("gtp", "tp") or ("dp", "gtp", "tp") mesh, weights
that `parallelize_module` made DTensors sharded over gtp from their tp-local tensors, against a
single-process reference: 3 AdamW steps, the weights after them, the clipped norm, the state
dict's round trip, and the mistakes refused at wrap."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from harness import cached_ranks, caught, optimizer_full, run_ranks
from models import tiny_llama_config
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import gtp_wrap
from gtp_wrap import GTPWrap, checkpoint
from gtp_wrap.app.model import GPT, GPTConfig, tensor_parallel_plan
from gtp_wrap.app.train import CONFIG_DIR
from gtp_wrap.config.policy import LayerRule, resolve_policy
from gtp_wrap.runtime.engine import is_wrapped

# ffn=42: 21 rows of the MLP's weights per tp rank, which 2 gtp ranks split 11 / 10 (padded).
CFG = GPTConfig(vocab=64, d=32, layers=2, heads=4, ffn=42, max_seq=16)
POLICY: dict[str, Any] = {"min_shard_numel": 0}
# configs/policy/tp.yaml, the `tp` rules applying the plan below with sequence parallelism.
TP_POLICY = {"rules": resolve_policy(f"{CONFIG_DIR}/policy/tp.yaml").rules, "min_shard_numel": 0}
# The tp policy without its rule for the final norm, which runs on the split stream.
NO_FINAL_NORM_RULE = {
    "rules": [r for r in TP_POLICY["rules"] if r.match != "norm"],
    "min_shard_numel": 0,
}
CFG_ODD = GPTConfig(vocab=64, d=32, layers=1, heads=4, ffn=43, max_seq=16)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())


def _train(
    mesh: Any,
    sequence: bool | None,
    policy: dict,
    clip: float | None = None,
    norm_type: float = 2.0,
) -> dict:
    """3 AdamW steps of the TP + GTP model on this data rank's half of each batch and of the
    reference on the whole batch; their weights after, the first step's norm before clipping.
    `sequence`: the TP plan applied by hand (with sequence parallelism or not); None: the
    policy's `tp` rules apply it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    torch.manual_seed(0)
    ref = GPT(CFG)
    if sequence is not None:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence))
    GTPWrap(model, policy, mesh=mesh)
    data = mesh.get_local_rank("gtp") + (
        2 * mesh.get_local_rank("dp") if "dp" in mesh.mesh_dim_names else 0
    )
    ranks = mesh.size() // mesh["tp"].size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        idx = _batch(step)
        per = idx.shape[0] // ranks
        _loss(model, idx[data * per : (data + 1) * per]).backward()
        _loss(ref, idx).backward()
        if clip is not None:
            got = gtp_wrap.clip_grad_norm_(model, clip, norm_type)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, norm_type)
            norms.append((got.item(), want.item()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = gtp_wrap.full_state_dict(model)
    want = ref.state_dict()
    with torch.no_grad():
        losses = (_loss(model, _batch(9)).item(), _loss(ref, _batch(9)).item())
    return {
        "losses": losses,
        "diff": max((full[k].float() - v).abs().max().item() for k, v in want.items()),
        "keys": sorted(full) == sorted(want),
        "norms": norms,
        "model": model,
        "ref": ref,
    }


def _cases(rank: int, world: int) -> dict:
    # DTensor plans a redistribution once per layout, and logs while planning: from the start.
    with _logged("torch.distributed.tensor._redistribute") as logged:
        out = _traced_cases()
    out["redistribution_log"] = logged
    return out


def _traced_cases() -> dict:
    mesh, _ = gtp_wrap.make_mesh(gtp=2, tp=2, device_type="cpu")
    out: dict[str, Any] = {}
    for name, sequence in (("tp", False), ("sp", True)):
        r = _train(mesh, sequence, POLICY, clip=None if sequence else 0.05)
        out[name] = {k: r[k] for k in ("diff", "keys", "norms")}
        if not sequence:
            trained = r["model"]
    r = _train(mesh, None, TP_POLICY)
    out["policy"] = {k: r[k] for k in ("diff", "keys", "norms")}
    out["describe"] = str(gtp_wrap.describe(r["model"]))
    bf16 = _train(mesh, False, POLICY | {"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    out["bf16"] = bf16["losses"]
    # The state dict's round trip: the trained weights into a fresh TP + GTP model.
    torch.manual_seed(1)
    fresh = GPT(CFG)
    parallelize_module(fresh, mesh["tp"], tensor_parallel_plan(fresh))
    GTPWrap(fresh, POLICY, mesh=mesh)
    gtp_wrap.load_full_state_dict(fresh, gtp_wrap.full_state_dict(trained))
    with torch.no_grad():
        out["reloaded"] = (_loss(fresh, _batch(9)) - _loss(trained, _batch(9))).abs().item()
    out["errors"] = _errors(mesh)
    out["llama"] = _llama(mesh)
    return out


LLAMA_TP = {  # torchtitan's Llama plan, by Hugging Face's module names, without the ends
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def _llama(mesh: Any) -> float:
    """HF Llama (grouped-query attention: one kv head per tp rank) with the plan above at
    gtp2 x tp2 against the unwrapped model: the largest weight difference after 3 steps."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    torch.manual_seed(0)
    ref = LlamaForCausalLM(tiny_llama_config())
    parallelize_module(model, mesh["tp"], LLAMA_TP)
    GTPWrap(model, POLICY, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = mesh.get_local_rank("gtp")

    def loss(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=idx[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    for step in range(3):
        idx = _batch(step)
        loss(model, idx[data * 2 : data * 2 + 2]).backward()
        loss(ref, idx).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full, want = gtp_wrap.full_state_dict(model), ref.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in want.items())


def _errors(mesh: Any) -> dict[str, str]:
    def tp_model(on: Any) -> GPT:
        model = GPT(CFG)
        parallelize_module(model, on, {"blocks.0.mlp.up": ColwiseParallel()})
        return model

    def with_rule(rule: dict, cfg: GPTConfig = CFG) -> str:
        policy = {"rules": [rule, {"match": "Linear"}], "min_shard_numel": 0}
        return caught(lambda: GTPWrap(GPT(cfg), policy, mesh=mesh))

    order = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "gtp"))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    return {
        "order": caught(lambda: GTPWrap(GPT(CFG), POLICY, mesh=order)),
        "no_tp_dim": caught(lambda: GTPWrap(tp_model(mesh["tp"]), POLICY)),
        "other_mesh": caught(lambda: GTPWrap(tp_model(other["b"]), POLICY, mesh=mesh)),
        "policy_no_tp_dim": caught(lambda: GTPWrap(GPT(CFG), TP_POLICY)),
        "not_linear": with_rule({"match": "blocks.0.attn", "tp": "colwise"}),
        "indivisible": with_rule({"match": "*.mlp.up", "tp": "colwise"}, CFG_ODD),
        "no_module": with_rule({"match": "blocks.*.attn.q_proj", "tp": "colwise"}),
        "tied": with_rule({"match": "head", "tp": "colwise"}),
        "half_sequence": with_rule({"match": "*_norm", "tp": "sequence"}),
        "plain_on_stream": caught(lambda: GTPWrap(GPT(CFG), NO_FINAL_NORM_RULE, mesh=mesh)),
        "tp_unused": caught(lambda: GTPWrap(GPT(CFG), POLICY, mesh=mesh)),
        "restored": _failed_wrap_restores(mesh),
    }


def _failed_wrap_restores(mesh: Any) -> str:
    """A wrap that fails after taking the TP plan's DTensors apart gives them back: the same
    model then wraps."""
    model = GPT(CFG)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    bad = {"rules": [{"match": "nothing.here", "strict": True}, {"match": "Linear"}]}
    first = caught(lambda: GTPWrap(model, bad, mesh=mesh))
    dtensors = isinstance(model.blocks[0].attn.qkv.weight, DTensor)
    second = caught(lambda: GTPWrap(model, POLICY, mesh=mesh))
    return f"{first} | DTensor after: {dtensors} | then: {second}"


def _results() -> list[dict]:
    return cached_ranks(_cases, 4)


# AdamW divides by the root of its second moment, so weights whose gradients are near zero (a
# few of the attention's q and k rows) move by the rounding of those gradients: up to ~3e-5
# here, with or without GTP (tp alone gives the same), against steps of lr = 1e-2. With SGD
# the same runs agree to 4e-7.
ADAMW_TOLERANCE = 1e-4


@pytest.mark.parametrize("name", ["tp", "sp", "policy"])
def test_gtp_over_tensor_parallel_trains_as_the_unsharded_model(name: str) -> None:
    for r in _results():
        assert r[name]["keys"]
        assert r[name]["diff"] < ADAMW_TOLERANCE, r[name]


def test_hf_llama_with_torchtitans_tp_plan_trains_as_the_unsharded_model() -> None:
    for r in _results():
        assert r["llama"] < ADAMW_TOLERANCE


def test_clipping_counts_every_tp_and_gtp_shard_once() -> None:
    for r in _results():
        for got, want in r["tp"]["norms"]:
            assert got == pytest.approx(want, rel=1e-5)


def test_bf16_compute_over_tensor_parallel_stays_near_fp32() -> None:
    """bf16 gathers and compute over fp32 masters: after 3 steps the loss is the fp32
    reference's to bf16's precision."""
    for r in _results():
        got, want = r["bf16"]
        assert got == pytest.approx(want, rel=5e-3)


def test_full_state_dict_round_trips_through_a_fresh_tensor_parallel_model() -> None:
    """Exactly, and without DTensor's warning on every rank that its two all-gathers of a
    (_StridedShard, Shard) weight are suboptimal (see [Note: a quiet redistribution])."""
    for r in _results():
        assert r["reloaded"] == 0.0
        assert r["redistribution_log"] == []


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The messages logger `name` emits inside the block, at any level."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def test_tensor_parallel_mistakes_are_refused_at_wrap() -> None:
    errors = _results()[0]["errors"]
    assert "WrapError" in errors["order"] and "in that order (tp innermost)" in errors["order"]
    assert "WrapError" in errors["no_tp_dim"] and "'blocks.0.mlp.up.weight'" in errors["no_tp_dim"]
    assert "has no 'tp' dim" in errors["no_tp_dim"]
    assert "WrapError" in errors["other_mesh"] and "not on the 'tp' dim" in errors["other_mesh"]


def test_policy_tp_rules_mark_each_weight_in_describe() -> None:
    table = _results()[0]["describe"]
    assert "blocks.0.attn.qkv.weight    96x32  shard(0), tp S(0)" in table
    assert "blocks.0.attn.o.weight      32x32  shard(0), tp S(1)" in table
    assert "blocks.0.attn_norm.weight   32     replicate, tp R" in table
    assert "gtp=2 dp=1 tp=2" in table


def test_policy_tp_mistakes_are_refused_at_wrap() -> None:
    errors = _results()[0]["errors"]
    assert "PolicyError" in errors["policy_no_tp_dim"]
    assert "the mesh has no 'tp' dim" in errors["policy_no_tp_dim"]
    assert (
        "PolicyError" in errors["not_linear"]
        and "'blocks.0.attn', a Attention" in errors["not_linear"]
    )
    assert "does not divide 43" in errors["indivisible"]
    assert "'blocks.0.mlp.up.weight'" in errors["indivisible"]
    assert "matched no module" in errors["no_module"] and "q_proj" in errors["no_module"]
    assert "tied (embed.weight, head.weight)" in errors["tied"]
    assert "needs all three" in errors["half_sequence"]
    assert "'norm' (RMSNorm) holds parameters but has no tp style" in errors["plain_on_stream"]
    assert "WrapError" in errors["tp_unused"] and "no parameter of GPT" in errors["tp_unused"]
    first, dtensors, then = errors["restored"].split(" | ")
    assert first.startswith("PolicyError") and dtensors == "DTensor after: True"
    assert then == "then: no error"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": "diagonal"}, "has tp='diagonal'; use one of"),
        ({"tp": "colwise", "action": "replicate"}, "a rule with tp only gives modules"),
        ({"tp": "rowwise", "dim": 1}, "a rule with tp only gives modules"),
    ],
)
def test_bad_tp_rules_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(gtp_wrap.PolicyError, match=message):
        LayerRule(match="x", **fields)


def _three_dims(rank: int, world: int) -> dict:
    mesh, experts = gtp_wrap.make_mesh(dp=2, gtp=2, tp=2, ep=2, egtp=2, device_type="cpu")
    assert mesh.mesh_dim_names == ("dp", "gtp", "tp")
    assert experts.mesh_dim_names == ("edp", "ep", "egtp") and tuple(experts.shape) == (2, 2, 2)
    out: dict[str, Any] = {"plan": _train(mesh, False, POLICY)["diff"]}
    for norm_type in (2.0, float("inf")):  # the tp policy: sequence-parallel norms too
        r = _train(mesh, None, TP_POLICY, clip=0.05, norm_type=norm_type)
        out[f"policy_{norm_type}"] = (r["diff"], r["norms"])
    return out


def test_dp_gtp_tp_on_eight_ranks() -> None:
    """dp2 x gtp2 x tp2, by hand and by policy, with the L2 and the max norm clipped."""
    for r in run_ranks(_three_dims, 8):
        assert r["plan"] < ADAMW_TOLERANCE
        for norm_type in (2.0, float("inf")):
            diff, norms = r[f"policy_{norm_type}"]
            assert diff < ADAMW_TOLERANCE
            for got, want in norms:
                assert got == pytest.approx(want, rel=1e-5)


def _readme_snippet() -> str:
    """The code block of the README's tensor-parallelism section."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Tensor parallelism under GTP", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's tensor-parallelism section has no python block"
    return match.group(1)


def _run_readme(rank: int, world: int, with_tp: bool) -> list[float]:
    """The README's snippet (the process group is the harness's), or the same with GTP alone
    on a data rank per rank: the losses."""
    code = _readme_snippet().replace('dist.init_process_group("gloo")', "pass")
    code = code.replace("print(gtp_wrap.describe(model))", "table = str(gtp_wrap.describe(model))")
    if not with_tp:
        code = code.replace("make_mesh(gtp=2, tp=2,", "make_mesh(gtp=2,")
        code = re.sub(r' *\{"match": "[^"]*", "tp": "[a-z]*"\},\n', "", code)
    code = code.replace("loss.backward()", "loss.backward()\n    losses.append(loss.item())")
    scope: dict = {"losses": []}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    return scope["losses"], scope["table"]


def test_readme_snippet_trains_as_gtp_alone() -> None:
    """gtp2 x tp2 on 4 ranks (tensor-parallel weights, as describe shows) takes the same steps
    as gtp2 alone on 2: the same data ranks."""
    with_tp = run_ranks(_run_readme, 4, True)
    alone = run_ranks(_run_readme, 2, False)
    for rank, (losses, table) in enumerate(with_tp):
        assert "shard(0), tp S(0)" in table and "shard(0), tp S(1)" in table
        assert len(losses) == 3
        assert losses == pytest.approx(alone[rank // 2][0], rel=1e-5)
    assert "tp S" not in alone[0][1]


def _trained_with_state(mesh: Any, tp: bool) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if tp:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence=True))
    GTPWrap(model, POLICY, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _checkpoints(rank: int, world: int) -> dict:
    """Saved at gtp2 x tp2 (sequence-parallel norms too, rows not dividing by tp x gtp), loaded
    at gtp4, at dp2 x gtp1 x tp2, into the unwrapped model, and back through
    torch.distributed.checkpoint: every weight and optimizer state, bitwise."""
    root = Path(tempfile.gettempdir()) / f"gtp_tp_ckpt_{os.getppid()}"
    mesh, _ = gtp_wrap.make_mesh(gtp=2, tp=2, device_type="cpu")
    model, opt = _trained_with_state(mesh, tp=True)
    data = mesh.get_local_rank("gtp")
    for step in range(2):
        _loss(model, _batch(step)[data * 2 : data * 2 + 2]).backward()
        opt.step()
        opt.zero_grad()
    saved = checkpoint.save(root, model, opt, step=2)
    weights, state = gtp_wrap.full_state_dict(model), optimizer_full(model, opt)
    written = [
        (key, json.dumps(desc["box"]))
        for r in range(world)
        for key, desc in json.loads((saved / f"rank{r}.json").read_text())["pieces"].items()
    ]

    def same(other: nn.Module, other_opt: torch.optim.Optimizer | None) -> bool:
        got = gtp_wrap.full_state_dict(other) if is_wrapped(other) else other.state_dict()
        ok = all(torch.equal(got[k].cpu(), v) for k, v in weights.items())
        if other_opt is not None:
            got_state = optimizer_full(other, other_opt)
            ok = ok and all(torch.equal(got_state[k], v) for k, v in state.items())
        return ok

    out = {"written_once": len(written) == len(set(written))}
    gtp4, gtp4_opt = _trained_with_state(gtp_wrap.make_mesh(gtp=4, device_type="cpu")[0], tp=False)
    checkpoint.load(saved, gtp4, gtp4_opt)
    out["gtp4"] = same(gtp4, gtp4_opt)
    mesh3, _ = gtp_wrap.make_mesh(dp=2, gtp=1, tp=2, device_type="cpu")
    tp2, tp2_opt = _trained_with_state(mesh3, tp=True)
    checkpoint.load(saved, tp2, tp2_opt)
    out["tp2"] = same(tp2, tp2_opt)
    plain = GPT(CFG)
    checkpoint.load(saved, plain)
    out["unwrapped"] = same(plain, None)
    dcp_dir = root / "dcp"
    dcp.save(model.state_dict(), checkpoint_id=dcp_dir)
    again, _ = _trained_with_state(mesh, tp=True)
    target = again.state_dict()
    dcp.load(target, checkpoint_id=dcp_dir)
    again.load_state_dict(target)
    out["dcp"] = same(again, None)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out


@pytest.mark.parametrize("into", ["written_once", "gtp4", "tp2", "unwrapped", "dcp"])
def test_checkpoint_saved_at_gtp2_tp2_loads_bitwise(into: str) -> None:
    for r in cached_ranks(_checkpoints, 4):
        assert r[into], into


def _blocks(rank: int, world: int) -> dict[str, float]:
    """gather_per_block and gtp_wrap.compile over the tp policy (sequence parallelism too):
    the largest weight difference from the unwrapped model after 3 SGD steps."""
    mesh, _ = gtp_wrap.make_mesh(gtp=2, tp=2, device_type="cpu")
    out = {}
    for mode in ("blocks", "compile"):
        torch.manual_seed(0)
        model = GPT(CFG)
        torch.manual_seed(0)
        ref = GPT(CFG)
        GTPWrap(model, TP_POLICY, mesh=mesh)
        (gtp_wrap.gather_per_block if mode == "blocks" else gtp_wrap.compile)(model)
        opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (model, ref)]
        data = mesh.get_local_rank("gtp")
        for step in range(3):
            idx = _batch(step)
            _loss(model, idx[data * 2 : data * 2 + 2]).backward()
            _loss(ref, idx).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        full, want = gtp_wrap.full_state_dict(model), ref.state_dict()
        out[mode] = max((full[k] - v).abs().max().item() for k, v in want.items())
    return out


@pytest.mark.parametrize("mode", ["blocks", "compile"])
def test_blocks_on_gathered_weights_over_tensor_parallel(mode: str) -> None:
    for r in cached_ranks(_blocks, 4):
        assert r[mode] < 1e-6, r
