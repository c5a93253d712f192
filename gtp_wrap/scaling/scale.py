"""Sweeps of the cost model and their tables and plots: weak and strong scaling over GPU
counts, GTP against FSDP2 and TP, and gather dtypes against inter-node bandwidth.

A sweep keeps a base mesh's model-parallel axes (gtp, tp, ep, egtp) and fills the rest of the
GPUs with data-parallel replicas; where there are fewer GPUs than the base mesh needs, its GTP
and EP groups shrink to fit. Rows whose peak memory exceeds the GPU's are kept and marked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .baselines import predict_method
from .mesh import Mesh
from .model import ModelConfig
from .predict import Plan, Prediction

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096)


@dataclasses.dataclass(frozen=True)
class Row:
    """One point of a sweep."""

    gpus: int
    mesh: Mesh
    batch: float
    prediction: Prediction
    efficiency: float  # against the sweep's first row, the fewest GPUs the base mesh takes


def fewest_gpus(base: Mesh) -> int:
    """The fewest GPUs that hold `base`'s model-parallel axes whole (its dense and its expert
    ones); a sweep's GPU counts are its multiples."""
    return math.lcm(base.gtp * base.tp, base.ep * base.egtp)


def mesh_for(base: Mesh, gpus: int) -> Mesh | None:
    """`base`'s model-parallel axes on `gpus` GPUs, the rest data parallel; None where they do
    not divide the GPUs. A sweep keeps those axes whole: on fewer GPUs each would shrink, and
    each GPU would hold and compute a different share of the model (an 8-GPU row of a
    GTP64 mesh read 149 % "weak-scaling efficiency" from 8 to 16 GPUs that way)."""
    if gpus % fewest_gpus(base):
        return None
    return dataclasses.replace(base, dp=gpus // (base.gtp * base.tp))


def weak(plan: Plan, gpus: Sequence[int] = GPU_COUNTS, method: str = "gtp") -> list[Row]:
    """Per-GPU batch fixed: efficiency is tokens/s/GPU against the first GPU count."""
    rows: list[Row] = []
    for n in gpus:
        mesh = mesh_for(plan.mesh, n)
        if mesh is None:  # the axes do not divide n (ep is the base's: the plan checked it)
            continue
        p = predict_method(dataclasses.replace(plan, mesh=mesh), method)
        base = rows[0].prediction.tokens_per_s_per_gpu if rows else p.tokens_per_s_per_gpu
        rows.append(Row(n, mesh, plan.batch, p, p.tokens_per_s_per_gpu / base))
    return rows


def strong(
    plan: Plan, global_batch: float, gpus: Sequence[int] = GPU_COUNTS, method: str = "gtp"
) -> list[Row]:
    """Global batch (sequences) fixed: each data rank takes its share (at least one sequence);
    efficiency is the speed-up over the first row's per GPU."""
    rows: list[Row] = []
    for n in gpus:
        mesh = mesh_for(plan.mesh, n)
        if mesh is None:  # the axes do not divide n (ep is the base's: the plan checked it)
            continue
        batch = global_batch / mesh.data_ranks
        if batch < 1:
            continue
        p = predict_method(dataclasses.replace(plan, mesh=mesh, batch=batch), method)
        if rows:
            first = rows[0]
            eff = first.prediction.step * first.gpus / (p.step * n)
        else:
            eff = 1.0
        rows.append(Row(n, mesh, batch, p, eff))
    return rows


def table(rows: Sequence[Row], title: str) -> str:
    """Markdown: GPUs, mesh, batch, step split, tokens/s/GPU, efficiency, memory."""
    lines = [
        f"### {title}",
        "",
        "| GPUs | mesh | batch/rank | step ms | compute | exposed comm | host | tok/s/GPU "
        "| efficiency | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.prediction
        over = "" if p.fits else " (over)"
        lines.append(
            f"| {r.gpus} | {r.mesh.label() or 'world 1'} | {r.batch:g} | {p.step * 1e3:.1f} | "
            f"{p.compute * 1e3:.1f} | {p.exposed_comm * 1e3:.1f} | {p.host * 1e3:.1f} | "
            f"{p.tokens_per_s_per_gpu:,.0f} | {r.efficiency:.1%} | "
            f"{p.memory.peak / 2**30:.1f}{over} |"
        )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(series: Mapping[str, Sequence[Row]], path: Path, title: str) -> None:
    """Tokens/s/GPU and efficiency against GPUs, one line per series."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in series.items():
        xs = [r.gpus for r in rows]
        ax1.plot(xs, [r.prediction.tokens_per_s_per_gpu for r in rows], marker="o", label=label)
        ax2.plot(xs, [100 * r.efficiency for r in rows], marker="o", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("tokens/s per GPU")
    ax2.set_ylabel("efficiency (%)")
    ax1.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class Point:
    """One x of a comparison: each method's prediction (None: the method does not apply)."""

    x: float
    predictions: dict[str, Prediction | None]


def three_ways(plan: Plan, n: int, graphed_gtp: bool = True) -> dict[str, Prediction | None]:
    """GTP over `n` GPUs (graphed if `graphed_gtp`), FSDP2 over them (eager) and TP over them
    (None where `n` does not divide the heads, or for a mixture of experts, which the TP
    baseline does not model), the plan's dp replicas kept. TP's group shares
    one batch: it gets `n` times the plan's sequences, for the same tokens per GPU."""
    dp = plan.mesh.dp
    gtp_plan = dataclasses.replace(plan, mesh=Mesh(dp=dp, gtp=n), graphed=graphed_gtp)
    out: dict[str, Prediction | None] = {
        "floor": predict_method(gtp_plan, "floor"),
        "gtp": predict_method(gtp_plan, "gtp"),
        "fsdp2": predict_method(dataclasses.replace(gtp_plan, graphed=False), "fsdp2"),
        "tp": None,
    }
    if not plan.model.experts and plan.model.heads % n == 0:  # TP: dense models only
        tp_plan = dataclasses.replace(
            plan, mesh=Mesh(dp=dp, tp=n), batch=plan.batch * n, graphed=graphed_gtp
        )
        out["tp"] = predict_method(tp_plan, "tp")
    return out


def compare_group_sizes(plan: Plan, sizes: Sequence[int]) -> list[Point]:
    """`three_ways` for each number of GPUs per model replica."""
    return [Point(n, three_ways(plan, n)) for n in sizes]


def compare_models(plan: Plan, models: Sequence[ModelConfig], n: int) -> list[Point]:
    """`three_ways` over `n` GPUs for each model (x: its width d), on the plan's dp replicas
    (its expert axes are the plan's model's, not theirs)."""
    dense = Mesh(dp=plan.mesh.dp)
    return [
        Point(m.d, three_ways(dataclasses.replace(plan, model=m, mesh=dense), n)) for m in models
    ]


def compare_bandwidth(
    plan: Plan, gbs: Sequence[float], variants: dict[str, Plan], method: str = "gtp"
) -> list[Point]:
    """Each variant plan at each inter-node bandwidth (GB/s per GPU), with the floor."""
    points = []
    floor = predict_method(plan, "floor")
    for bw in gbs:
        preds: dict[str, Prediction | None] = {"floor": floor}
        for name, variant in variants.items():
            cl = variant.cluster.with_inter_gbs(bw)
            preds[name] = predict_method(dataclasses.replace(variant, cluster=cl), method)
        points.append(Point(bw, preds))
    return points


def gather_dtype_variants(plan: Plan) -> dict[str, Plan]:
    return {
        dtype: dataclasses.replace(
            plan, precision=dataclasses.replace(plan.precision, gather=dtype)
        )
        for dtype in ("bf16", "fp8", "nvfp4")
    }


def where_faster(points: Sequence[Point], better: str, than: str) -> str:
    """In words, the xs (points sorted by x) at which `better`'s step is shorter than `than`'s."""
    pairs = [(pt.x, pt.predictions.get(better), pt.predictions.get(than)) for pt in points]
    wins = [x for x, a, b in pairs if a is not None and b is not None and a.step < b.step]
    xs = [x for x, a, b in pairs if a is not None and b is not None]
    if not wins:
        return f"never (swept {xs[0]:g} to {xs[-1]:g})"
    if wins == xs:
        return f"at every point swept ({xs[0]:g} to {xs[-1]:g})"
    if wins == xs[: len(wins)]:
        return f"up to {wins[-1]:g} (not from {xs[len(wins)]:g})"
    if wins == xs[-len(wins) :]:
        return f"from {wins[0]:g} on"
    return "at " + ", ".join(f"{x:g}" for x in wins)


def _of_floor(pt: Point, name: str) -> float | None:
    """A method's throughput as a fraction of the no-communication floor's."""
    p, floor = pt.predictions[name], pt.predictions.get("floor")
    if p is None or floor is None:
        return None
    return p.tokens_per_s_per_gpu / floor.tokens_per_s_per_gpu


def points_table(points: Sequence[Point], x_label: str, title: str) -> str:
    """Markdown: per x, each method's tokens/s/GPU, its share of the floor's, step and
    exposed communication."""
    names = [n for n in points[0].predictions if n != "floor"]
    lines = [
        f"### {title}",
        "",
        f"| {x_label} | "
        + " | ".join(f"{n}: tok/s/GPU (of floor; step ms; exposed comm ms)" for n in names)
        + " |",
        "|---|" + "---|" * len(names),
    ]
    for pt in points:
        cells = []
        for n in names:
            p, share = pt.predictions[n], _of_floor(pt, n)
            cells.append(
                "n/a"
                if p is None or share is None
                else f"{p.tokens_per_s_per_gpu:,.0f} ({share:.0%}; {p.step * 1e3:.0f}; "
                f"{p.exposed_comm * 1e3:.0f})"
            )
        lines.append(f"| {pt.x:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_points(
    panels: list[tuple[str, str, Sequence[Point], bool]], path: Path, title: str
) -> None:
    """One panel per (title, x label, points, log x): each method's throughput as a share of
    the no-communication floor's."""
    plt = _pyplot()
    cols = min(len(panels), 4)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax, (sub, x_label, points, logx) in zip(axes.flat, panels):
        for name in points[0].predictions:
            if name == "floor":
                continue
            xy = [(p.x, _of_floor(p, name)) for p in points]
            xy = [(x, 100 * y) for x, y in xy if y is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.set_ylabel("% of the floor's tokens/s")
        ax.set_title(sub, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
