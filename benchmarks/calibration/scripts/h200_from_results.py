"""Write benchmarks/calibration/h200.json from earlier H200 measurements in benchmarks/results.

    python benchmarks/calibration/scripts/h200_from_results.py

Every number in the JSON names the file (and field) it comes from, or says it is nominal.
What is fitted here, and from which runs, is marked: those runs are the calibration set
(`"calibration": true` in `runs`); every other run listed is held out, predicted from the
fitted numbers only. The single-GPU and 2xH200 runs are read from the bench_step JSONs that
benchmarks/RESULTS.md reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[1]
RESULTS = CALIBRATION.parent / "results"
sys.path.insert(0, str(CALIBRATION.parents[1]))
sys.path.insert(0, str(CALIBRATION.parent))

from calibrate import nonneg_least_squares  # noqa: E402
from stored_runs import with_added  # noqa: E402
from trace_events import gemm_named, is_attention  # noqa: E402

from gtp_wrap.scaling.baselines import fsdp2  # noqa: E402
from gtp_wrap.scaling.cluster import cluster_from_dict  # noqa: E402
from gtp_wrap.scaling.mesh import Mesh  # noqa: E402
from gtp_wrap.scaling.model import GPT_1P36B, GPT_125M  # noqa: E402
from gtp_wrap.scaling.predict import (  # noqa: E402
    ATTENTION_BACKWARD,
    Plan,
    loss_bytes,
    pass_order,
    predict,
    weight_gemms_s,
)


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def src(value: float, source: str) -> dict:
    return {"value": float(f"{value:.6g}"), "source": source}


def rows_of(name: str) -> list[dict]:
    return load(name)["rows"]


def collective_fit(kind: str, elem_bytes: int) -> tuple[float, float]:
    """α (µs) and GB/s of one flat collective on 2 ranks, least squares over the three sizes
    of results/collectives.json (each rank receives half the buffer)."""
    res = load("collectives.json")["results"]
    xs = [res[k]["numel"] * elem_bytes / 2 for k in ("1 layer", "2 layers", "embedding")]
    ys = [res[k][f"{kind}/flat_ms"] * 1e-3 for k in ("1 layer", "2 layers", "embedding")]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return (my - slope * mx) * 1e6, 1 / slope / 1e9


def skeleton() -> dict:
    """The JSON with unit rates where the fit fills in, to count FLOPs and tiles with."""
    ag_alpha, ag_gbs = collective_fit("all_gather", 2)
    rs_alpha, rs_gbs = collective_fit("reduce_scatter", 4)
    coll = "results/collectives.json: flat all-gathers (bf16) / reduce-scatters (fp32) of 1 and 2 "
    coll += "1.36B layers and the embedding on 2xH200 (NCCL 2.28.9), least squares"
    contention = load("contention.json")["nccl_all_gather"]["gemm_slowdown"]
    opt = next(r for r in rows_of("optimizer_step_1p36b_world1.json") if r["mode"] == "adamw")
    hbm = GPT_1P36B.n_params * 28 / (opt["optimizer_ms"] * 1e-3) / 1e9
    host_use = load("profile_b1_final_gtp.json")["host_us_per_weight_use"]
    host_local = load("host_overhead_cuda_1202.json")["world1"]["bf16"]["per_use_us"]
    nominal_ib = "nominal: 400 Gb/s NDR InfiniBand per GPU (50 GB/s) at 90 %; not measured here"
    return {
        "name": "h200",
        "description": "NVIDIA H200 SXM nodes of 8 (NVLink 4 / NVSwitch), one 400 Gb/s NIC per "
        "GPU. Intra-node curves, compute, HBM and host costs measured on 1-2 H200s "
        "(benchmarks/results); inter-node curves and ring hops nominal",
        "nominal": False,
        "gpus_per_node": src(8, "nominal: HGX H200 8-GPU node"),
        "memory_gib": src(139, "the GPU machine's H200: about 139 GiB usable (141 GB datasheet)"),
        "async_host": True,
        "grouped_collectives": True,
        "contention_compute": src(
            contention, "results/contention.json: nccl_all_gather.gemm_slowdown"
        ),
        "contention_comm": src(1.0, "assumed: NCCL's bandwidth beside GEMMs not measured"),
        "links": {
            "intra": {
                "all_gather": {
                    "alpha_us": src(ag_alpha, coll),
                    "gbs": src(ag_gbs, coll),
                    "hop_us": src(1.0, "nominal NVLink ring hop; 2 ranks measured"),
                },
                "reduce_scatter": {
                    "alpha_us": src(rs_alpha, coll),
                    "gbs": src(rs_gbs, coll),
                    "hop_us": src(1.0, "nominal NVLink ring hop"),
                },
            },
            "inter": {
                "all_gather": {
                    "alpha_us": src(30, nominal_ib),
                    "gbs": src(45, nominal_ib),
                    "hop_us": src(5, nominal_ib),
                },
                "reduce_scatter": {
                    "alpha_us": src(30, nominal_ib),
                    "gbs": src(45, nominal_ib),
                    "hop_us": src(5, nominal_ib),
                },
            },
        },
        "compute": {
            "gemm_tflops": 1.0,
            "gemm_overhead_us": 0.0,
            "gemm_units": src(132, "H200 SXM: 132 SMs"),
            "gemm_tile_m": src(128, "cuBLAS nvjet 128x256 tiles (profile_b1_grouped_floor.json)"),
            "gemm_tile_n": src(256, "cuBLAS nvjet 128x256 tiles (profile_b1_grouped_floor.json)"),
            "attention_tflops": 1.0,
            "hbm_gbs": src(
                hbm,
                "results/optimizer_step_1p36b_world1.json: fused AdamW over the "
                "1.36B model, 28 bytes per parameter, in optimizer_ms",
            ),
            "elementwise_bytes": 0.0,
            "layer_overhead_us": 0.0,
        },
        "host": {
            "layer_us": 0.0,
            "step_us": src(1000, "estimate: loss, fused AdamW launch, zero_grad"),
            "use_us_local": src(
                host_local, "results/host_overhead_cuda_1202.json: world1.bf16.per_use_us"
            ),
            "use_us": src(
                host_use,
                "results/profile_b1_final_gtp.json: host_us_per_weight_use "
                "(1.36B batch 1, 2xH200, eager)",
            ),
            "graph_step_us": src(50, "estimate: one CUDA graph replay launch"),
            "block_us": 0.0,
            "fsdp2_block_us": src(
                2000, "../shared/GPU.md: FSDP2 adds ~2 ms per module group per step"
            ),
        },
    }


def gemm_parts(raw: dict, plan_of) -> tuple[float, int]:
    """(seconds at 1 TFLOP/s with no overhead, GEMM count) of a floor step's weight GEMMs."""
    cluster = cluster_from_dict(raw, "skeleton")
    plan = plan_of(cluster)
    total, count = 0.0, 0
    for backward in (False, True):
        for w, _ in pass_order(plan.cfg, backward):
            if w.kind != "embedding":
                total += weight_gemms_s(plan, w, backward)
                count += 2 if backward else 1
    return total, count


KERNELS = "results/kernels_1206/h200_floor_{}_b{}.json"  # the floor's kernels, 2026-12-06
FLOORS = [(GPT_125M, "125M", 1), (GPT_125M, "125M", 8), (GPT_1P36B, "1.36B", 1),
          (GPT_1P36B, "1.36B", 8)]  # fmt: skip


def floor_kernels(name: str, batch: int) -> tuple[float, float, float]:
    """(GEMMs, attention, the rest) of the world-1 floor step at `name` and `batch`, ms, from
    its profile's summary. Profiles of that day counted cuDNN's attention kernels among the
    GEMMs (their names match "sm90_", benchmarks/trace_events.py): those, listed among each
    step's 25 longest kernels at every point, are taken out of the GEMMs' time and are
    attention's here. Its small cudnn::fusion kernels (about 10 % of attention on an H100)
    are listed at some points only, so they stay in the rest everywhere, which the elementwise
    bytes and the small kernels per layer take."""
    trace = load(KERNELS.format(name, batch).removeprefix("results/"))["trace"]
    sdpa = sum(
        k["ms"]
        for k in trace["top_kernels_per_step"]
        if is_attention(k["name"]) and gemm_named(k["name"])
    )
    ms = trace["per_step_ms"]
    gemm = ms["gemm"] - sdpa
    return gemm, sdpa, ms["compute_stream_busy"] - gemm - sdpa


def fit(raw: dict) -> dict:
    """GEMM rate and overhead, attention's rate and fixed time per layer from the world-1
    floor's kernels at 125M and 1.36B, batch 1 and 8 (2026-12-06), the elementwise bytes from
    the 1.36B ones at batch 1 and 8, and the layer overhead from the graphed floor at 125M
    batch 1."""
    kernels = {(name, batch): floor_kernels(name, batch) for _, name, batch in FLOORS}
    where = "results/kernels_1206/h200_floor_*.json (125M and 1.36B, batch 1 and 8)"

    def plan_at(model, batch: int):
        return lambda cl: Plan(model, cl, Mesh(), batch=batch, seq=2048)

    # GEMMs: ms = flops / rate + count * overhead, in relative errors over the four steps
    rows, ys = [], []
    for model, name, batch in FLOORS:
        flops, count = gemm_parts(raw, plan_at(model, batch))
        gemm_s = kernels[(name, batch)][0] * 1e-3
        rows.append([flops / gemm_s, count / gemm_s])
        ys.append(1.0)
    inv_rate, overhead = nonneg_least_squares(rows, ys)
    c = raw["compute"]
    c["gemm_tflops"] = src(
        1 / inv_rate, f"{where}: per_step_ms.gemm less attention's kernels (fit, wave model)"
    )
    c["gemm_overhead_us"] = src(overhead * 1e6, f"{where}: the same fit's intercept per GEMM")
    # Attention: s = layers * (tokens * flops per token / rate + fixed)
    rows, ys = [], []
    for model, name, batch in FLOORS:
        flops = batch * 2048 * model.attention_flops_per_token() * (1 + ATTENTION_BACKWARD)
        rows.append([model.layers * flops, model.layers])
        ys.append(kernels[(name, batch)][1] * 1e-3)
    inv_rate, fixed = nonneg_least_squares(rows, ys)
    c["attention_tflops"] = src(
        1 / inv_rate / 1e12, f"{where}: cuDNN's SDPA kernels, not its small fusion ones (slope)"
    )
    c["attention_layer_us"] = src(fixed * 1e6, f"{where}: the same fit's intercept per layer")
    # The rest grows by the same per batch: the 1.36B model's, less the loss, is elementwise.
    m = GPT_1P36B
    per_batch_s = (kernels[("1.36B", 8)][2] - kernels[("1.36B", 1)][2]) / 7 * 1e-3
    hbm = c["hbm_gbs"]["value"] * 1e9
    elementwise_s = per_batch_s - 2048 * m.vocab * loss_bytes(2) / hbm  # bf16 logits
    c["elementwise_bytes"] = src(
        elementwise_s * hbm / (2048 * m.layers * (m.d + m.ffn)),
        f"{where}: the 1.36B floor's kernels beyond GEMMs and attention per batch, less the loss",
    )
    # The graphed floor at 125M batch 1 (world 2): what the rates above leave is small kernels.
    cl = cluster_from_dict(raw, "partial")
    measured = next(
        r
        for r in rows_of("bench_floor_graph_all.json")
        if r["model"] == "125M" and r["method"] == "floor_graph"
    )["step_ms"]
    before = predict(Plan(GPT_125M, cl, Mesh(gtp=2), 1, 2048, graphed=True), "floor").step
    c["layer_overhead_us"] = src(
        (measured * 1e-3 - before) / GPT_125M.layers * 1e6,
        "results/bench_floor_graph_all.json: 125M batch-1 floor_graph, less "
        "the rates above, per layer",
    )
    fit_host_probed(raw)
    c.update(fit_decode())
    return raw


def fit_decode() -> dict:
    """The fused decode kernels' time per use and per element, fitted over the three 1.36B
    weight shapes (eager, CUDA events, one H200)."""
    rows = load("low_precision_gathers_decode.json")["weights"]
    out = {}
    for dtype in ("fp8", "nvfp4"):
        xs = [r["shape"][0] * r["shape"][1] for r in rows]
        ys = [r[f"{dtype}_ms"] * 1e-3 for r in rows]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        where = f"results/low_precision_gathers_decode.json: {dtype}_ms against elements"
        out[f"{dtype}_decode_us"] = src((my - slope * mx) * 1e6, f"{where}, intercept")
        out[f"{dtype}_decode_ns"] = src(slope * 1e9, f"{where}, slope")
    return out


def bisect_host(raw: dict, key: str, predicted_ms, measured_ms: float, hi: float) -> float:
    """The value of host cost `key` (µs) at which `predicted_ms(cluster)` meets the measured
    step (the step grows with it)."""
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        raw["host"][key] = mid
        cluster = cluster_from_dict(raw, key)
        lo, hi = (mid, hi) if predicted_ms(cluster) < measured_ms else (lo, mid)
    return lo


def fit_fsdp2(raw: dict, measured_ms: float, source: str, mesh: Mesh, host_slowdown: float) -> dict:
    """FSDP2's host time per block and step, bisected to its 1.36B batch-1 eager step (it is
    host-bound there; ../shared/GPU.md's ~2 ms per module group is where the search starts),
    on a host `host_slowdown` times slower than the calibration's."""

    def predicted(cl) -> float:
        plan = Plan(GPT_1P36B, cl, mesh, 1, 2048, host_slowdown=host_slowdown)
        return fsdp2(plan).step * 1e3

    value = bisect_host(raw, "fsdp2_block_us", predicted, measured_ms, 20000.0)
    return src(value, f"{source}: 1.36B batch-1 fsdp2 step (fit)")


def probed_row(model: str, method: str) -> dict:
    return next(
        r for r in rows_of(PROBED[0]) if (r["model"], r["batch"], r["method"]) == (model, 1, method)
    )


def fit_host_probed(raw: dict) -> None:
    """The host costs from one bench_step run that carries the host probe (PROBED[0]), with
    that probe: the eager floor's host time per layer (125M batch 1, host-bound), GTP's per
    use in a group of one (its eager 125M batch-1 step, fit), FSDP2's per block (its 1.36B
    batch-1 step, fit), all on one host at one time; the last two each with its own probe
    against the floor's, as `gtp-plan validate` predicts them."""
    where = f"results/{PROBED[0]}"
    floor = probed_row("125M", "floor")
    step_us = raw["host"]["step_us"]["value"]
    raw["host"]["layer_us"] = src(
        (floor["step_ms"] * 1e3 - step_us) / GPT_125M.layers,
        f"{where}: 125M batch-1 eager floor (host-bound), less step_us, per layer",
    )
    raw["host_probe_ms"] = src(
        floor["host_probe_ms"], f"{where}: benchmarks/host_probe.py beside that floor"
    )
    gtp = probed_row("125M", "gtp")

    def predicted(cl) -> float:
        slower = gtp["host_probe_ms"] / floor["host_probe_ms"]
        return predict(Plan(GPT_125M, cl, Mesh(), 1, 2048, host_slowdown=slower), "gtp").step * 1e3

    raw["host"]["use_us_local"] = src(
        bisect_host(raw, "use_us_local", predicted, gtp["step_ms"], 2000.0),
        f"{where}: 125M batch-1 eager gtp step, world 1 (fit)",
    )
    fsdp = probed_row("1.36B", "fsdp2")
    slower = fsdp["host_probe_ms"] / floor["host_probe_ms"]
    raw["host"]["fsdp2_block_us"] = fit_fsdp2(raw, fsdp["step_ms"], where, Mesh(), slower)
    fit_block(raw)


# A step_phases.py run of the eager floor and gtp_blocks in one process (no --baseline), 125M
# batch 1, world 1: their ratio fits `block_us` (below).
BLOCKS = "cpu_time_1204/phases_a.json"


def fit_block(raw: dict) -> None:
    """The host time per block on gathered weights and step, bisected to gtp_blocks' 125M
    batch-1 step over the eager floor's in one process (both host-bound, so their ratio
    carries over to the calibration's host, where the floor is predicted as measured)."""
    ms = load(BLOCKS)["ms"]
    ratio = ms["gtp_blocks"]["step"] / ms["floor"]["step"]

    def plan(cl) -> Plan:
        return Plan(GPT_125M, cl, Mesh(), 1, 2048)

    floor_ms = predict(plan(cluster_from_dict(raw, "block_us")), "floor").step * 1e3
    value = bisect_host(
        raw, "block_us", lambda cl: predict(plan(cl), "gtp_blocks").step * 1e3,
        ratio * floor_ms, 5000.0,
    )  # fmt: skip
    raw["host"]["block_us"] = src(
        value,
        f"results/{BLOCKS}: 125M batch-1 gtp_blocks step over the eager floor's "
        f"({ratio:.3f}), world 1 (fit)",
    )


# bench_step runs that carry the host probe (benchmarks/host_probe.py), the first one the host
# calibration (fit_host_probed).
PROBED = [
    "host_probe_1203/bench_probe_1624.json",
    "host_probe_1203/bench_probe_1637.json",
    "host_probe_1203/bench_probe_1657.json",
    "blocks_1204/bench.json",  # predicted before it ran: blocks_1204/predicted.json
]
PROBED_CALIBRATION = {("125M", 1, "floor"), ("125M", 1, "gtp"), ("1.36B", 1, "fsdp2")}
NONE: set[tuple[str, int, str]] = set()
# (results file, its rows as [(model, batch, method)] or "all", the rows the fits were made
# on: the calibration set); every other row listed is held out.
RUNS = [
    ("bench_floor_graph_all.json", [("125M", 1, "floor_graph")], {("125M", 1, "floor_graph")}),
    ("bench_fused_adamw.json", [("125M", 1, "floor"), ("1.36B", 1, "fsdp2")], NONE),
    ("bench_one_gpu_world1.json", "all", NONE),
    (
        "bench_125m_b1_final_1202_1523.json",
        [("125M", 1, m) for m in ("floor", "floor_graph", "gtp", "gtp_graph")],
        NONE,
    ),
    (
        "bench_fused_adamw.json",
        [
            (mo, b, m)
            for mo, b in (("1.36B", 1), ("1.36B", 4), ("1.36B", 8), ("125M", 1))
            for m in ("floor", "fsdp2", "gtp", "gtp_graph")
            if (mo, m) not in (("125M", "floor"), ("1.36B", "fsdp2")) or b != 1
        ],
        NONE,
    ),
    ("bench_fused_adamw_reversed.json", "all", NONE),
    ("bench_copy_engine_base.json", "all", NONE),
    ("bench_floor_graph_all.json", [("1.36B", b, "floor_graph") for b in (1, 4, 8)], NONE),
    (PROBED[0], "all", PROBED_CALIBRATION),
    *((name, "all", NONE) for name in PROBED[1:]),
]
MODEL_NAMES = {"1.36B": "gpt_1p36b", "125M": "gpt_125m"}


def runs() -> list[dict]:
    out = []
    for name, which, calibration in RUNS:
        data = load(name)
        world = data["meta"]["world"]
        for r in data["rows"]:
            key = (r["model"], r["batch"], r["method"])
            if which != "all" and key not in which:
                continue
            if r["method"] not in ("floor", "floor_graph", "gtp", "gtp_graph", "gtp_blocks",
                                   "fsdp2"):  # fmt: skip
                continue
            out.append(
                {
                    "model": MODEL_NAMES[r["model"]],
                    "batch": r["batch"],
                    "seq": r["seq"],
                    "mesh": f"gtp={world}" if world > 1 else "",
                    "method": r["method"],
                    "measured_ms": round(r["step_ms"], 2),
                    **({"host_probe_ms": r["host_probe_ms"]} if "host_probe_ms" in r else {}),
                    "source": f"results/{name}",
                    "calibration": key in calibration,
                }
            )
    return out


def calibrate_runs() -> list[dict]:
    """Step runs that benchmarks/calibrate.py measured on one H200 (results/scaling/), held out."""
    out = []
    for path in sorted((RESULTS / "scaling").glob("calibrate_h200_*.json")):
        for r in json.loads(path.read_text())["runs"]:
            if r["method"] != "plain":
                out.append(dict(r, source=f"results/scaling/{path.name}", calibration=False))
    return out


def main() -> None:
    raw = fit(skeleton())
    out = CALIBRATION / "h200.json"
    raw["runs"] = with_added(out, runs() + calibrate_runs())
    out.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {out}: {len(raw['runs'])} runs")


if __name__ == "__main__":
    main()
