"""Profile a few training steps: kernel time by kind, overlap, and GTP's host time per use.

    torchrun --nproc_per_node 2 benchmarks/profile_gtp.py --method gtp --batch 8 --out prof/

The model, optimizer and step are bench_step.py's for the chosen method (floor, gtp, gtp_graph,
...; `--gtp-policy` overrides as there). Writes a torch.profiler Chrome trace per rank and a
JSON summary with: step time; per step, the kernel time of GEMMs, of collective kernels (NCCL's,
or the copy-engine collectives' barriers) and of everything else, the 25 kernels that took
longest, and how long the compute kernels (all others) were busy; the share of NCCL all-gather
and reduce-scatter kernel time that overlaps GEMM kernels; all memcpys (in a step with
copy-engine collectives nearly all are theirs) and their overlap with GEMMs; and for eager GTP
methods the host time spent in GTP's hooks per weight use (interception, pack/unpack,
reduce-scatter issue, excluding the wrapped op itself). `idle_gaps.py` reads the trace for when
the compute waits.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_step import METHODS, MODELS, _build, batch_of, common_args, method_step
from trace_events import (
    intervals,
    is_attention,
    is_barrier,
    is_gemm,
    is_nccl,
    load_gpu_events,
    merge,
)

import gtp_wrap
from gtp_wrap.core.parameter import GTPParameter, is_use
from gtp_wrap.precision import fp8
from gtp_wrap.runtime import uses
from gtp_wrap.runtime.gather import Gatherer
from gtp_wrap.runtime.reduce import GradReducer
from gtp_wrap.runtime.uses import ShardedLinear


class HookTimer:
    """Accumulates host time inside GTP's hooks, minus the compute they run.

    Hooks: the interception of a use (`__torch_function__`), saved-tensor pack and unpack, the
    backward of the engine's own linear, the reduce-scatter issue. Compute: the intercepted op,
    and inside the engine's linear its GEMMs. A hook inside a hook counts once; a hook inside
    compute (autograd packing what an op saves) counts as hook time.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.enabled = False
        self._depth = 0  # hooks open outside compute
        self._computing = False
        self._inner = 0.0  # compute time inside the outermost open hook
        self._hooks_in_compute = 0.0  # hook time inside the open compute
        orig_tf = GTPParameter.__torch_function__.__func__  # type: ignore[attr-defined]
        timer = self

        def torch_function(cls, func, types, args=(), kwargs=None):
            if not timer.enabled or not is_use(func):
                return orig_tf(cls, func, types, args, kwargs)
            return timer._hook(orig_tf, cls, timer._compute(func), types, args, kwargs)

        GTPParameter.__torch_function__ = classmethod(torch_function)  # type: ignore[assignment]
        for cls, name in ((Gatherer, "pack"), (Gatherer, "unpack"), (GradReducer, "reduce_grad")):
            setattr(cls, name, self._hooked(getattr(cls, name)))
        ShardedLinear.backward = staticmethod(self._hooked(ShardedLinear.backward))
        uses.F = SimpleNamespace(linear=self._compute(F.linear))  # the linear's own GEMMs
        uses.weight_grad = self._compute(uses.weight_grad)
        fp8.linear_forward = self._compute(fp8.linear_forward)
        torch.Tensor.__matmul__ = self._compute(torch.Tensor.__matmul__)

    def _hooked(self, fn: Callable) -> Callable:
        def wrapped(*a, **k):
            return self._hook(fn, *a, **k) if self.enabled else fn(*a, **k)

        return wrapped

    def _hook(self, fn: Callable, *a, **k):
        if self._depth and not self._computing:
            return fn(*a, **k)  # inside a hook already: counted there
        saved = (self._computing, self._inner)
        self._computing, self._inner = False, 0.0
        self._depth += 1
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            elapsed = time.perf_counter() - start
            self.seconds += elapsed - self._inner
            self._depth -= 1
            self._computing, self._inner = saved
            if self._computing:
                self._hooks_in_compute += elapsed

    def _compute(self, fn: Callable) -> Callable:
        def timed(*a, **k):
            if not self._depth or self._computing:
                return fn(*a, **k)
            self._computing, self._hooks_in_compute = True, 0.0
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._inner += time.perf_counter() - start - self._hooks_in_compute
                self._computing = False

        return timed


def _overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of `spans` covered by the union of `cover`."""
    merged = merge(cover)
    total = 0.0
    for s, e in spans:
        for ms, me in merged:
            if me <= s:
                continue
            if ms >= e:
                break
            total += min(e, me) - max(s, ms)
    return total


def _is_comm(name: str) -> bool:
    """NCCL's kernels, and the barriers of the copy-engine collectives."""
    return is_nccl(name) or is_barrier(name)


def analyse_trace(path: Path, steps: int) -> dict:
    events = load_gpu_events(path)
    kernels = [e for e in events if e["cat"] == "kernel"]
    gemms = intervals([e for e in kernels if is_gemm(e["name"])])
    # Copy-engine collectives move their bytes as memcpys, not kernels.
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    spans = intervals(copies)
    busy = sum(e - s for s, e in spans)
    out = {
        "memcpy": {
            "count_per_step": len(copies) / steps,
            "ms_per_step": busy / steps / 1e3,
            "overlapped_with_gemm_share": _overlap(spans, gemms) / busy if busy else None,
        }
    }
    for label, key in (("all_gather", "allgather"), ("reduce_scatter", "reducescatter")):
        spans = intervals([e for e in kernels if is_nccl(e["name"]) and key in e["name"].lower()])
        busy = sum(e - s for s, e in spans)
        out[label] = {
            "kernels": len(spans),
            "total_us": busy,
            "overlapped_with_gemm_share": _overlap(spans, gemms) / busy if busy else None,
        }
    out["gemm_kernels"] = len(gemms)
    nccl = [e for e in kernels if _is_comm(e["name"])]
    compute = intervals([e for e in kernels if not _is_comm(e["name"])])
    busy = _overlap([(compute[0][0], max(e for _, e in compute))], compute) if compute else 0.0
    gemm_us = sum(e - s for s, e in gemms)
    attention_us = sum(e["dur"] for e in kernels if is_attention(e["name"]))
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e["name"][:120], [0, 0.0])
        entry[0] += 1
        entry[1] += e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    out["top_kernels_per_step"] = [
        {"name": name, "count": n / steps, "ms": us / steps / 1e3} for name, (n, us) in top
    ]
    out["per_step_ms"] = {
        "gemm": gemm_us / steps / 1e3,
        "attention": attention_us / steps / 1e3,
        # Before 2026-12-06 attention's kernels were counted in "gemm" (trace_events.py).
        "other_compute": (sum(e - s for s, e in compute) - gemm_us - attention_us) / steps / 1e3,
        "compute_stream_busy": busy / steps / 1e3,
        "collective_kernels": sum(e["dur"] for e in nccl) / steps / 1e3,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1.36B", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cprofile", action="store_true", help="also write a host-side cProfile")
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="backward on the calling thread, where cProfile sees it (a GPU's backward "
        "otherwise runs on autograd's device thread, which the profile misses)",
    )
    ap.add_argument("--method", default="gtp", choices=METHODS)
    common_args(ap, Path("prof"), "gather_dtype=fp8")
    args = ap.parse_args()
    args.gtp_policy = dict(args.gtp_policy)
    # Torch keeps it per thread: this one runs every step below.
    torch.autograd.set_multithreading_enabled(not args.one_thread)

    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MODELS[args.model]
    model, opt, autocast = _build(
        args.method, cfg, device, world, args.gtp_policy, args.fused_adamw
    )
    gtp = args.method.startswith("gtp")
    if args.method == "gtp_graph" and args.warmup < 3:
        ap.error("gtp_graph needs --warmup >= 3 (two eager steps, then the capture)")
    timer = HookTimer() if gtp else None
    idx = batch_of(cfg, args.batch, args.seq, device)
    # A graphed step is captured in the last warm-up step, so the timed steps replay.
    graphed = args.method == "gtp_graph"
    step = method_step(args.method, model, opt, autocast, idx, graph_warmup=args.warmup - 1)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if gtp:
        gtp_wrap.reset_stats(model)
    if timer is not None:
        timer.enabled = not graphed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    if timer is not None:
        timer.enabled = False
    step_ms = start.elapsed_time(end) / args.steps
    stats = gtp_wrap.stats(model) if gtp else {}

    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / f"trace_rank{rank}.json"
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    # Host time by op over the two profiled steps: where the eager step's host time goes.
    (args.out / f"ops_rank{rank}.txt").write_text(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    )
    if args.cprofile:
        host = cProfile.Profile()
        host.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        host.disable()
        with open(args.out / f"cprofile_rank{rank}.txt", "w") as f:
            pstats.Stats(host, stream=f).sort_stats("tottime").print_stats(80)
            pstats.Stats(host, stream=f).sort_stats("cumulative").print_stats(60)
    summary = {
        "config": vars(args) | {"out": str(args.out)},
        "world": dist.get_world_size(),
        "step_ms": step_ms,
        "stats_per_step": {k: v / args.steps for k, v in stats.items() if isinstance(v, int)},
        "blocking_by_pass": stats.get("blocking_by_pass"),
        "host_us_per_weight_use": 1e6 * timer.seconds / stats["gathers"]
        if timer is not None and stats["gathers"]
        else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trace": analyse_trace(trace_path, steps=2),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    (args.out / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=2))
    if rank == 0:
        print(json.dumps(summary, indent=2))
    gtp_wrap.release_graphs()  # a live graph keeps NCCL from shutting down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
