"""`gtp-plan`: the cost model on the command line.

gtp-plan --model llama70b --cluster h200 --mesh dp=8,gtp=8 --batch 1 --seq 4096
gtp-plan scale --model seed280b --cluster gb200 --out dir/
gtp-plan compare --model llama70b --cluster h200 --out dir/
gtp-plan validate --cluster h200
gtp-plan list
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from . import scale
from .baselines import METHODS, predict_method
from .cluster import Cluster, ClusterError, available, load_cluster
from .mesh import Mesh, MeshError
from .model import MODELS, ModelConfig, ModelError, llama_like, load_model, train_configs
from .precision import GATHER_BYTES, REDUCE_BYTES, Precision, PrecisionError
from .predict import Plan, PlanError, Prediction
from .validate import check, table

# A mesh to start from where none is given: the seed's for its model, else GTP over a node.
SUGGESTED_MESH = {"seed280b": "dp=2,gtp=64,ep=64,egtp=2", "llama70b": "dp=4,gtp=16"}
COMMANDS = ("plan", "scale", "compare", "validate", "list")


def _plan_args(ap: argparse.ArgumentParser, mesh_required: bool) -> None:
    ap.add_argument(
        "--model",
        required=True,
        help=f"a built-in model ({', '.join(MODELS)}), a gtp-train model config "
        "(gpt_small, moe_1b, ...) or a YAML or JSON path of its keys",
    )
    ap.add_argument(
        "--cluster", required=True, help=f"a calibration ({', '.join(available())}) or a JSON path"
    )
    ap.add_argument(
        "--mesh",
        required=mesh_required,
        default=None,
        help="AXIS=N,... of dp, gtp, tp, ep, egtp (e.g. dp=8,gtp=8)",
    )
    ap.add_argument("--expert-layout", default="egtp_inner", choices=("egtp_inner", "ep_inner"))
    ap.add_argument("--batch", type=float, default=1.0, help="sequences per data rank")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: model's)")
    ap.add_argument("--gather", default="bf16", choices=sorted(GATHER_BYTES))
    ap.add_argument("--reduce", default="fp32", choices=sorted(REDUCE_BYTES))
    ap.add_argument("--graphed", action="store_true", help="the step captured in a CUDA graph")
    ap.add_argument("--depth", type=int, default=1, help="prefetch_depth")
    ap.add_argument("--group-numel", type=int, default=1 << 24, help="group_numel")
    ap.add_argument("--recompute", action="store_true", help="activation checkpointing per block")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gtp-plan",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    sub = ap.add_subparsers(dest="command")
    p = sub.add_parser("plan", help="one step: time split, memory, throughput")
    _plan_args(p, mesh_required=False)
    p.add_argument("--method", default="gtp", choices=(*METHODS, "all"))
    s = sub.add_parser("scale", help="weak and strong scaling tables and plots")
    _plan_args(s, mesh_required=False)
    s.add_argument("--gpus", default=",".join(map(str, scale.GPU_COUNTS)))
    s.add_argument(
        "--global-batch",
        type=float,
        default=0,
        help="strong scaling's sequences per step (default: the batch x 1024)",
    )
    s.add_argument(
        "--method",
        default="gtp",
        choices=("gtp", "gtp_blocks", "fsdp2"),
        help="gtp_blocks: blocks on gathered weights, as gtp-train runs them",
    )
    s.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare", help="GTP against FSDP2 and TP; gather dtypes against bandwidth")
    _plan_args(c, mesh_required=False)
    c.add_argument("--sizes", default="2,4,8,16,32,64", help="GPUs per model replica")
    c.add_argument("--span", type=int, default=64, help="GPUs per replica in the bandwidth sweep")
    c.add_argument("--out", type=Path, required=True)
    v = sub.add_parser("validate", help="stored measured runs against the model")
    v.add_argument("--cluster", required=True)
    sub.add_parser("list", help="models and clusters")
    return ap


def make_plan(
    args: argparse.Namespace, model: ModelConfig | None = None, cluster: Cluster | None = None
) -> Plan:
    model = model or load_model(args.model)
    mesh_text = args.mesh or SUGGESTED_MESH.get(model.name, "gtp=8")
    return Plan(
        model=model,
        cluster=cluster or load_cluster(args.cluster),
        mesh=Mesh.parse(mesh_text, args.expert_layout),
        batch=args.batch,
        seq=args.seq,
        precision=Precision(gather=args.gather, reduce=args.reduce),
        graphed=args.graphed,
        prefetch_depth=args.depth,
        group_numel=args.group_numel,
        recompute=args.recompute,
    )


def _count(n: int) -> str:
    """A parameter count as people write it: 70.6B, 125.0M."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe(pred: Prediction) -> str:
    plan = pred.plan
    cl = plan.cluster
    head = (
        f"{pred.method} step of {plan.cfg.name} ({_count(plan.cfg.n_params)} parameters, "
        f"{_count(plan.cfg.active_params)} active) on {cl.name}"
        f"{' (nominal figures)' if cl.nominal else ''}, mesh {plan.mesh.label() or 'world 1'} "
        f"({plan.mesh.world} {'GPUs' if cl.async_host else 'CPU ranks'}), "
        f"batch {plan.batch:g} x {plan.cfg.seq}, gathers "
        f"{plan.precision.gather}, reductions {plan.precision.reduce}"
        f"{', graphed' if plan.graphed and pred.method != 'fsdp2' else ', eager'}"
        f"{', recompute' if plan.recompute else ''}"
    )
    width = max(len(k) for k, _ in pred.rows())
    lines = [head] + [f"  {k:<{width}}  {v}" for k, v in pred.rows()]
    if not pred.fits and pred.method != "floor":  # the floor's memory is not modelled
        fewer = "" if plan.recompute else ", keep fewer activations (--recompute)"
        where = "GPU" if cl.async_host else "CPU rank"
        lines.append(
            f"  does not fit: the peak exceeds a {where}'s {cl.memory_gib:.0f} GiB; shard the "
            f"weights over more GPUs (gtp, ep/egtp), split activations and logits with tp"
            f"{fewer}, or take a smaller batch or shorter sequences"
        )
    if plan.cfg.note:
        lines.append(f"  model: {plan.cfg.note}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    m = plan.mesh
    for method in METHODS if args.method == "all" else (args.method,):
        variant = plan
        if method == "tp":
            if plan.cfg.experts:
                print("tp: not modelled for a mixture of experts (no expert parallelism there)")
                continue
            tp_plan = _tp_variant(plan, args.method == "all")
            if tp_plan is None:
                continue
            variant = tp_plan
            if m.gtp > 1:
                print(
                    f"tp: the GTP group's {m.gtp * m.tp} GPUs as one TP group (mesh "
                    f"{variant.mesh.label()}), the sequences of its {m.gtp} ranks together "
                    f"(batch {variant.batch:g}): the same tokens per GPU"
                )
        print(describe(predict_method(variant, method)))


def _tp_variant(plan: Plan, all_methods: bool) -> Plan | None:
    """The plan as TP runs it: the GTP group's GPUs as one TP group, its ranks' sequences
    together (the same tokens per GPU); None, with a line saying why, where `--method all`
    meets a TP group that the heads do not divide (asked for alone, that is an error)."""
    m = plan.mesh
    try:
        mesh = Mesh(dp=m.dp, tp=m.gtp * m.tp)
        return dataclasses.replace(plan, mesh=mesh, batch=plan.batch * m.gtp)
    except PlanError as e:
        if not all_methods:
            raise
        print(f"tp: left out ({e}: the GTP group's {m.gtp * m.tp} GPUs as one TP group)")
        return None


def _ints(flag: str, text: str) -> list[int]:
    """The comma-separated whole numbers of `flag`'s value."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"gtp-plan: {flag} {text!r}: give comma-separated integers") from None
    if not values or min(values) < 1:
        raise SystemExit(f"gtp-plan: {flag} {text!r}: give whole numbers >= 1")
    return values


def cmd_scale(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    # The fewest GPUs are the base of both efficiencies.
    gpus = sorted(set(_ints("--gpus", args.gpus)))
    name = f"{plan.cfg.name}_{plan.cluster.name}"
    global_batch = args.global_batch or plan.batch * 1024
    if not 0 < global_batch < float("inf"):
        raise PlanError(f"--global-batch {args.global_batch}: give sequences per step above 0")
    label = f"{args.method} {plan.precision.gather}"
    weak = {label: scale.weak(plan, gpus, args.method)}
    strong = {label: scale.strong(plan, global_batch, gpus, args.method)}
    if not weak[label]:
        fewest = scale.fewest_gpus(plan.mesh)
        raise PlanError(
            f"--gpus {args.gpus}: no count holds mesh {plan.mesh.label()}'s model-parallel axes "
            f"whole (multiples of {fewest} GPUs); pass GPU counts from {fewest} up"
        )
    if not strong[label]:
        raise PlanError(
            f"--global-batch {global_batch:g}: fewer sequences than the data ranks of every GPU "
            f"count in --gpus (each takes at least one); give a larger global batch"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    text = [
        f"## Scaling of {plan.cfg.name} on {plan.cluster.name}"
        f"{' (nominal)' if plan.cluster.nominal else ''}, base mesh {plan.mesh.label()}, "
        f"{'graphed' if plan.graphed and args.method != 'fsdp2' else 'eager'}",
        "",
        plan.cfg.note,
        "",
    ]
    for label, rows in weak.items():
        text += [
            scale.table(rows, f"weak scaling, {label}, batch {plan.batch:g} per data rank"),
            "",
        ]
    for label, rows in strong.items():
        text += [
            scale.table(rows, f"strong scaling, {label}, {global_batch:g} sequences per step"),
            "",
        ]
    (args.out / f"scaling_{name}.md").write_text("\n".join(text))
    scale.plot_scaling(
        weak,
        args.out / f"weak_{name}.png",
        f"weak scaling: {plan.cfg.name} on {plan.cluster.name}, batch {plan.batch:g} per data rank",
    )
    scale.plot_scaling(
        strong,
        args.out / f"strong_{name}.png",
        f"strong scaling: {plan.cfg.name} on {plan.cluster.name}, {global_batch:g} sequences",
    )
    print("\n".join(text))
    print(f"wrote {args.out}/scaling_{name}.md, weak_{name}.png, strong_{name}.png")


def cmd_compare(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{plan.cfg.name}_{plan.cluster.name}"
    sizes = scale.compare_group_sizes(plan, _ints("--sizes", args.sizes))
    spanning = dataclasses.replace(plan, mesh=Mesh(gtp=args.span), graphed=True)
    bandwidths = [3.125 * 2 ** (i / 2) for i in range(15)]  # 3 to 400 GB/s per GPU
    methods = {
        "floor": spanning,
        "gtp": spanning,
        "fsdp2": dataclasses.replace(spanning, graphed=False),
    }
    by_link = [
        scale.Point(
            bw,
            {
                k: predict_method(dataclasses.replace(p, cluster=p.cluster.with_inter_gbs(bw)), k)
                for k, p in methods.items()
            },
        )
        for bw in bandwidths
    ]
    family = [2048, 4096, 5120, 8192, 12288, 16384]
    by_size = scale.compare_models(plan, [llama_like(d, plan.cfg.seq) for d in family], args.span)
    variants = {
        dtype: variant
        for dtype, variant in scale.gather_dtype_variants(spanning).items()
        if _predictable(variant)  # a calibration without a dtype's decode leaves it out
    }
    gathers = scale.compare_bandwidth(spanning, bandwidths, variants)
    text = [
        f"## GTP against FSDP2 and TP: {plan.cfg.name} on {plan.cluster.name}"
        f"{' (nominal)' if plan.cluster.nominal else ''}, batch {plan.batch:g} x {plan.cfg.seq} "
        "per data rank (TP: that many tokens per GPU); GTP graphed, FSDP2 eager",
        "",
        scale.points_table(sizes, "GPUs per replica", "by group size"),
        "",
        scale.points_table(
            by_link, "inter-node GB/s per GPU", f"by link speed, {args.span} GPUs per replica"
        ),
        "",
        scale.points_table(
            by_size, "d (Llama-shaped)", f"by model size, {args.span} GPUs per replica"
        ),
        "",
        scale.points_table(gathers, "inter-node GB/s per GPU", f"gather dtypes, GTP{args.span}"),
    ]
    text.append("")
    for better, than in (("nvfp4", "bf16"), ("nvfp4", "fp8"), ("fp8", "bf16")):
        if better not in variants or than not in variants:
            text.append(f"- {better} against {than}: not calibrated on {plan.cluster.name}")
            continue
        where = scale.where_faster(gathers, better, than)
        text.append(f"- {better} gathers are faster than {than}: {where} GB/s per GPU")
    (args.out / f"compare_{name}.md").write_text("\n".join(text) + "\n")
    scale.plot_points(
        [
            ("by GPUs per replica", "GPUs per replica", sizes, True),
            (f"by inter-node GB/s ({args.span} GPUs)", "GB/s per GPU", by_link, True),
            (f"by model size ({args.span} GPUs)", "d", by_size, False),
            (f"gather dtypes (GTP{args.span})", "GB/s per GPU", gathers, True),
        ],
        args.out / f"compare_{name}.png",
        f"{plan.cfg.name} on {plan.cluster.name}: GTP (graphed) vs FSDP2 (eager) vs TP",
    )
    print("\n".join(text))
    print(f"wrote {args.out}/compare_{name}.md and .png")


def _predictable(plan: Plan) -> bool:
    """Whether the cluster's calibration covers the plan's precision (decoding FP8, NVFP4)."""
    try:
        predict_method(plan, "gtp")
    except ClusterError:
        return False
    return True


def cmd_validate(args: argparse.Namespace) -> None:
    cluster = load_cluster(args.cluster)
    if not cluster.runs:
        raise SystemExit(
            f"gtp-plan: {cluster.name} stores no measured runs (nominal: "
            f"{cluster.nominal}); run benchmarks/calibrate.py on that machine"
        )
    print(table(check(cluster)))


def cmd_list(_: argparse.Namespace) -> None:
    shipped = [load_model(name) for name in train_configs() if name not in MODELS]
    for m in [*MODELS.values(), *shipped]:
        print(f"{m.name:10} {_count(m.n_params):>7}  {m.note}")
    print("clusters:", ", ".join(available()))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "plan")  # `gtp-plan --model ...` is a plan
    args = parser().parse_args(argv)
    commands = {
        "plan": cmd_plan,
        "scale": cmd_scale,
        "compare": cmd_compare,
        "validate": cmd_validate,
        "list": cmd_list,
    }
    if args.command is None:
        parser().print_help()
        return
    try:
        commands[args.command](args)
    except (ClusterError, MeshError, ModelError, PlanError, PrecisionError) as e:
        raise SystemExit(f"gtp-plan: {e}") from None
    except OSError as e:  # --out where no directory can be made or written
        raise SystemExit(f"gtp-plan: cannot write {e.filename}: {e.strerror}") from None


if __name__ == "__main__":
    main()
