"""Step time, throughput and memory of GTP against DDP, FSDP2 and the compute floor, side by side.

    torchrun --nproc_per_node 2 benchmarks/bench_step.py --out benchmarks/results
    python benchmarks/bench_step.py --smoke          # CPU, 2 gloo ranks, seconds, no timing claims

Every method trains the same Llama-style model (gtp_wrap.app.model) on the same batch, sequence
length and seed, with AdamW (foreach, or fused with --fused-adamw):
- floor: bf16 model on one GPU, forward + backward with no communication, plus an AdamW step on
  1/N of the parameters (fp32): what perfect overlap would give;
- floor_graph: the floor's step captured in a CUDA graph (torch.cuda.graph) and replayed: the
  floor without host overhead, the reference for gtp_graph (at batch 1 the eager floor's step
  time moves with the host's speed);
- floor_per_param: the floor with its AdamW over one fp32 tensor per parameter (each 1/N of it)
  instead of one flat shard: the optimizer's host time per tensor, which GTP's parameters and
  every unflattened model pay, apart from the engine's (GTP leaves parameters under its
  min_shard_numel whole, so at a world above one its tensors are not all 1/N);
- ddp: fp32 parameters, bf16 autocast, DistributedDataParallel;
- amp, amp_compile: the model as plain PyTorch trains it in mixed precision on one GPU, no GTP,
  no DDP: fp32 parameters, bf16 autocast, AdamW over its parameters (amp_compile: every block
  compiled). Unlike the floor, it keeps fp32 masters and steps one tensor per parameter, as GTP
  does: GTP's cost over it is the engine's alone;
- fsdp2: fully_shard on every block and the root, bf16 param_dtype, fp32 reduce_dtype;
- gtp: GTPWrap with the default policy, bf16 gathers (param_dtype), fp32 reductions;
- gtp_fp8: the same with FP8 gathers (gather_dtype: fp8);
- gtp_fp8_gemm: FP8 gathers feeding FP8 GEMMs for every Linear's forward (fp8_matmul: true);
- floor_compile, fsdp2_compile, gtp_compile: floor, fsdp2 and gtp with every block compiled
  by torch.compile (as torchtitan compiles with FSDP2; gtp_wrap.compile for GTP), the rest eager;
- gtp_blocks: gtp with each block run eagerly on weights gathered once per block call
  (gtp_wrap.gather_per_block) instead of each use intercepted;
- gtp_graph: gtp with the whole step (forward, backward, AdamW(capturable=True)) captured in a
  CUDA graph by gtp_wrap.graph_step after the warm-up steps.
With `--dp D` the gtp methods run on a ("dp", "gtp") mesh of D replicas (each weight sharded
over world/D ranks, gradients all-reduced over dp) and fsdp2 as HSDP over the same split; the
floors step 1/(world/D) of the parameters.
Each reports the median step time over the timed steps after warm-up, tokens/s per GPU, MFU,
peak memory, and how fast the host launched work at the time (`host_probe_ms`, see
host_probe.py: `gtp-plan validate` scales a run's host time by it). The table adds GTP/floor,
GTP/gfloor (the graphed floor) and GTP/FSDP2.
Results go to JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from host_probe import HostProbe
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import gtp_wrap
from gtp_wrap.app.launch import launch, under_torchrun
from gtp_wrap.app.model import GPT, GPTConfig

MODELS = {
    "1.36B": GPTConfig(vocab=32000, d=2048, layers=24, heads=16, ffn=5632, max_seq=2048,
                       tie_embeddings=False),
    "125M": GPTConfig(vocab=32000, d=768, layers=12, heads=12, ffn=2048, max_seq=2048),
    "smoke": GPTConfig(vocab=256, d=64, layers=2, heads=4, ffn=172, max_seq=64),
    # ~1.2B parameters in all, ~0.2B per token (configs/model/moe_1b.yaml).
    "moe_1b": GPTConfig(vocab=32000, d=1024, layers=16, heads=16, ffn=2816, max_seq=2048,
                        tie_embeddings=False, experts=16, top_k=2, moe_ffn=1408),
    "moe_smoke": GPTConfig(vocab=256, d=64, layers=2, heads=4, ffn=172, max_seq=64, experts=4,
                           top_k=2, moe_ffn=32),
}  # fmt: skip
# GTP's rules for a mixture of experts (configs/policy/moe.yaml): each expert stack's rows.
MOE_RULES = [{"match": "*.experts.*", "dim": 1}, {"match": "Linear"}, {"match": "Embedding"}]
PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16 (datasheet)
METHODS = ("floor", "floor_per_param", "ddp", "fsdp2", "gtp", "gtp_fp8", "gtp_fp8_gemm",
           "gtp_graph", "floor_graph", "floor_compile", "fsdp2_compile", "gtp_compile",
           "gtp_blocks", "amp", "amp_compile")  # fmt: skip


def _model(cfg: GPTConfig, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg).to(dtype)


def _compile_blocks(model: GPT) -> None:
    """Each block compiled on its own, the rest eager (as torchtitan compiles)."""
    for block in model.blocks:
        block.compile()


def _adamw(params: Any, fused: bool, capturable: bool = False) -> torch.optim.AdamW:
    """Every method's optimizer: foreach kernels (torch's default) or one fused kernel."""
    return torch.optim.AdamW(params, lr=1e-4, fused=fused or None, capturable=capturable)


_meshes: dict[tuple[Any, str, int], DeviceMesh] = {}


def _mesh(device: torch.device, dp: int) -> DeviceMesh:
    """`gtp_wrap.make_mesh`'s mesh of `dp` replicas over the world, ("dp", "gtp") (1-D without
    replicas), made once per process group: each method's build would otherwise add process
    groups."""
    key = (dist.group.WORLD, device.type, dp)
    if key not in _meshes:
        _meshes[key] = gtp_wrap.make_mesh(dp=dp, device_type=device.type)[0]
    return _meshes[key]


def _build(method: str, cfg: GPTConfig, device: torch.device, world: int, overrides: dict,
           fused_adamw: bool = False, lib: types.ModuleType = gtp_wrap,
           dp: int = 1):  # fmt: skip
    """(model, optimizer, autocast dtype or None); the floor's optimizer steps a 1/N shard (N:
    the ranks a weight is sharded over, `world // dp`). `lib`: the gtp_wrap package the gtp
    methods wrap with (step_phases.py's --baseline loads another commit's under another name).
    `dp` > 1: GTP on a ("dp", "gtp") mesh and FSDP2 as HSDP (replicated over dp, sharded
    within each group of `world // dp` ranks)."""
    if method.startswith("floor"):
        model = _model(cfg, device, torch.bfloat16)
        if method == "floor_compile":
            _compile_blocks(model)
        sizes = (
            [p.numel() for p in model.parameters()]
            if method == "floor_per_param"
            else [cfg.n_params]
        )
        tensors = [
            torch.zeros(math.ceil(n * dp / world), device=device, requires_grad=True) for n in sizes
        ]
        for t in tensors:
            t.grad = torch.zeros_like(t)
        return model, _adamw(tensors, fused_adamw, method == "floor_graph"), None
    model = _model(cfg, device, torch.float32)
    if method.startswith("amp"):
        if method == "amp_compile":
            _compile_blocks(model)
        return model, _adamw(model.parameters(), fused_adamw), torch.bfloat16
    if method == "ddp":
        model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
        return model, _adamw(model.parameters(), fused_adamw), torch.bfloat16
    if method.startswith("fsdp2"):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # On `device`'s type: FSDP2's default mesh is on a GPU wherever one is present. A 2-D
        # mesh makes it HSDP: replicated over the first dim, sharded over the second.
        mesh = _mesh(device, dp)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
            if method == "fsdp2_compile":  # FSDP2's hooks run eagerly around the compiled code
                block.compile()
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, _adamw(model.parameters(), fused_adamw), None
    policy = {"param_dtype": "bfloat16", "reduce_dtype": "float32", **overrides}
    if cfg.experts:
        policy.setdefault("rules", MOE_RULES)
    if method.startswith("gtp_fp8"):
        policy["gather_dtype"] = "fp8"
        policy["fp8_matmul"] = method == "gtp_fp8_gemm"
    if cfg.d < 512:
        policy["min_shard_numel"] = 0
    lib.GTPWrap(model, policy, mesh=_mesh(device, dp) if dp > 1 else None)
    if method == "gtp_compile":
        lib.compile(model)
    if method == "gtp_blocks":
        lib.gather_per_block(model)
    return model, _adamw(model.parameters(), fused_adamw, method == "gtp_graph"), None


def train_step(model: nn.Module, optim: torch.optim.Optimizer, autocast: torch.dtype | None):
    """The step every method and script times: forward (under `autocast` if given), fp32 loss,
    backward, optimizer step. No logits outlive the backward."""

    gpt = model.module if isinstance(model, DistributedDataParallel) else model
    moe = isinstance(gpt, GPT) and bool(gpt.cfg.experts)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(x.device.type, autocast, enabled=autocast is not None):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            if moe:  # the MoE blocks' load-balancing loss
                loss = loss + gpt.aux_loss()
        loss.backward()
        optim.step()

    return step


def clear_grads(method: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Between steps; the floor's optimizer shard keeps its (zero) gradient so it is stepped."""
    (model if method.startswith("floor") else optim).zero_grad(set_to_none=True)


def batch_of(cfg: GPTConfig, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """This rank's token batch, `seq + 1` long (inputs and shifted targets), seeded by rank
    (rank 0's without a process group: calibrate.py's steps in its own process)."""
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(device)


def method_step(method: str, model: nn.Module, optim: torch.optim.Optimizer,
                autocast: torch.dtype | None, idx: torch.Tensor,
                graph_warmup: int) -> Callable[[], None]:  # fmt: skip
    """One whole step of `method` on `idx`, gradients cleared after it; gtp_graph's is captured
    by `graph_step` in the last of `graph_warmup` warm-up steps and replayed from then on,
    floor_graph's here, after as many warm-up steps."""
    train = train_step(model, optim, autocast)
    if method == "gtp_graph":  # captured in the last warm-up step: every timed step replays
        if graph_warmup < 3:
            raise ValueError("gtp_graph needs --warmup >= 3 (two eager steps, then the capture)")
        train = gtp_wrap.graph_step(model, train, warmup=graph_warmup - 1)
    if method == "floor_graph":
        train = _captured(train, idx, graph_warmup, lambda: clear_grads(method, model, optim))

    def step() -> None:
        train(idx[:, :-1], idx[:, 1:])
        clear_grads(method, model, optim)

    return step


def _captured(train: Callable, idx: torch.Tensor, warmup: int, clear: Callable) -> Callable:
    """`train` on `idx` captured in a CUDA graph as torch.cuda.graph's documentation does it:
    warm-up steps on a side stream, then one capture; the returned step replays it."""
    if warmup < 1:  # the optimizer makes its state in its first step, which must not be captured
        raise ValueError("floor_graph needs --warmup >= 1")
    x, y = idx[:, :-1], idx[:, 1:]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            train(x, y)
            clear()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train(x, y)
    return lambda *_: graph.replay()


def common_args(ap: argparse.ArgumentParser, out: Path, policy_example: str) -> None:
    """The options the benchmark scripts share (`--gtp-policy` parses to FIELD=VALUE pairs)."""
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fused-adamw", action="store_true",
                    help="every method's AdamW with fused=True (one kernel per step)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--gtp-policy", nargs="*", type=_field, default=[], metavar="FIELD=VALUE",
                    help=f"GTPPolicy overrides of the gtp methods: {policy_example}")  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(method: str, cfg: GPTConfig, batch: int, seq: int, warmup: int, steps: int,
            device: torch.device, overrides: dict, fused_adamw: bool = False,
            probe: HostProbe | None = None, dp: int = 1) -> dict:  # fmt: skip
    """One method's median step; with `probe`, the host's speed beside it (`host_probe_ms`:
    the probe's mean just before and just after the timed steps, see host_probe.py). `dp`:
    as `_build`'s."""
    world = dist.get_world_size()
    gc.collect()  # engines and FSDP states hold reference cycles: free the previous method
    baseline = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)  # whatever earlier methods left behind
    model, optim, autocast = _build(method, cfg, device, world, overrides, fused_adamw, dp=dp)
    if device.type == "cuda":  # training memory: every method builds the full model first
        torch.cuda.reset_peak_memory_stats(device)
    step = method_step(method, model, optim, autocast, batch_of(cfg, batch, seq, device), warmup)
    times = []
    probed = []
    for i in range(warmup + steps):
        if i == warmup and probe is not None:
            probed.append(probe())
        _sync(device)
        began = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - began)
        elif i == warmup - 1 and method.startswith("gtp"):
            gtp_wrap.reset_stats(model)  # count the timed (steady-state) steps only
    if probe is not None:
        probed.append(probe())
    median = statistics.median(times)
    tokens = batch * seq
    # An untied input embedding is a lookup, not a GEMM: its parameters do no FLOPs; of a
    # mixture of experts, a token runs top_k experts of them all.
    gemm_params = cfg.n_params - (0 if cfg.tie_embeddings else cfg.vocab * cfg.d)
    if cfg.experts:
        idle = (cfg.experts - cfg.top_k) * 3 * cfg.d * cfg.expert_ffn
        gemm_params -= cfg.layers * idle
    flops = 6 * gemm_params * tokens + 12 * cfg.layers * cfg.d * seq * tokens
    out = {
        "method": method,
        "step_ms": 1e3 * median,
        "tokens_per_s_per_gpu": tokens / median,
        "mfu": flops / median / PEAK_BF16_FLOPS,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) - baseline) / 2**30
        if device.type == "cuda"
        else None,
    }
    if probed:
        out["host_probe_ms"] = statistics.mean(probed)
    if method.startswith("gtp"):
        s = gtp_wrap.stats(model)
        if out["peak_mem_gib"] is not None:  # symmetric memory the allocator does not count
            out["peak_mem_gib"] += s["workspace_bytes_outside_allocator"] / 2**30
        out["blocking_by_pass"] = s["blocking_by_pass"]
    del step, model, optim  # a graphed step must go before its model (and NCCL)
    return out


def run(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """Each method at each model and batch, `args.rounds` times, keeping each one's fastest
    round. Odd rounds run the methods in reverse order: what ran before a method in the same
    process moves its figures (host speed, allocator state)."""
    best: dict[tuple[str, int, str], dict] = {}
    probe = HostProbe(device)
    for model_name, batches in args.plan:
        cfg = MODELS[model_name]
        for batch in batches:
            for round_ in range(args.rounds):
                for method in args.methods[:: -1 if round_ % 2 else 1]:
                    r = measure(method, cfg, batch, args.seq, args.warmup, args.steps, device,
                                args.gtp_policy, args.fused_adamw, probe, args.dp)  # fmt: skip
                    r |= {"model": model_name, "batch": batch, "seq": args.seq, "dp": args.dp}
                    key = (model_name, batch, method)
                    if key not in best or r["step_ms"] < best[key]["step_ms"]:
                        best[key] = r
                    if dist.get_rank() == 0:
                        print(f"{model_name:>6} b{batch} {method:>6} round {round_}: "
                              f"{r['step_ms']:8.1f} ms", flush=True)  # fmt: skip
    return [best[(m, b, method)] for m, bs in args.plan for b in bs for method in args.methods]


def table(rows: list[dict]) -> str:
    """One line per result; GTP rows add their ratios to the floors, to FSDP2 and to plain
    mixed precision (amp) of the same model and batch (gfloor: the graphed floor).
    gtp_compile is compared with the compiled floor, FSDP2 and amp where they ran."""
    refs = {"GTP/floor": "floor", "GTP/gfloor": "floor_graph", "GTP/FSDP2": "fsdp2",
            "GTP/AMP": "amp"}  # fmt: skip
    lines = [
        f"{'model':>6} {'batch':>5} {'method':>12} {'step ms':>9} {'tok/s/GPU':>10} {'MFU':>6} "
        f"{'peak GiB':>9} " + " ".join(f"{name:>10}" for name in refs)
    ]
    for r in rows:
        same = {
            x["method"]: x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]
        }
        peer = {
            ref: f"{ref}_compile" if r["method"] == "gtp_compile" else ref for ref in refs.values()
        }
        peer = {ref: p if p in same else ref for ref, p in peer.items()}
        ratios = [
            f"{r['step_ms'] / same[peer[ref]]['step_ms']:.2f}"
            if r["method"].startswith("gtp") and peer[ref] in same
            else ""
            for ref in refs.values()
        ]
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(
            f"{r['model']:>6} {r['batch']:>5} {r['method']:>12} {r['step_ms']:>9.1f} "
            f"{r['tokens_per_s_per_gpu']:>10.0f} {r['mfu']:>6.1%} {mem:>9} "
            + " ".join(f"{ratio:>10}" for ratio in ratios)
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1]))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ys = [next((r["step_ms"] for r in rows if (r["model"], r["batch"]) == g
                    and r["method"] == method), 0) for g in groups]  # fmt: skip
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{m}\nbatch {b}x{rows[0]['seq']}" for m, b in groups])
    ax.set_ylabel("step time (ms, lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 2 gloo ranks, tiny model; sets --seq 32, --warmup 1, --steps 2, "
                    "--rounds 1")  # fmt: skip
    common_args(ap, Path("benchmarks/results"), "prefetch_depth=2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs per method (alternating order); the fastest is kept")  # fmt: skip
    ap.add_argument("--methods", nargs="+", default=list(METHODS[:4]), choices=METHODS)
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas: gtp methods on a (dp, world/dp) mesh, fsdp2 "
                    "as HSDP over the same split, the floors stepping 1/(world/dp); ddp as "
                    "without")  # fmt: skip
    ap.add_argument("--plan", default=None,
                    help="model:batches;... (models: " + ", ".join(MODELS) + "); default "
                    "1.36B:1,4,8;125M:1,8, with --smoke smoke:2")  # fmt: skip
    args = ap.parse_args(argv)
    args.gtp_policy = dict(args.gtp_policy)
    if args.smoke:
        args.seq, args.warmup, args.steps, args.rounds = 32, 1, 2, 1
        args.plan = args.plan or "smoke:2"
    args.plan = args.plan or "1.36B:1,4,8;125M:1,8"
    args.plan = [
        (name, [int(b) for b in batches.split(",")])
        for name, batches in (item.split(":") for item in args.plan.split(";"))
    ]
    for name, _ in args.plan:
        if name not in MODELS:
            ap.error(f"--plan: model {name!r}: one of {', '.join(MODELS)}")
        if args.seq > MODELS[name].max_seq:
            ap.error(f"--seq {args.seq}: model {name} takes at most {MODELS[name].max_seq} "
                     "tokens; pass a shorter --seq")  # fmt: skip
    return args


def _field(item: str) -> tuple[str, object]:
    """FIELD=VALUE, the value a Python literal (30.5, -1, True, 'x') or else a string."""
    key, _, value = item.partition("=")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if not under_torchrun() and not args.smoke:
        sys.exit("run under torchrun (see the module docstring), or pass --smoke")
    launch(_bench_rank, 2, args, cpu=args.smoke)  # torchrun's ranks, or 2 CPU ranks for --smoke


def _bench_rank(device: torch.device, args: argparse.Namespace) -> None:
    if args.dp < 1 or dist.get_world_size() % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world of {dist.get_world_size()}")
    rows = run(device, args)
    if dist.get_rank() == 0:
        report(rows, args, device)


def report(rows: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    launcher = (
        f"torchrun --nproc_per_node {os.environ['LOCAL_WORLD_SIZE']} "
        if "LOCAL_WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
        else ""
    )
    meta = {
        "command": launcher + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "world": dist.get_world_size(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "gpus_on_host": torch.cuda.device_count(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "python": platform.python_version(),
    }
    (args.out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    chart(rows, args.out / "bench.png")
    print(table(rows))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
