"""The side-by-side benchmark's CPU smoke mode runs every method and writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks

import gtp_wrap
from gtp_wrap.core.weight import ShardedWeight

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/bench_step.py"),
        "--smoke",
        "--methods",
        *["floor", "ddp", "fsdp2", "gtp", "gtp_fp8", "gtp_fp8_gemm", "amp"],
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    methods = ["floor", "ddp", "fsdp2", "gtp", "gtp_fp8", "gtp_fp8_gemm", "amp"]
    assert [r["method"] for r in rows] == methods
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["host_probe_ms"] > 0 for r in rows)  # the host's speed beside each method
    assert all(r["blocking_by_pass"] == {"forward": 2, "backward": 2} for r in rows[3:6])
    assert (tmp_path / "bench.png").stat().st_size > 5_000
    assert "GTP/FSDP2" in proc.stdout and "GTP/AMP" in proc.stdout


def _benchmark_module(name: str):
    path = str(ROOT / "benchmarks")
    sys.path.insert(0, path)
    try:
        return __import__(name)
    finally:
        sys.path.remove(path)  # by value: the module may have put paths of its own first


def test_floor_per_param_steps_each_parameters_shard_where_the_floor_steps_one() -> None:
    bench = _benchmark_module("bench_step")
    cfg = bench.MODELS["smoke"]
    sizes = {}
    for method in ("floor", "floor_per_param"):
        model, optim, autocast = bench._build(method, cfg, torch.device("cpu"), 2, {})
        sizes[method] = [p.numel() for g in optim.param_groups for p in g["params"]]
        assert autocast is None and all(p.grad is not None for p in optim.param_groups[0]["params"])
    params = [p.numel() for p in model.parameters()]
    assert sizes["floor"] == [-(-cfg.n_params // 2)] and sum(params) == cfg.n_params
    assert sizes["floor_per_param"] == [-(-n // 2) for n in params] and len(params) > 10


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plan", "smoke:1"], "--seq 2048: model smoke takes at most 64 tokens"),
        (["--plan", "7B:1"], "--plan: model '7B': one of 1.36B"),
    ],
)
def test_bench_step_refuses_a_plan_it_cannot_run_naming_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any rank starts: a sequence longer than the model's (a Dynamo shape error under
    torchrun before) or a model it does not have."""
    with pytest.raises(SystemExit):
        _benchmark_module("bench_step").parse(argv)
    assert message in capsys.readouterr().err


def _dp_builds(rank: int, world: int) -> dict:
    bench = _benchmark_module("bench_step")
    cfg = bench.MODELS["smoke"]
    out = {}
    for method in ("floor", "gtp", "fsdp2"):
        model, optim, autocast = bench._build(method, cfg, torch.device("cpu"), world, {}, dp=2)
        idx = bench.batch_of(cfg, 2, 8, torch.device("cpu"))
        bench.method_step(method, model, optim, autocast, idx, 0)()
        params = [p for g in optim.param_groups for p in g["params"]]
        out[method] = [p.numel() for p in params]
        if method == "fsdp2":
            out["fsdp2_mesh"] = [
                (tuple(p.device_mesh.shape), str(p.placements)) for p in model.parameters()
            ]
        if method == "gtp":
            weights = [p.gtp_weight for p in model.parameters()]
            out["gtp_axes"] = {
                (w.axis.size, w.replicas.size) for w in weights if type(w) is ShardedWeight
            }
            stats = gtp_wrap.stats(model)
            out["gtp_collectives"] = stats["gathers"] > 0, stats["reduce_scatters"] > 0
            out["gtp_after_step"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_dp_runs_gtp_on_a_dp_gtp_mesh_and_fsdp2_as_hsdp() -> None:
    """bench_step --dp 2 on 4 ranks: GTP shards over 2 ranks and averages over 2 replicas,
    FSDP2 is HSDP on the same split, the floor steps half of the parameters. Each rank trains
    on a batch of its own, so a replica's shards equal its twin's after a step only if their
    gradients were averaged over dp."""
    cfg = _benchmark_module("bench_step").MODELS["smoke"]
    ranks = run_ranks(_dp_builds, 4, timeout=180)
    got = ranks[0]
    # Ranks [[0, 1], [2, 3]]: 0 and 2 hold the same rows, 0 and 1 different ones.
    after = [r["gtp_after_step"] for r in ranks]
    assert all(torch.equal(a, b) for a, b in zip(after[0], after[2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after[1], after[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after[0], after[1], strict=True))
    assert got["floor"] == [-(-cfg.n_params // 2)]
    assert set(got["fsdp2_mesh"]) == {((2, 2), "(Replicate(), Shard(dim=0))")}
    assert got["gtp_axes"] == {(2, 2)}
    assert got["gtp_collectives"] == (True, True)


def test_memory_breakdown_names_what_is_live_at_the_peak() -> None:
    mb = _benchmark_module("memory_breakdown")
    engine = [{"filename": "/x/gtp_wrap/runtime/reduce.py", "name": "reduce_grad", "line": 1}]
    model = [{"filename": "/x/gtp_wrap/app/model.py", "name": "forward", "line": 65}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": engine},
        {"action": "alloc", "addr": 2, "size": 5, "frames": model},
        {"action": "free_completed", "addr": 2},
        {"action": "alloc", "addr": 3, "size": 7, "frames": []},  # the peak: 17 live
        {"action": "free_completed", "addr": 1},
        {"action": "alloc", "addr": 4, "size": 9, "frames": model},
    ]
    peak, groups = mb.peak_breakdown(trace, start=0)
    assert peak == 17
    assert groups == {"gtp_wrap/runtime/reduce.py:reduce_grad": 10, "backward (no Python frame)": 7}
    # Counting from event 4 on, the peak is 7 + 9 = 16, with the model's block live.
    assert mb.peak_breakdown(trace, start=4) == (
        16,
        {"model/step: model.py:forward:65": 9, "backward (no Python frame)": 7},
    )


def test_profile_summary_splits_kernel_time_by_kind(tmp_path: Path) -> None:
    pg = _benchmark_module("profile_gtp")
    kernels = [  # (name, start us, duration us) over 2 steps
        ("sm90_gemm_bf16", 0, 100),
        ("ncclDevKernel_AllGather_RING_LL", 50, 100),  # half under the GEMM
        ("elementwise_kernel", 100, 20),
        ("sm90_gemm_bf16", 300, 100),
        ("ncclDevKernel_ReduceScatter_Sum", 500, 40),  # under nothing
        ("c10d::symmetric_memory::barrier_kernel", 200, 10),  # a copy-engine collective's
        # cuDNN's attention, whose "sm90_" is no GEMM's
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 600, 30),
    ]
    events = [{"cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    # A copy-engine transfer: a memcpy, half under the second GEMM.
    events.append({"cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 350, "dur": 100})
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    out = pg.analyse_trace(tmp_path / "t.json", steps=2)
    assert out["all_gather"]["overlapped_with_gemm_share"] == 0.5
    assert out["reduce_scatter"]["overlapped_with_gemm_share"] == 0.0
    assert out["per_step_ms"] == {
        "gemm": 0.1, "attention": 0.015, "other_compute": 0.01, "compute_stream_busy": 0.125,
        "collective_kernels": 0.075,
    }  # fmt: skip
    assert out["memcpy"] == {
        "count_per_step": 0.5, "ms_per_step": 0.05, "overlapped_with_gemm_share": 0.5,
    }  # fmt: skip


def test_policy_overrides_parse_as_literals() -> None:
    bench = _benchmark_module("bench_step")
    got = dict(map(bench._field, ["collective_timeout_s=30.5", "prefetch_depth=2",
                                  "fp8_matmul=true", "collectives=copy_engine"]))  # fmt: skip
    assert got == {"collective_timeout_s": 30.5, "prefetch_depth": 2, "fp8_matmul": True,
                   "collectives": "copy_engine"}  # fmt: skip


def test_collective_counts_match_tensor_parallel_arithmetic(tmp_path: Path) -> None:
    """collective_counts.py on 2 CPU ranks (the smoke model): torch's TP with sequence
    parallelism moves 4 all-gathers and 4 reduce-scatters of tokens x d bf16 per layer per step
    (2 of each per pass), plus the head's gather and the embedding's in backward; GTP's and
    FSDP2's bytes do not depend on the batch."""
    out = tmp_path / "counts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(ROOT / "benchmarks/collective_counts.py"), "--model", "smoke", "--seq", "64",
           "--batch", "1", "4", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["method"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    layers, d = 2, 64
    for batch in (1, 4):
        tp = rows["tp", batch]
        assert tp["count_all_gather"] == 4 * layers + 2
        assert tp["count_reduce_scatter"] == 4 * layers
        assert tp["bytes_total"] == (8 * layers + 2) * batch * 64 * d * 2
    for method in ("gtp", "fsdp2"):
        assert rows[method, 1]["bytes_total"] == rows[method, 4]["bytes_total"] > 0


def test_benchmark_smoke_on_the_moe(tmp_path: Path) -> None:
    """bench_step.py on the smoke-sized mixture of experts: its expert stacks sharded by the
    MoE rules, every method runs."""
    methods = ["floor", "fsdp2", "gtp", "gtp_blocks"]
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_step.py"), "--smoke", "--plan",
           "moe_smoke:2", "--methods", *methods, "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["method"] for r in rows] == methods and all(r["step_ms"] > 0 for r in rows)
    assert all(r["model"] == "moe_smoke" for r in rows)


def test_step_phases_times_each_phase_and_the_engines_functions(tmp_path: Path) -> None:
    """The phases add up to the step, and the per-block functions run once per block call
    (the tiny GPT has 12 blocks: one BlockWeights forward and backward each per step), on
    this tree and on a baseline tree imported beside it (here this one again)."""
    out = tmp_path / "phases.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/step_phases.py"), "--rounds", "1",
           "--warmup", "2", "--steps", "3", "--methods", "floor", "amp", "gtp_blocks",
           "--fused-adamw", "--baseline", str(ROOT), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["ms"]) == ["floor", "amp", "gtp_blocks", "gtp_blocks@base"]
    assert {m: len(r) for m, r in result["rounds_ms"].items()} == dict.fromkeys(result["ms"], 1)
    # Each gtp method ran on its own tree's engine.
    assert result["packages"]["gtp_blocks"] == "gtp_wrap"
    assert result["packages"]["gtp_blocks@base"] == "gtp_wrap_baseline"
    for method in result["ms"]:
        ms = result["ms"][method]
        phases = sum(ms[p] for p in ("forward", "backward", "optimizer", "zero_grad"))
        assert 0 < phases <= ms["step"] * 1.5  # medians of parts: near the step's median
        # The process's CPU time over the phases: one thread on CPU, so about the wall time.
        assert 0.5 * phases < ms["step_cpu"] <= ms["step"] * 1.5
    calls = result["calls_per_step"]
    assert calls["floor"] == calls["amp"] == {}
    for method in ("gtp_blocks", "gtp_blocks@base"):
        assert calls[method]["BlockWeights.forward"] == 12
        assert calls[method]["BlockWeights.backward"] == 12
        blocks = result["ms"][method]
        assert 0 < blocks["GradReducer.reduce_grads"] < blocks["BlockWeights.backward"]
    assert "| BlockWeights.backward |" in proc.stdout


def test_paired_steps_ratios_are_medians_of_each_cycles_two_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Methods take turns a step at a time; a ratio is the median, over the cycles, of a
    method's step over the reference's step of the same cycle, inside its interval, and the
    JSON reads as stored runs for `gtp-plan validate`; a baseline tree's gtp methods (here
    this tree's again) take their turns too, and are no stored runs."""
    out = tmp_path / "paired.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/paired_steps.py"), "--cycles", "7",
           "--warmup", "2", "--methods", "floor", "gtp_blocks", "--baseline", str(ROOT),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    steps = result["steps_ms"]
    assert {m: len(t) for m, t in steps.items()} == {"floor": 7, "gtp_blocks": 7,
                                                     "gtp_blocks@base": 7}  # fmt: skip
    assert "gtp_blocks@base" in result["ratios"]
    to_base = sorted(
        a / b for a, b in zip(steps["gtp_blocks"], steps["gtp_blocks@base"], strict=True)
    )
    assert result["against_base"]["gtp_blocks"]["median"] == pytest.approx(to_base[3])
    assert "gtp_blocks / gtp_blocks@base: " in proc.stdout
    per_cycle = sorted(b / f for b, f in zip(steps["gtp_blocks"], steps["floor"], strict=True))
    ratio = result["ratios"]["gtp_blocks"]
    assert ratio["median"] == pytest.approx(per_cycle[3])
    assert ratio["low"] <= ratio["median"] <= ratio["high"]
    assert result["ms"]["floor"]["step"] == pytest.approx(sorted(steps["floor"])[3])
    # The host probe took a turn in each cycle; its median is the run's host speed.
    assert len(result["probe_ms"]) == 7
    assert result["host_probe_ms"] == pytest.approx(sorted(result["probe_ms"])[3])
    stored_runs = _benchmark_module("stored_runs")
    monkeypatch.setitem(stored_runs.MODELS, "tiny", "tiny")  # the cost model knows 125M and up
    runs = stored_runs.phases_runs(out)
    assert [(r["method"], r["measured_ms"]) for r in runs] == [
        (m, round(result["ms"][m]["step"], 2)) for m in ("floor", "gtp_blocks")
    ]


def test_paired_steps_run_without_a_process_group_as_calibrate_runs_them() -> None:
    """calibrate.py times its host-bound steps in its own process, with no process group."""
    ps = _benchmark_module("paired_steps")
    assert not torch.distributed.is_initialized()
    result = ps.paired(torch.device("cpu"), ps.MODELS["tiny"], batch=1, seq=16,
                       methods=["floor", "gtp_blocks"], cycles=3, warmup=1, fused_adamw=False,
                       probe=None)  # fmt: skip
    assert [len(result["steps_ms"][m]) for m in ("floor", "gtp_blocks")] == [3, 3]
    assert result["ratios"]["gtp_blocks"]["median"] > 0


def test_median_interval_takes_order_statistics_two_binomial_deviations_out() -> None:
    median_interval = _benchmark_module("paired_steps").median_interval
    # 100 values: the median 50.5; ranks 50 -/+ 9.8 give the 41st and 61st smallest.
    assert median_interval([float(v) for v in range(100, 0, -1)]) == (50.5, 41.0, 61.0)
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)


def test_step_phases_in_a_faked_world_runs_the_engines_gathers(tmp_path: Path) -> None:
    """--fake-world 2: the world-of-two path on one device, collectives faked: every sharded
    weight of the tiny GPT (5 per block, 12 blocks, the embedding and head, 62 in all) is
    gathered once in forward and once more in backward (all but the embedding, whose
    backward needs only its indices), FSDP2 runs beside it, and the peer rank only warms up."""
    out = tmp_path / "phases.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/step_phases.py"), "--rounds", "1",
           "--warmup", "2", "--steps", "2", "--methods", "floor", "gtp_blocks", "fsdp2",
           "--fake-world", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and list(result["ms"]) == ["floor", "gtp_blocks", "fsdp2"]
    calls = result["calls_per_step"]["gtp_blocks"]
    assert calls["Gatherer.gather"] == 62 + 61
    assert calls["GradReducer.reduce_grad"] == 62
    assert calls["BlockWeights.forward"] == calls["BlockWeights.backward"] == 12
    assert all(result["ms"][m]["step"] > 0 for m in result["ms"])
    assert result["host_probe_ms"] > 0  # the host's speed, for gtp-plan validate


def test_host_profile_splits_a_use_and_profiles_each_world(tmp_path: Path) -> None:
    """host_profile.py: per weight use, forward, backward, backward on the calling thread and
    zero_grad, for a world of one and a faked world of two; both profiles hold the backward
    (recorded on the calling thread), and only the two-rank one its gathers and
    reduce-scatters."""
    cmd = [sys.executable, str(ROOT / "benchmarks/host_profile.py"), "--steps", "3",
           "--rounds", "1", "--weights", "4", "--top", "0", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for world in ("world1", "world2_fake"):
        per_use = json.loads((tmp_path / f"per_use_{world}.json").read_text())
        assert {"forward", "backward", "backward_one_thread", "zero_grad"} <= set(per_use)
        assert all(per_use[f"plain_{p}_us"] > 0 for p in ("forward", "backward"))
    one = (tmp_path / "profile_world1.txt").read_text()
    two = (tmp_path / "profile_world2_fake.txt").read_text()
    assert "uses.py" in one and "uses.py" in two  # the engine's own functions
    assert "(reduce_grad)" in one and "(reduce_grad)" in two  # backward's, on the calling thread
    assert "_allgather_base" not in one and "_allgather_base" in two
    assert "_reduce_scatter_base" not in one and "_reduce_scatter_base" in two


def test_calibrate_times_a_use_of_two_ranks_in_a_faked_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """calibrate.py's `use_us` on a one-GPU machine comes from the faked world of two, rank 0
    on the device (here the CPU): the two-rank path (gathers, waits, reduce-scatters) costs
    more host time per use than a world of one, which issues none."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the spawned ranks import from it
    cal = _benchmark_module("calibrate")
    policy = {"param_dtype": "bfloat16"}
    faked = cal.measure_use_us_faked(cal.Budget(120), policy)
    local = cal.measure_use_us(torch.device("cpu"), policy)
    assert faked > local > 0, (faked, local)


def test_calibrate_refit_reproduces_what_the_run_fitted(tmp_path: Path) -> None:
    """`calibrate.py --refit` fits the elementwise bytes, the cost per layer and `block_us`
    again to a calibration's own stored runs: from cpu_gloo.json, values changed, it gives back
    what that JSON holds (the 2026-12-04 run's fit, under the model's counts then and now), and
    a second refit changes no value."""
    stored = json.loads((ROOT / "benchmarks/calibration/cpu_gloo.json").read_text())
    raw = json.loads(json.dumps(stored))
    raw["compute"]["elementwise_bytes"]["value"] = 1.0  # what the refit must recover
    raw["host"]["block_us"]["value"] = 123.0
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(raw))
    cmd = [sys.executable, str(ROOT / "benchmarks/calibrate.py"), "--refit", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refit = json.loads(path.read_text())
    for part, key in (("compute", "elementwise_bytes"), ("host", "layer_us"), ("host", "block_us")):
        assert refit[part][key]["value"] == pytest.approx(stored[part][key]["value"], rel=1e-5)
        assert "refitted to its runs by calibrate.py --refit" in refit[part][key]["source"]
    assert refit["runs"] == stored["runs"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(path.read_text())
    assert again == refit  # the same values, and each source's note once


def test_host_fit_reproduces_the_host_bound_steps_it_is_fitted_to() -> None:
    """On a GPU calibrate.py fits the host's time per layer to the 125M floor at batch 1, per
    intercepted use to gtp, per block to gtp_blocks and per FSDP2 group to fsdp2
    (paired_steps.py's runs, marked with what they fit): the model then predicts all four steps
    as measured, at the probe the runs carry, a use in a sharded group moves with the world-1
    use, and a slower host's steps get proportionally more host time."""
    cal = _benchmark_module("calibrate")
    from gtp_wrap.scaling import validate
    from gtp_wrap.scaling.cluster import cluster_from_dict
    from gtp_wrap.scaling.predict import predict

    raw = json.loads((ROOT / "benchmarks/calibration/h100.json").read_text())
    probe = raw["host_probe_ms"]["value"]
    use_us, use_us_local = raw["host"]["use_us"]["value"], raw["host"]["use_us_local"]["value"]
    step = {"model": "gpt_125m", "batch": 1, "seq": 2048, "mesh": "", "host_probe_ms": probe,
            "source": "test", "calibration": False}  # fmt: skip
    floor = dict(step, method="floor", measured_ms=30.0, fits="layer_us")
    gtp = dict(step, method="gtp", measured_ms=45.0, fits="use_us_local")
    blocks = dict(step, method="gtp_blocks", measured_ms=36.0, fits="block_us")
    fsdp2 = dict(step, method="fsdp2", measured_ms=70.0, fits="fsdp2_block_us_local")
    raw["runs"] = [fsdp2, blocks, gtp, floor]  # fitted in HOST_FIT's order, not the runs'
    fitted = cal.fit_host(raw)
    assert list(fitted) == [
        "layer_us", "use_us_local", "use_us", "block_us", "fsdp2_block_us_local"
    ]  # fmt: skip
    assert all(run["calibration"] for run in raw["runs"])
    cluster = cluster_from_dict(raw, "test")
    for run in raw["runs"]:
        assert validate.predicted_ms(cluster, run) == pytest.approx(run["measured_ms"], rel=1e-4)
    # Both uses were timed on the Linears: the sharded one stays as far above as measured.
    assert abs(fitted["use_us_local"][0] - use_us_local) > 1.0  # the 45 ms step asked for it
    assert fitted["use_us"][0] - fitted["use_us_local"][0] == pytest.approx(use_us - use_us_local)
    assert cal.USE_LINEARS in fitted["use_us"][1]
    # FSDP2's fit is its world-1 groups'; over two ranks it keeps the measured per-group time.
    assert cluster.host.fsdp2_block_us == raw["host"]["fsdp2_block_us"]["value"]
    at = [
        validate.predicted_ms(cluster, dict(floor, host_probe_ms=k * probe)) for k in (1, 2, 3, 4)
    ]
    measured = floor["measured_ms"]
    # A doubled probe adds the host's whole time at the calibration's speed (what each further
    # probe's worth adds, below), and leaves the device's time as it was.
    assert at[1] == pytest.approx(measured + at[3] - at[2], rel=0.01)
    one, two = (
        predict(validate.plan_of(cluster, dict(floor, host_probe_ms=k * probe))[0], "floor")
        for k in (1, 2)
    )
    assert two.compute == pytest.approx(one.compute) and one.compute > 0
    # Once the host alone sets the step, each further probe's worth adds the same host time.
    assert at[3] - at[2] == pytest.approx(at[2] - at[1], rel=1e-6)


def _refitted(raw: dict, tmp_path: Path) -> dict:
    """`raw` as `calibrate.py --refit` writes it back."""
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(raw))
    cmd = [sys.executable, str(ROOT / "benchmarks/calibrate.py"), "--refit", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())


def test_calibrate_refit_fits_the_gemm_rate_to_stored_gemm_timings(tmp_path: Path) -> None:
    """With `gemm_samples` stored (calibrate.py keeps every GEMM it timed), `--refit` fits the
    GEMM rate and cost per GEMM again: timings the wave model gives at 500 GFLOP/s and 7 µs a
    GEMM come back as those two numbers."""
    from gtp_wrap.scaling.cluster import cluster_from_dict
    from gtp_wrap.scaling.predict import gemm_s

    raw = json.loads((ROOT / "benchmarks/calibration/cpu_gloo.json").read_text())
    truth = dict(raw["compute"], gemm_tflops=0.5, gemm_overhead_us=7.0)
    cluster = cluster_from_dict(dict(raw, compute=truth), "truth")
    shapes = [(256, 256, 688), (1024, 688, 256), (256, 1024, 256), (64, 256, 256)]
    raw["gemm_samples"] = [
        {"m": m, "k": k, "n": n, "seconds": gemm_s(cluster, m, n, k)} for m, k, n in shapes
    ]
    compute = _refitted(raw, tmp_path)["compute"]
    assert compute["gemm_tflops"]["value"] == pytest.approx(0.5, rel=1e-4)
    assert compute["gemm_overhead_us"]["value"] == pytest.approx(7.0, rel=1e-4)


def test_step_kernels_time_every_gemm_shape_of_the_step_and_its_attention() -> None:
    """calibrate.py times a GPU's GEMMs and attention in the plain model's steps (see [Note:
    kernels timed in the step]): every GEMM a step runs appears once by shape, with its count
    per step (on a CPU, where the test runs, the ops' own time): forward, input and weight
    gradient of each weight use but the embedding's lookup, at each batch; and attention's time
    at each batch."""
    import dataclasses

    cal = _benchmark_module("calibrate")
    from gtp_wrap.scaling.model import MODELS
    from gtp_wrap.scaling.predict import pass_order

    model = dataclasses.replace(
        MODELS["gpt_125m"], layers=2, seq=32, d=64, heads=4, ffn=128, vocab=256
    )
    gemms, attention = cal.measure_step_kernels(model, [1, 2], torch.device("cpu"), torch.float32)
    for batch in (1, 2):
        m = batch * model.seq
        expected: dict[tuple[int, int, int], int] = {}
        for w, _ in pass_order(model, backward=False):
            if w.kind != "embedding":
                for shape in ((m, w.cols, w.rows), (m, w.rows, w.cols), (w.rows, m, w.cols)):
                    expected[shape] = expected.get(shape, 0) + 1
        timed = {(g["m"], g["k"], g["n"]): g["per_step"] for g in gemms if g["batch"] == batch}
        assert timed == expected
    assert [a["batch"] for a in attention] == [1, 2]
    assert all(a["seconds"] > 0 for a in attention)


def test_calibrate_refit_fits_attention_to_stored_attention_timings(tmp_path: Path) -> None:
    """A GPU calibration stores its steps' attention time per batch (`attention_samples`):
    `--refit` fits attention's rate and fixed time per layer again, and timings the cost
    model gives at 300 TFLOP/s and 50 µs a layer come back as those two numbers."""
    from gtp_wrap.scaling.cluster import cluster_from_dict
    from gtp_wrap.scaling.predict import attention_layer_s
    from gtp_wrap.scaling.validate import run_model

    raw = json.loads((ROOT / "benchmarks/calibration/cpu_gloo.json").read_text())
    truth = dict(raw["compute"], attention_tflops=300.0, attention_layer_us=50.0)
    cluster = cluster_from_dict(dict(raw, compute=truth), "truth")
    plain = next(r for r in raw["runs"] if r.get("calibration") and r["method"] == "plain")
    model = run_model(plain)
    raw["attention_samples"] = [
        {"batch": b, "seconds": model.layers * attention_layer_s(cluster, model, b * model.seq)}
        for b in (1, 8)
    ]
    raw["compute"]["attention_layer_us"] = {"value": 0.0, "source": "a test"}
    compute = _refitted(raw, tmp_path)["compute"]
    assert compute["attention_tflops"]["value"] == pytest.approx(300.0, rel=1e-4)
    assert compute["attention_layer_us"]["value"] == pytest.approx(50.0, rel=1e-4)


def _python_calls(rank: int, world: int) -> dict[str, list[float]]:
    ho = _benchmark_module("host_overhead")
    x = torch.randn(4, 16)
    calls: dict[str, list[float]] = {}
    for block in (0, 4):
        for _ in range(2):
            model = ho._wrap(ho._model(8, 16, False, block, "cpu"), ho.POLICIES["bf16"], block)
            calls.setdefault(f"block{block}", []).append(ho._python_calls_per_step(model, x))
    calls["plain"] = [ho._python_calls_per_step(ho._model(8, 16, False, 0, "cpu"), x)]
    return calls


def test_python_calls_per_step_are_the_same_on_every_run() -> None:
    """host_overhead.py's Python-call count is deterministic (two fresh models count the same),
    at a world of one and in a faked world of two (the path of two ranks' gathers, waits and
    reduce-scatters, without gloo's polling waits), which makes more calls; and blocks on
    gathered weights make fewer calls than per-use interception."""
    (one,) = run_ranks(_python_calls, 1)
    two = run_ranks(_python_calls, 2, backend="fake")[0]
    for calls in (one, two):
        for key in ("block0", "block4"):
            assert calls[key][0] == calls[key][1], calls
        assert calls["plain"][0] < calls["block4"][0] < calls["block0"][0], calls
    assert one["block0"][0] < two["block0"][0] and one["block4"][0] < two["block4"][0]
