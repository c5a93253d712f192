"""The cost model's answers for the README's "Planning at scale" section: validation tables,
the seed's configurations, GTP against FSDP2 and TP, and where NVFP4 gathers pay off. Writes
benchmarks/results/scaling/.

    python benchmarks/calibration/scripts/scaling_answers.py      # ~1 minute on one core
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from gtp_wrap.scaling import Mesh, Plan, Precision, load_cluster, scale  # noqa: E402
from gtp_wrap.scaling.cli import describe, main  # noqa: E402
from gtp_wrap.scaling.model import GPT_1P36B, LLAMA70B, SEED280B, llama_like  # noqa: E402
from gtp_wrap.scaling.predict import predict  # noqa: E402
from gtp_wrap.scaling.validate import check, table  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "results" / "scaling"
SEED_GPUS = [128, 256, 512, 1024, 2048, 3072]
BANDWIDTHS = [3.125 * 2 ** (i / 2) for i in range(17)]  # 3 to 800 GB/s per GPU
GROUP_MI = [16, 64, 128]  # group_numel in Mi elements: GTPPolicy's default and two larger


def validation() -> None:
    for name in ("h200", "cpu_gloo"):
        (OUT / f"validation_{name}.md").write_text(table(check(load_cluster(name))) + "\n")


def seed() -> None:
    gb = load_cluster("gb200")
    lines = ["## The seed's configurations on GB200 (nominal), seed280b approximation", ""]
    headline = Plan(
        SEED280B, gb, Mesh(dp=2, gtp=16, ep=8, egtp=2), batch=1, graphed=True, recompute=True
    )
    lines += [
        "### Headline: 32 GB200 at GTP16 · EP8 · EGTP2",
        "",
        "```",
        describe(predict(headline)),
        "```",
        "",
    ]
    lines += [
        "### Weak scaling 128 -> 3072 GPUs at GTP64 · EP64 · EGTP2 (graphed, recompute)",
        "",
        "| expert layout | reductions | inter-node GB/s | batch/GPU | tok/s/GPU at 128 | at 3072 "
        "| efficiency 3072/128 | exposed comm at 128 / 3072 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    series = {}
    for layout in ("egtp_inner", "ep_inner"):
        for reduce in ("fp32", "bf16"):
            for bw in (45.0, 90.0):
                for batch in (1, 2, 4):
                    plan = Plan(
                        SEED280B,
                        gb.with_inter_gbs(bw),
                        Mesh(dp=2, gtp=64, ep=64, egtp=2, expert_layout=layout),
                        batch=batch,
                        graphed=True,
                        recompute=True,
                        precision=Precision(reduce=reduce),
                    )
                    rows = scale.weak(plan, SEED_GPUS)
                    a, b = rows[0].prediction, rows[-1].prediction
                    lines.append(
                        f"| {layout} | {reduce} | {bw:g} | {batch} | {a.tokens_per_s_per_gpu:,.0f} "
                        f"| {b.tokens_per_s_per_gpu:,.0f} | {rows[-1].efficiency:.1%} | "
                        f"{a.exposed_comm * 1e3:.0f} / {b.exposed_comm * 1e3:.0f} |"
                    )
                    if bw == 45.0 and batch in (1, 4):
                        series[f"{layout}, {reduce} grads, batch {batch}"] = rows
    (OUT / "seed_gb200.md").write_text("\n".join(lines) + "\n")
    scale.plot_scaling(
        series,
        OUT / "seed_weak_gb200.png",
        "seed280b approximation on GB200 (nominal, 400 Gb/s per GPU): weak scaling "
        "from 128 GPUs, GTP64·EP64·EGTP2",
    )
    main(
        [
            "scale",
            "--model",
            "seed280b",
            "--cluster",
            "gb200",
            "--mesh",
            "dp=2,gtp=64,ep=64,egtp=2",
            "--graphed",
            "--recompute",
            "--gpus",
            "8,16,32,64,128,256,512,1024,2048,3072,4096",
            "--out",
            str(OUT),
        ]
    )


def baselines() -> None:
    for cluster in ("h200", "gb200"):
        for batch in ("1", "4"):
            out = OUT / f"compare_b{batch}"
            main(
                [
                    "compare",
                    "--model",
                    "llama70b",
                    "--cluster",
                    cluster,
                    "--batch",
                    batch,
                    "--recompute",
                    "--out",
                    str(out),
                ]
            )
    main(
        [
            "scale",
            "--model",
            "llama70b",
            "--cluster",
            "h200",
            "--mesh",
            "gtp=16",
            "--graphed",
            "--recompute",
            "--out",
            str(OUT),
        ]
    )


def group_sizes() -> None:
    """The README's case where FSDP2 leads GTP (7B-class Llama shape, batch 1, one replica of
    64 GPUs across nodes), against GTP's group size: larger groups pay a 64-member ring's
    latency fewer times."""
    plan = Plan(llama_like(4096), load_cluster("h200"), Mesh(), batch=1, recompute=True)
    points = []
    for mi in GROUP_MI:
        preds = scale.three_ways(dataclasses.replace(plan, group_numel=mi << 20), 64)
        del preds["tp"]  # 64 does not divide d=4096's 32 heads: n/a in every row
        points.append(scale.Point(mi, preds))
    lines = [
        f"## GTP64 against FSDP2 by group size: {plan.cfg.name} on h200, batch 1 x "
        f"{plan.cfg.seq}, one replica of 64 GPUs; GTP graphed, FSDP2 eager, recompute",
        "",
        "FSDP2 gathers per block, so group_numel does not change its step.",
        "",
        scale.points_table(points, "group_numel (Mi elements)", "by group size"),
    ]
    (OUT / "group_size_d4096_gtp64_h200.md").write_text("\n".join(lines) + "\n")


def gathers() -> None:
    h = load_cluster("h200")
    cases = [
        (GPT_1P36B, 16, 1),
        (GPT_1P36B, 16, 8),
        (llama_like(4096), 16, 1),
        (llama_like(4096), 16, 4),
        (LLAMA70B, 64, 1),
        (LLAMA70B, 64, 8),
    ]
    lines = [
        "## Gather dtypes against inter-node bandwidth (H200 nodes of 8; GTP group spanning "
        "nodes; graphed, recompute)",
        "",
        "Where each dtype's step is shorter, in GB/s per GPU of inter-node bandwidth. "
        "Contention 1.62: NCCL's measured GEMM slowdown beside a gather "
        "(results/contention.json); 1.03: the copy engine's (same file).",
        "",
        "| contention | model | GTP group | batch | NVFP4 faster than bf16 | NVFP4 faster than "
        "FP8 | FP8 faster than bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    panels = []
    for contention in (h.contention_compute, 1.03):
        cl = dataclasses.replace(h, contention_compute=contention)
        for model, span, batch in cases:
            plan = Plan(model, cl, Mesh(gtp=span), batch=batch, graphed=True, recompute=True)
            pts = scale.compare_bandwidth(plan, BANDWIDTHS, scale.gather_dtype_variants(plan))
            lines.append(
                f"| {contention:.2f} | {model.name} | {span} | {batch} | "
                f"{scale.where_faster(pts, 'nvfp4', 'bf16')} | "
                f"{scale.where_faster(pts, 'nvfp4', 'fp8')} | "
                f"{scale.where_faster(pts, 'fp8', 'bf16')} |"
            )
            if model is LLAMA70B:
                panels.append(
                    (
                        f"llama70b GTP64 batch {batch}, contention {contention:.2f}",
                        "inter-node GB/s per GPU",
                        pts,
                        True,
                    )
                )
    (OUT / "gathers_nvfp4.md").write_text("\n".join(lines) + "\n")
    scale.plot_points(
        panels,
        OUT / "gathers_nvfp4.png",
        "bf16 / FP8 / NVFP4 gathers against inter-node bandwidth (H200 nodes)",
    )


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    validation()
    seed()
    baselines()
    group_sizes()
    gathers()
    print(f"wrote {OUT}")
