"""The cost model (gtp_wrap.scaling): it reproduces the stored measured runs, and its parts
behave as hand computation says (overlap along the chain, α-β collectives, memory 1/N)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gtp_wrap.scaling import Mesh, Plan, Precision, load_cluster, predict, scale
from gtp_wrap.scaling.baselines import predict_method
from gtp_wrap.scaling.chain import Stage, simulate
from gtp_wrap.scaling.cli import main
from gtp_wrap.scaling.cluster import ClusterError, Curve, Link, calibration_dir
from gtp_wrap.scaling.collectives import KINDS, collective_s
from gtp_wrap.scaling.mesh import Group, MeshError
from gtp_wrap.scaling.model import GPT_1P36B, LLAMA70B, SEED280B, ModelConfig, model_by_name
from gtp_wrap.scaling.precision import PrecisionError
from gtp_wrap.scaling.predict import (
    PlanError,
    block_stages,
    cut_groups,
    engine_s,
    step_engine_s,
    uses,
)
from gtp_wrap.scaling.validate import TARGET, check, predicted_ms

H200 = load_cluster("h200")


@pytest.mark.parametrize("name", ["h200", "h100", "cpu_gloo"])
def test_calibration_runs_are_reproduced(name: str) -> None:
    checks = [c for c in check(load_cluster(name)) if c.calibration]
    assert checks, f"{name} stores no calibration runs"
    for c in checks:
        assert abs(c.error) <= TARGET, f"{c.label()}: {c.error:+.1%}"


def test_held_out_graphed_and_batch8_h200_steps_within_target() -> None:
    """The steps the host's speed does not set are held out and within 10 %: every graphed
    step (it replays without host work per use) and every step at batch 8 with its collectives,
    80 of them. Eager steps at batch 1 move with the host, and at 125M so does batch 4 (one of
    its 15 steps is off by more: gtp_blocks, which the model has a quarter host-bound); those are
    reported. So are the faked worlds' (benchmarks/fake_world.py): without collectives to hide
    it under, the host's two-rank path sets part of even a 125M batch-8 step."""
    steady = [
        c
        for c in check(H200)
        if not c.calibration
        and c.run.get("comm") != "faked"
        and (c.run["method"].endswith("_graph") or c.run["batch"] >= 8)
    ]
    assert len(steady) == 80
    for c in steady:
        assert abs(c.error) <= TARGET, f"{c.label()}: {c.error:+.1%}"


def test_held_out_h100_graphed_and_batch_4_and_8_steps_within_target() -> None:
    """On the H100 (h100.json: one GPU's calibrate.py of 2026-12-06 22:36, its GEMM and
    attention rates fitted to the 1.36B plain step's own kernels, its host costs to that call's
    host-bound 125M batch-1 steps), every held-out graphed step and every step at batch 4 and 8
    is within 10 %, all 80 (5 predicted before they ran, results/predicted_1206), the lowest
    barely: that call's 125M batch-8 floor and gtp_blocks, −9.98 and −9.90 %. With the
    calibration before it (06:29, whose per-layer host time came from a plain step's slope),
    68 of 70 were: the host_fit_1206 call's 125M batch-8 floor and gtp_blocks steps, on a fast
    host, 12.5 % low. Batch-1 eager steps move with the host and are reported."""
    steady = [
        c
        for c in check(load_cluster("h100"))
        if not c.calibration
        and c.run.get("comm") != "faked"
        and (c.run["method"].endswith("_graph") or c.run["batch"] >= 4)
    ]
    assert len(steady) == 80
    for c in steady:
        assert abs(c.error) <= TARGET, f"{c.label()}: {c.error:+.1%}"


def test_h100_gemms_and_attention_within_target_of_another_calls_step_kernels() -> None:
    """The cost model's GEMMs and attention on h100.json (fitted to the 1.36B plain step's
    kernels of one call) against a second call's floor steps, kernel by kernel
    (benchmarks/results/gemm_l2_1206/h100_instep_b.json: each GEMM shape's device time in
    the step, attention's kernels), at 125M and 1.36B, batch 1 and 8: each part within 10 %
    but one. 125M batch-8 attention is 10.9 % low (9.2 % with the calibration of 06:29): its
    rate and per-layer time are fitted to the 1.36B step's kernels, whose heads are twice as
    wide."""
    from gtp_wrap.scaling.model import GPT_125M
    from gtp_wrap.scaling.predict import attention_layer_s, pass_order, weight_gemms_s

    h100 = load_cluster("h100")
    root = Path(__file__).resolve().parents[1]
    kernels = json.loads((root / "benchmarks/results/gemm_l2_1206/h100_instep_b.json").read_text())
    for name, model in (("125M", GPT_125M), ("1.36B", GPT_1P36B)):
        for batch in (1, 8):
            plan = Plan(model, h100, Mesh(), batch=batch, seq=model.seq)
            gemms = sum(
                weight_gemms_s(plan, w, backward)
                for backward in (False, True)
                for w, _ in pass_order(model, backward)
                if w.kind != "embedding"
            )
            measured = sum(
                g["per_step"] * g["seconds"]
                for g in kernels["gemms"]
                if g["model"] == name and g["batch"] == batch
            )
            assert gemms == pytest.approx(measured, rel=TARGET), (name, batch)
            attention = model.layers * attention_layer_s(h100, model, batch * model.seq)
            (timed,) = [
                a["seconds"]
                for a in kernels["attention"]
                if a["model"] == name and a["batch"] == batch
            ]
            bound = 0.11 if (name, batch) == ("125M", 8) else TARGET
            assert attention == pytest.approx(timed, rel=bound), (name, batch)


def test_a_run_in_a_faked_world_is_predicted_without_its_collectives() -> None:
    """A run with `"comm": "faked"` (benchmarks/fake_world.py) is predicted on the cluster's
    rates with collectives that take no time: a communication-bound graphed step on two ranks
    predicts about the floor's, where the real collectives make it longer; the host-bound eager
    floor, which issues none, is the same either way."""
    free = H200.without_comm()
    for group in (Group(size=2, per_node=8), Group(size=8, per_node=4)):  # a node, and two
        for kind in KINDS:
            assert collective_s(free, kind, 1e9, group) == 0.0, (kind, group)
            assert collective_s(H200, kind, 1e9, group) > 0.0, (kind, group)
    run = {"model": "gpt_1p36b", "batch": 8, "seq": 2048, "mesh": "gtp=2"}
    real = predicted_ms(H200, dict(run, method="gtp_graph"))
    faked = predicted_ms(H200, dict(run, method="gtp_graph", comm="faked"))
    floor = predicted_ms(H200, dict(run, method="floor_graph"))
    assert faked < real and abs(faked / floor - 1) < 0.05, (faked, real, floor)
    eager = dict(run, batch=1, method="floor")
    assert predicted_ms(H200, dict(eager, comm="faked")) == predicted_ms(H200, eager)
    # FSDP2's gathers and reduce-scatters go too: its faked step is its host time and compute,
    # within 1 % of the same step with links a million times faster.
    fsdp2 = dict(run, method="fsdp2")
    fast = dataclasses.replace(
        H200,
        intra=_scaled_link(H200.intra, 1e6),
        inter=_scaled_link(H200.inter, 1e6),
        contention_compute=1.0,
        contention_comm=1.0,
    )
    faked_fsdp2 = predicted_ms(H200, dict(fsdp2, comm="faked"))
    assert faked_fsdp2 < predicted_ms(H200, fsdp2)
    assert abs(faked_fsdp2 / predicted_ms(fast, fsdp2) - 1) < 0.01


def _scaled_link(link: Link, times: float) -> Link:
    """`link` with every curve `times` faster: latencies divided, bandwidths multiplied."""

    def faster(c: Curve) -> Curve:
        return Curve(alpha_us=c.alpha_us / times, gbs=c.gbs * times, hop_us=c.hop_us / times)

    return Link(faster(link.all_gather), faster(link.reduce_scatter))


def test_a_runs_host_probe_scales_its_host_time_only() -> None:
    """A run whose host probe read twice the calibration's: the host-bound eager batch-1 floor
    is predicted twice as long where its host sets the pace; a graphed step (no host work per
    use: only its replay's launch scales) within 1 %, and a run without a probe, or against a
    calibration without one, exactly as before."""
    cluster = dataclasses.replace(H200, host_probe_ms=2.0)
    run = {"model": "gpt_125m", "batch": 1, "seq": 2048, "mesh": "", "method": "floor"}
    plan = Plan(model_by_name("gpt_125m"), cluster, Mesh(), 1, 2048)
    pred = predict(plan, "floor")
    same = predicted_ms(cluster, dict(run, host_probe_ms=2.0))
    slow = predicted_ms(cluster, dict(run, host_probe_ms=4.0))
    assert same == pytest.approx(pred.step * 1e3)
    assert slow == pytest.approx(2 * same, rel=0.05)
    assert predicted_ms(cluster, run) == same  # no probe in the run
    unprobed = dataclasses.replace(H200, host_probe_ms=0.0)
    assert predicted_ms(unprobed, dict(run, host_probe_ms=4.0)) == predicted_ms(unprobed, run)
    graphed = dict(run, method="floor_graph")
    assert predicted_ms(cluster, dict(graphed, host_probe_ms=4.0)) == pytest.approx(
        predicted_ms(cluster, graphed), rel=0.01
    )


def test_host_probes_bring_eager_batch1_runs_closer() -> None:
    """The stored eager batch-1 runs that carry a host probe (benchmarks/host_probe.py) are
    predicted closer with their host time scaled by it than without: its purpose. It removes
    a fifth of their mean error and no more since the 2026-12-05 runs (13.2 % to 10.2 %; a
    quarter before them): at 125M in the faked world the probe read that host a third slower
    than the calibration's while the floor ran at the calibration's speed (RESULTS.md)."""
    unscaled = dataclasses.replace(H200, host_probe_ms=0.0)
    probed = [
        (c, u)
        for c, u in zip(check(H200), check(unscaled))
        if "host_probe_ms" in c.run and not c.calibration and not c.run["method"].endswith("_graph")
    ]
    assert len(probed) >= 8
    scaled_err = sum(abs(c.error) for c, _ in probed) / len(probed)
    unscaled_err = sum(abs(u.error) for _, u in probed) / len(probed)
    assert scaled_err < 0.8 * unscaled_err, (scaled_err, unscaled_err)


# ---- the chain's overlap, by hand ------------------------------------------------------------


def test_a_gather_is_hidden_only_behind_longer_compute() -> None:
    # gathers of 1 s, compute of 2 s, one group ahead: only the head's gather shows
    t = simulate([[Stage(1, 2)] * 3], depth=1)
    assert (t.end, t.compute, t.comm_wait) == (7.0, 6.0, 1.0)
    # gathers of 3 s behind 2 s of compute: the comm lane sets the pace, 3 + 3 + 3 + 2
    t = simulate([[Stage(3, 2)] * 3], depth=1)
    assert (t.end, t.comm_wait) == (11.0, 5.0)
    # no prefetch: every gather blocks, 3 x (1 + 2)
    assert simulate([[Stage(1, 2)] * 3], depth=0).end == 9.0


def test_prefetch_depth_hides_an_uneven_chain() -> None:
    # a long group, then two short ones with slow gathers: depth 2 issues the third gather
    # while the first group computes
    stages = [Stage(1, 6), Stage(2, 1), Stage(2, 1)]
    assert simulate([stages], depth=1).end == 10.0  # 1 + 6, then 1, then waits 1 for gather 3
    assert simulate([stages], depth=2).end == 9.0  # 1 + 6 + 1 + 1


def test_reductions_queue_behind_gathers_and_the_last_is_exposed() -> None:
    t = simulate([[Stage(1, 2, reduce_s=3), Stage(1, 2, reduce_s=3)]], depth=1)
    # gathers 0-1, 1-2; compute 1-3, 3-5; reduces 3-6, 6-9: 4 s of tail after compute
    assert (t.end, t.comm_wait, t.comm_busy) == (9.0, 5.0, 8.0)


def test_compute_beside_a_collective_runs_slower() -> None:
    # the first group's 1 s of compute starts at 1 beside the second gather (1-2), at half
    # speed: 0.5 s of work by 2, the rest by 2.5; then 2 s alone: 4.5 against 4 without
    t = simulate([[Stage(1, 1), Stage(1, 2)]], depth=1, contention_compute=2.0)
    assert t.end == pytest.approx(4.5) and t.contention == pytest.approx(0.5)


def test_eager_host_sets_the_pace_when_slower() -> None:
    t = simulate([[Stage(0, 1, host_s=2)] * 3], depth=1)
    assert t.end == 6.0 and t.host_wait == pytest.approx(3.0)
    # a synchronous host (CPU ranks) adds its time to the compute lane
    t = simulate([[Stage(0, 1, host_s=2)] * 3], depth=1, async_host=False)
    assert t.end == 9.0 and t.compute == 3.0 and t.host_wait == 6.0


# ---- collectives, memory, monotonicity --------------------------------------------------------


def test_all_gather_on_two_ranks_is_alpha_plus_half_the_bytes() -> None:
    curve = H200.intra.all_gather
    nbytes = 100e6
    expected = curve.alpha_us * 1e-6 + nbytes / 2 / (curve.gbs * 1e9)
    assert collective_s(H200, "all_gather", nbytes, Group(2, 2)) == pytest.approx(expected)
    # across nodes, one member per node: the NIC's ring, slower than NVLink
    assert collective_s(H200, "all_gather", nbytes, Group(2, 1)) > 3 * expected


def test_collectives_grow_with_bytes_and_shrink_with_bandwidth() -> None:
    group = Group(16, 8)
    times = [collective_s(H200, "reduce_scatter", b, group) for b in (1e6, 1e7, 1e8)]
    assert times == sorted(times)
    slow = H200.with_inter_gbs(10)
    assert collective_s(slow, "reduce_scatter", 1e8, group) > times[-1]


def test_expert_stacks_over_a_group_of_one_are_copied_once_per_step_not_cast_per_use() -> None:
    """As the engine decides per weight (core/storage.py): at egtp = 1 the expert stacks keep
    a bf16 copy (memory, a cast per step) and their uses cast nothing, while the dense weights
    beside them over gtp > 1 cast into their gathers; at egtp = 2 nothing keeps a copy."""
    local = Plan(SEED280B, H200, Mesh(dp=2, gtp=64, ep=64, egtp=1))
    spread = dataclasses.replace(local, mesh=Mesh(dp=2, gtp=64, ep=64, egtp=2))
    experts = sum(w.numel for w in SEED280B.weights() if w.kind == "expert") / 64
    assert predict(local).memory.copies == pytest.approx(experts * 2)
    assert predict(spread).memory.copies == 0.0
    assert step_engine_s(local) > 0.0 == step_engine_s(spread)
    stack = next(u for u in uses(local, "gtp", backward=False) if u.weight.kind == "expert")
    dense = next(u for u in uses(local, "gtp", backward=False) if u.weight.kind == "dense")
    assert engine_s(local, stack.weight, stack.numel, False) == 0.0
    assert engine_s(local, dense.weight, dense.numel, False) > 0.0


def test_shards_grads_and_optimizer_state_scale_one_over_n() -> None:
    def state(n: int) -> float:
        m = predict(Plan(GPT_1P36B, H200, Mesh(gtp=n))).memory
        return m.weights + m.grads + m.optimizer

    small = GPT_1P36B.replicated_numel * 16
    for n in (2, 4, 8, 16):
        assert state(n) - small == pytest.approx((state(1) - small) / n, rel=1e-9)


def test_gathered_buffers_are_bounded_by_depth_and_group_size() -> None:
    plan = Plan(LLAMA70B, H200, Mesh(gtp=8), recompute=True)
    one, two = (
        predict(dataclasses.replace(plan, prefetch_depth=d)).memory.gathered for d in (1, 2)
    )
    group = predict(plan).largest_group_numel
    assert two - one == pytest.approx(group * 2.0)  # one more bf16 group in flight
    assert one < LLAMA70B.n_params * 2 / 5  # the largest group (the embedding), not the model


def test_step_grows_with_batch_and_throughput_falls_with_bandwidth() -> None:
    plan = Plan(LLAMA70B, H200, Mesh(dp=2, gtp=16), graphed=True, recompute=True)
    steps = [predict(dataclasses.replace(plan, batch=b)).step for b in (1, 2, 4)]
    assert steps == sorted(steps)
    rates = [
        predict(dataclasses.replace(plan, cluster=H200.with_inter_gbs(bw))).step
        for bw in (50, 12.5, 3)
    ]
    assert rates == sorted(rates)


def test_chain_groups_follow_the_engine_cut() -> None:
    plan = Plan(GPT_1P36B, H200, Mesh(gtp=2))
    groups = cut_groups(uses(plan, "gtp", False), plan.group_numel)
    assert sum(len(g) for g in groups) == 122  # embedding, 24 x 5, head
    assert all(sum(u.numel for u in g) >= plan.group_numel for g in groups[:-1])
    one_each = cut_groups(uses(plan, "gtp", False), 0)
    assert len(one_each) == 122
    # experts go in a group of their own, a layer's stacks together
    moe = Plan(SEED280B, H200, Mesh(dp=2, gtp=8, ep=8, egtp=2))
    for g in cut_groups(uses(moe, "gtp", False), moe.group_numel):
        assert len({u.weight.kind == "expert" for u in g}) == 1


@pytest.mark.parametrize("batch", [1, 16])
def test_in_line_collectives_count_as_busy_communication(batch: int) -> None:
    """Tensor parallelism's collectives run in line on the compute stream, all exposed: the
    busy time counts them, so exposed communication never exceeds it (busy counted only the dp
    all-reduce before, 620 ms beside 3047 exposed for this TP step at batch 16)."""
    plan = Plan(LLAMA70B, H200, Mesh(dp=4, tp=16), batch=batch, seq=4096)
    pred = predict_method(plan, "tp")
    assert pred.exposed_comm > 0 and pred.exposed_comm <= pred.comm_busy
    t = simulate([[Stage(0, 2, inline_s=1), Stage(1, 2)]], depth=1)
    assert (t.end, t.comm_wait, t.comm_busy) == (5.0, 1.0, 2.0)


def test_a_sweep_keeps_the_base_meshs_model_parallel_axes_whole(tmp_path: Path) -> None:
    """Weak and strong scaling start at the fewest GPUs the base mesh's model-parallel axes
    take, adding data-parallel replicas only: on fewer GPUs the axes had shrunk, and an 8-GPU
    GTP8 row of a GTP64 mesh set the base of a "weak-scaling efficiency" of 149 % to 200 %."""
    base = Mesh(dp=2, gtp=64, ep=64, egtp=2)
    plan = Plan(SEED280B, load_cluster("gb200"), base, graphed=True, recompute=True)
    for rows in (scale.weak(plan), scale.strong(plan, 1024)):
        assert rows[0].gpus == 128 and rows[0].efficiency == 1.0
        for r in rows:
            assert (r.mesh.gtp, r.mesh.tp, r.mesh.ep, r.mesh.egtp) == (64, 1, 64, 2)
            assert r.mesh.dp == r.gpus // 64 and r.efficiency <= 1.0
    assert [r.gpus for r in scale.weak(plan)] == [128, 256, 512, 1024, 2048, 3072, 4096]
    with pytest.raises(SystemExit, match="pass GPU counts from 128 up"):
        main(["scale", "--model", "seed280b", "--cluster", "gb200", "--mesh",
              "dp=2,gtp=64,ep=64,egtp=2", "--gpus", "8,16", "--out", str(tmp_path)])  # fmt: skip
    assert not any(tmp_path.iterdir())  # refused before writing


def test_blocks_pay_host_time_per_block_not_per_use() -> None:
    """gtp_blocks (gather_per_block): at world 1, host-bound (125M, batch 1), each of the 12
    blocks adds `block_us` to the step instead of an intercepted use per weight; the root's
    weights (embedding, tied head) stay per use."""
    plan = Plan(model_by_name("gpt_125m"), H200, Mesh(), 1, 2048)
    at = {
        us: predict(dataclasses.replace(plan, cluster=dataclasses.replace(
            H200, host=dataclasses.replace(H200.host, block_us=us))), "gtp_blocks").step
        for us in (0.0, 500.0)
    }  # fmt: skip
    assert at[500.0] - at[0.0] == pytest.approx(12 * 500e-6, rel=1e-6)
    per_use = predict(plan, "gtp")
    assert at[0.0] < per_use.step  # no use costs use_us_local but the root's
    root = [u for u in uses(plan, "gtp_blocks", False) if u.weight.layer < 0]
    assert [u.weight.kind for u in root] == ["embedding", "head"]
    assert all(u.host_s == H200.host.use_us_local * 1e-6 for u in root)


def test_a_block_is_one_group_whose_compute_waits_for_all_its_weights() -> None:
    """A layer on gathered weights computes on the stage of the chain group holding its last
    weight, and reduces its gradients there; the chain keeps a layer's weights in one group
    (runtime/chain.py), so the next layer's gathers are in flight while it computes: cut by
    size and prefetched one group ahead instead, its later groups are gathered with nothing
    to hide them."""
    plan = Plan(GPT_1P36B, H200, Mesh(gtp=2), group_numel=0)  # by size: one weight a group
    by_size = cut_groups(uses(plan, "gtp_blocks", False), 0)
    whole = cut_groups(uses(plan, "gtp_blocks", False), 0, blocks=True)
    assert (len(by_size), len(whole)) == (122, 26)  # embedding, 24 x 5 or 24, head
    stages = block_stages(plan, by_size, True, False)
    layer0 = [i for i, g in enumerate(by_size) if g[0].weight.layer == 0]
    assert [stages[i].compute_s > 0 for i in layer0] == [False] * 4 + [True]
    assert stages[layer0[-1]].compute_s == pytest.approx(
        sum(u.compute_s for i in layer0 for u in by_size[i])
    )
    bwd = cut_groups(uses(plan, "gtp_blocks", True), 0)
    names = [g[0].weight.name for g in bwd]
    assert names[:3] == ["head", "layers.23.qkv", "layers.23.o"]  # the layer's own order
    back = block_stages(plan, bwd, True, True)
    last23 = max(i for i, g in enumerate(bwd) if g[0].weight.layer == 23)
    assert [s.reduce_s > 0 for s in back[1 : last23 + 1]] == [False] * 4 + [True]
    # cut by size and prefetched one group ahead, as the engine was: the later groups exposed
    one_ahead = [dataclasses.replace(s, reach=-1) for s in block_stages(plan, by_size, True, False)]
    exposed = simulate([block_stages(plan, whole, True, False)], 1).comm_wait
    assert exposed < simulate([one_ahead], 1).comm_wait / 2


def test_a_moe_blocks_groups_are_prefetched_together() -> None:
    """A mixture-of-experts layer on gathered weights is two groups (dense weights, then the
    expert stacks over egtp); the prefetch reaches to the end of the next layer, so both are
    in flight under the layer before, where one group ahead would leave the second exposed."""
    moe = ModelConfig("moe", vocab=1000, d=1024, layers=4, heads=8, ffn=2048, experts=8,
                      top_k=2, moe_ffn=1024, seq=2048)  # fmt: skip
    plan = Plan(moe, H200, Mesh(gtp=2, egtp=2), group_numel=0)
    groups = cut_groups(uses(plan, "gtp_blocks", False), 0, blocks=True)
    assert [len(g) for g in groups] == [1] + [2] * 8 + [1]
    stages = block_stages(plan, groups, True, False)
    assert [s.reach for s in stages] == [2, 4, 4, 6, 6, 8, 8, -1, -1, -1]
    one_ahead = [dataclasses.replace(s, reach=-1) for s in stages]
    assert simulate([stages], 1).comm_wait < simulate([one_ahead], 1).comm_wait / 5
    assert simulate([stages], 0).comm_wait == simulate([one_ahead], 0).comm_wait


def test_encoded_gathers_move_fewer_bytes() -> None:
    assert Precision(gather="nvfp4").gather_bytes == 0.5625
    plan = Plan(LLAMA70B, H200.with_inter_gbs(3), Mesh(gtp=64), recompute=True, graphed=True)
    bf16, fp4 = (
        predict(dataclasses.replace(plan, precision=Precision(gather=g))) for g in ("bf16", "nvfp4")
    )
    assert fp4.comm_busy < bf16.comm_busy and fp4.step < bf16.step


# ---- errors users can cause, and the command line ----------------------------------------------


def test_errors_name_the_cause() -> None:
    with pytest.raises(MeshError, match="AXIS=N"):
        Mesh.parse("gtp8")
    with pytest.raises(MeshError, match="must divide"):
        Mesh(gtp=6, ep=4)
    with pytest.raises(PrecisionError, match="nvfp4"):
        Precision(gather="int4")
    with pytest.raises(PlanError, match="no experts"):
        Plan(GPT_1P36B, H200, Mesh(gtp=2, ep=2))
    with pytest.raises(PlanError, match="not run experts beside tensor parallelism"):
        Plan(SEED280B, H200, Mesh(gtp=2, tp=2, ep=2))
    with pytest.raises(ClusterError, match="clusters: "):
        load_cluster("tpu")
    with pytest.raises(ValueError, match="heads"):
        ModelConfig("bad", vocab=8, d=10, layers=1, heads=3, ffn=8)
    # a calibration made before host.block_us existed predicts all but gtp_blocks
    older = dataclasses.replace(H200, host=dataclasses.replace(H200.host, block_us=None))
    plan = Plan(GPT_1P36B, older, Mesh(gtp=2))
    assert predict(plan, "gtp").step == predict(dataclasses.replace(plan, cluster=H200)).step
    with pytest.raises(PlanError, match="calibrate.py"):
        predict(plan, "gtp_blocks")


def test_cli_plan_and_scale(tmp_path, capsys) -> None:
    main(
        [
            "--model",
            "llama70b",
            "--cluster",
            "h200",
            "--mesh",
            "dp=4,gtp=16",
            "--batch",
            "1",
            "--seq",
            "4096",
            "--recompute",
        ]
    )
    out = capsys.readouterr().out
    assert "exposed communication" in out and "tokens/s/GPU" in out
    main(["--model", "gpt_125m", "--cluster", "h200", "--method", "gtp_blocks"])
    assert "gtp_blocks step of gpt_125m" in capsys.readouterr().out
    main(
        [
            "scale",
            "--model",
            "gpt_1p36b",
            "--cluster",
            "h200",
            "--mesh",
            "gtp=8",
            "--gpus",
            "8,16,32",
            "--out",
            str(tmp_path),
        ]
    )
    assert (tmp_path / "weak_gpt_1p36b_h200.png").stat().st_size > 0
    assert "weak scaling, gtp bf16" in (tmp_path / "scaling_gpt_1p36b_h200.md").read_text()
    main(["scale", "--model", "gpt_1p36b", "--cluster", "h200", "--mesh", "gtp=8",
          "--gpus", "8,16", "--method", "gtp_blocks", "--out", str(tmp_path)])  # fmt: skip
    assert "weak scaling, gtp_blocks bf16" in (tmp_path / "scaling_gpt_1p36b_h200.md").read_text()
    with pytest.raises(SystemExit, match="ep\\*egtp"):
        main(["--model", "seed280b", "--cluster", "gb200", "--mesh", "gtp=8,ep=64,egtp=2"])


def _calibration_with(tmp_path: Path, where: tuple[str, ...], value: object) -> str:
    """h200.json with one leaf (by its keys) replaced, written under `tmp_path`."""
    raw = json.loads((calibration_dir() / "h200.json").read_text())
    leaf = raw
    for key in where[:-1]:
        leaf = leaf[key]
    leaf[where[-1]] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "nan"], "batch=nan: give a number of sequences per data rank above 0"),
        (["--batch", "inf"], "batch=inf: give a number"),
        (["--mesh", "gtp=16,gtp=8"], "gives gtp twice"),
        ((("links", "inter", "all_gather", "gbs"), 0), "all_gather.gbs=0 must be above 0"),
        ((("links", "inter", "all_gather", "gbs"), -5), "all_gather.gbs=-5 must be above 0"),
        ((("compute", "gemm_tflops"), "fast"), "gemm_tflops='fast' is not a finite number"),
        ((("gpus_per_node",), 0), "gpus_per_node=0 must be above 0"),
        ((("memory_gib",), -1), "memory_gib=-1 must be above 0"),
        ((("host",), [1, 2]), "host must be an object"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(tmp_path: Path, args, message: str) -> None:
    """Numbers a plan divides by or cannot take (a NaN batch, a link of 0 or -5 GB/s, a
    throughput that is a word) end in one line naming them, not a traceback or a plan."""
    cli = ["--model", "llama70b", "--cluster", "h200"]
    if isinstance(args, tuple):
        cli = ["--model", "llama70b", "--cluster", _calibration_with(tmp_path, *args)]
        args = []
    with pytest.raises(SystemExit, match=re.escape(message)):
        main([*cli, *args])


def test_cli_scale_and_all_methods_take_what_they_can(tmp_path: Path, capsys) -> None:
    """`scale` bases its efficiencies on the fewest GPUs whatever order --gpus gives, refuses a
    global batch no GPU count can split and an --out it cannot write; `--method all` leaves out
    the TP variant the heads do not divide, and goes on."""
    scale_args = ["scale", "--model", "gpt_1p36b", "--cluster", "h200", "--mesh", "gtp=8"]
    main([*scale_args, "--gpus", "16,8", "--out", str(tmp_path)])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 8 |")]
    assert rows and all("| 100.0% |" in r for r in rows)
    with pytest.raises(SystemExit, match="fewer sequences than the data ranks"):
        main([*scale_args, "--global-batch", "2", "--gpus", "8,16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="give sequences per step above 0"):
        main([*scale_args, "--global-batch", "-5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="gtp-plan: --gpus '0': give whole numbers >= 1"):
        main([*scale_args, "--gpus", "0", "--out", str(tmp_path)])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="cannot write"):
        main([*scale_args, "--gpus", "8", "--out", str(tmp_path / "file" / "x")])
    main(["--model", "gpt_125m", "--cluster", "h200", "--mesh", "dp=2,gtp=4,tp=2",
          "--method", "all"])  # fmt: skip
    out = capsys.readouterr().out
    assert "tp: left out (tp=8 must divide the model's 12 heads" in out
    assert "fsdp2 step of gpt_125m" in out


def test_plan_texts_say_what_the_model_models(capsys) -> None:
    """No more gathered buffers than the whole model whatever the depth; a mesh named as given;
    the floor (whose memory is not modelled) without fit advice; advice that names tp."""
    plan = Plan(LLAMA70B, load_cluster("h200"), Mesh(gtp=64), prefetch_depth=1000)
    pred = predict(plan)  # bf16 gathers, and a group's fp32 gradients (two groups')
    assert pred.memory.gathered <= LLAMA70B.n_params * 2 + 2 * pred.largest_group_numel * 4
    with pytest.raises(SystemExit, match=r"mesh ep=2: ep\*egtp=2 must divide"):
        main(["--model", "llama70b", "--cluster", "h200", "--mesh", "ep=2"])
    main(["--model", "llama70b", "--cluster", "h200", "--mesh", "gtp=64", "--seq", "131072",
          "--recompute"])  # fmt: skip
    assert "split activations and logits with tp" in capsys.readouterr().out
    main(["--model", "gpt_125m", "--cluster", "cpu_gloo", "--mesh", "dp=2,gtp=4,tp=2",
          "--method", "floor", "--batch", "64"])  # fmt: skip
    assert "does not fit" not in capsys.readouterr().out


def test_compare_takes_a_mixture_of_experts_and_a_cluster_without_fp8(tmp_path: Path) -> None:
    """`compare` of the seed's MoE on its default mesh (ep=64) sweeps the dense Llama family on
    dense meshes and leaves TP out for the MoE; on a cluster with no FP8 or NVFP4 decode
    calibration it compares what it can and says what it left out."""
    main(["compare", "--model", "seed280b", "--cluster", "gb200", "--out", str(tmp_path)])
    text = (tmp_path / "compare_seed280b_gb200.md").read_text()
    by_size = text.split("by group size")[1].split("##")[0]
    rows = [r for r in by_size.splitlines() if r.startswith("| 2 |")]
    assert rows and rows[0].rstrip().endswith("| n/a |")
    main(["compare", "--model", "gpt_125m", "--cluster", "cpu_gloo", "--out", str(tmp_path)])
    text = (tmp_path / "compare_gpt_125m_cpu_gloo.md").read_text()
    assert "- fp8 against bf16: not calibrated on cpu_gloo" in text


def test_readme_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every gtp-plan line of the README's planning section runs and prints a plan or writes
    its tables (its --out pointed at a temporary folder): the first as a user runs it, the
    rest through the console script's `main` in this process (each new interpreter would
    import torch again)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Planning at scale") :]
    block = section[section.index("```bash") : section.index("```", section.index("```bash") + 7)]
    lines = [ln.split("#")[0].split() for ln in block.splitlines() if ln.startswith("gtp-plan")]
    assert len(lines) >= 5
    lines = [[str(tmp_path) if a == "runs/plan/" else a for a in argv] for argv in lines]
    script = Path(sys.executable).with_name("gtp-plan")  # the console script pip installed
    done = subprocess.run([str(script), *lines[0][1:]], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip(), (lines[0], done.stderr[-2000:])
    for argv in lines[1:]:
        main(argv[1:])
        assert capsys.readouterr().out.strip(), argv
    assert any(tmp_path.rglob("*.png"))


def test_gemm_split_k_loss_bytes_and_attentions_halves() -> None:
    """The model's parts by hand: a GEMM of one output tile on a GPU of 132 SMs splits its sum
    132 ways (one wave, k/132 each); one of a full wave does not; the loss moves 36 bytes per
    bf16 logit and 24 per fp32 one; a layer's attention forward and backward add up to
    `attention_layer_s`, its fixed time included."""
    from gtp_wrap.scaling.predict import attention_layer_s, gemm_s, layer_costs, loss_bytes

    compute = dataclasses.replace(H200.compute, gemm_tflops=1.0, gemm_overhead_us=0.0)
    cluster = dataclasses.replace(H200, compute=compute)
    tile = 2.0 * 128 * 256 * 1e-12  # seconds per unit of k for one tile at 1 TFLOP/s
    assert compute.gemm_units == 132
    assert gemm_s(cluster, 128, 256, 1320) == pytest.approx(132 * tile * 1320 / 132)
    assert gemm_s(cluster, 128 * 132, 256, 64) == pytest.approx(132 * tile * 64)
    assert gemm_s(cluster, 0, 256, 64) == 0.0
    assert (loss_bytes(2), loss_bytes(4)) == (36.0, 24.0)
    plan = Plan(GPT_1P36B, H200, Mesh(), batch=2)
    split = dataclasses.replace(plan.cluster.compute, elementwise_bytes=0.0, layer_overhead_us=0.0)
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(H200, compute=split))
    both = layer_costs(plan, 0, False) + layer_costs(plan, 0, True)
    assert both == pytest.approx(attention_layer_s(plan.cluster, GPT_1P36B, plan.tokens))
    assert H200.compute.attention_layer_us > 0


def test_the_tp_baseline_says_how_it_turned_the_gtp_mesh_into_tp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--method tp` on a GTP mesh compares TP over the same GPUs and tokens per GPU; it says
    so, since the mesh and batch it prints are not the ones given (a new user's surprise)."""
    main(["--model", "llama70b", "--cluster", "h200", "--mesh", "dp=4,gtp=16", "--method", "tp"])
    out = capsys.readouterr().out
    assert out.startswith(
        "tp: the GTP group's 16 GPUs as one TP group (mesh dp=4,tp=16), the "
        "sequences of its 16 ranks together (batch 16): the same tokens per GPU"
    )
    assert "mesh dp=4,tp=16 (64 GPUs), batch 16 x 4096" in out


def test_a_model_from_gtp_trains_configs_or_a_file(tmp_path: Path) -> None:
    """`--model` takes gtp-train's model configs by name and any YAML or JSON file of their
    keys: the cost model then counts the parameters the app's own GPT holds, and a file the
    model cannot read is one line that names the key or the file."""
    from omegaconf import OmegaConf

    from gtp_wrap.app.model import GPTConfig
    from gtp_wrap.scaling.model import load_model, train_configs

    assert {"gpt_small", "moe_1b", "moe_tiny"} <= set(train_configs())
    for name in train_configs():
        keys = OmegaConf.to_container(OmegaConf.load(Path("configs/model") / f"{name}.yaml"))
        model = load_model(name)
        assert model.n_params == GPTConfig(**keys).n_params, name  # type: ignore[arg-type]
        assert model.seq == keys["max_seq"]  # type: ignore[index]
    # A file that leaves keys out plans what gtp-train builds from it (its GPTConfig defaults).
    from gtp_wrap.scaling.model import TRAIN_DEFAULTS

    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    assert all(defaults[k] == v for k, v in TRAIN_DEFAULTS.items()), defaults
    least = {"vocab": 1000, "d": 64, "layers": 2, "heads": 4, "ffn": 128}
    (tmp_path / "least.yaml").write_text("".join(f"{k}: {v}\n" for k, v in least.items()))
    assert load_model(str(tmp_path / "least.yaml")).n_params == GPTConfig(**least).n_params
    run = {"model": least, "trainer": {"steps": 3}}  # a run's composed .hydra/config.yaml
    (tmp_path / "config.yaml").write_text(json.dumps(run))  # JSON is YAML
    assert load_model(str(tmp_path / "config.yaml")).n_params == GPTConfig(**least).n_params
    mine = {"vocab": 1000, "d": 64, "layers": 2, "heads": 4, "ffn": 128, "kv_heads": 2}
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    (tmp_path / "mine.yaml").write_text("".join(f"{k}: {v}\n" for k, v in mine.items()))
    from_json, from_yaml = (
        load_model(str(tmp_path / "mine.json")),
        load_model(str(tmp_path / "mine.yaml")),
    )
    assert from_json == dataclasses.replace(from_yaml, note=from_json.note)
    assert from_json.qkv_rows == 64 + 2 * 2 * 16
    main(["--model", str(tmp_path / "mine.yaml"), "--cluster", "cpu_gloo", "--mesh", "gtp=2"])
    for bad, message in [
        ({**mine, "width": 3}, "unknown key 'width'"),
        ({**mine, "layers": 2.5}, "layers must be int, got 2.5"),
        ({**mine, "kv_heads": 3}, "heads=4 must split into 3 kv_heads"),
        ({"vocab": 1000, "d": 64}, "lacks layers, heads, ffn"),
        ([1, 2], "must be a mapping"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=re.escape(message)):
            main(["--model", str(tmp_path / "bad.json"), "--cluster", "cpu_gloo"])
    for text, message in [("42\n", "holds a single value"), ("a: [1\n", "not a YAML mapping"),
                          ("defaults: [x]\n", "a defaults list is Hydra's")]:  # fmt: skip
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(SystemExit, match=re.escape(message)):
            main(["--model", str(tmp_path / "bad.yaml"), "--cluster", "cpu_gloo"])
    with pytest.raises(SystemExit, match="model file .*gone.yaml does not exist"):
        main(["--model", str(tmp_path / "gone.yaml"), "--cluster", "cpu_gloo"])
    with pytest.raises(SystemExit, match="a gtp-train model config \\(gpt_125m, gpt_1p4b"):
        main(["--model", "gpt_huge", "--cluster", "cpu_gloo"])
