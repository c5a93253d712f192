"""Profile a few GTP training steps and measure overlap and host time per weight use.

    torchrun --nproc_per_node 2 benchmarks/profile_gtp.py --out prof/

The model is the reference Llama-style GPT (bf16 weights, no fp32 masters). Writes a
torch.profiler Chrome trace per rank and a JSON summary with: the share of all-gather
and reduce-scatter kernel time that overlaps GEMM kernels, step time, and the host time spent
in GTP's hooks per weight use (interception, pack/unpack, reduce-scatter issue, excluding the
wrapped op itself).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_step import MODELS, _field

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT
from gtp_wrap.engine import GTPEngine
from gtp_wrap.parameter import GTPParameter, is_use


class HookTimer:
    """Accumulates host time inside GTP's hooks, minus the time of the ops they wrap."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.enabled = False
        timer = self
        orig_tf = GTPParameter.__torch_function__.__func__  # type: ignore[attr-defined]

        def torch_function(cls, func, types, args=(), kwargs=None):
            if not timer.enabled or not is_use(func):
                return orig_tf(cls, func, types, args, kwargs)
            inner = [0.0]

            def timed(*a, **k):
                t = time.perf_counter()
                r = func(*a, **k)
                inner[0] += time.perf_counter() - t
                return r

            t0 = time.perf_counter()
            result = orig_tf(cls, timed, types, args, kwargs)
            timer.seconds += time.perf_counter() - t0 - inner[0]
            return result

        GTPParameter.__torch_function__ = classmethod(torch_function)  # type: ignore[assignment]
        for name in ("_pack", "_unpack", "reduce_grad"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        orig = getattr(GTPEngine, name)
        timer = self

        def wrapped(engine, *a, **k):
            if not timer.enabled:
                return orig(engine, *a, **k)
            t = time.perf_counter()
            r = orig(engine, *a, **k)
            timer.seconds += time.perf_counter() - t
            return r

        setattr(GTPEngine, name, wrapped)


def _intervals(events: list[dict], pred) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if pred(e["name"]))


def _overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of `spans` covered by the union of `cover`."""
    merged: list[list[float]] = []
    for s, e in cover:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = 0.0
    for s, e in spans:
        for ms, me in merged:
            if me <= s:
                continue
            if ms >= e:
                break
            total += min(e, me) - max(s, ms)
    return total


def _is_gemm(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul"))


def analyse_trace(path: Path) -> dict:
    trace = json.loads(path.read_text())
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    gemms = _intervals(kernels, _is_gemm)
    out = {}
    for label, key in (("all_gather", "allgather"), ("reduce_scatter", "reducescatter")):
        spans = _intervals(kernels, lambda n, k=key: "nccl" in n.lower() and k in n.lower())
        busy = sum(e - s for s, e in spans)
        out[label] = {
            "kernels": len(spans),
            "total_us": busy,
            "overlapped_with_gemm_share": _overlap(spans, gemms) / busy if busy else None,
        }
    out["gemm_kernels"] = len(gemms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1.36B", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("prof"))
    ap.add_argument("--cprofile", action="store_true", help="also write a host-side cProfile")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model's parameters (float32: masters for param_dtype)")  # fmt: skip
    ap.add_argument("--gtp-policy", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="GTPPolicy overrides: param_dtype=bfloat16 gather_dtype=fp8")  # fmt: skip
    args = ap.parse_args()
    args.gtp_policy = dict(_field(item) for item in args.gtp_policy)

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = MODELS[args.model]
    with torch.device("cuda"):
        model = GPT(cfg).to(getattr(torch, args.dtype))
    GTPWrap(model, args.gtp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timer = HookTimer()
    idx = torch.randint(0, cfg.vocab, (args.batch, args.seq), device="cuda")

    def step() -> None:
        loss = F.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    gtp_wrap.reset_stats(model)
    timer.enabled = True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    timer.enabled = False
    step_ms = start.elapsed_time(end) / args.steps
    stats = gtp_wrap.stats(model)
    uses = stats["gathers"]

    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / f"trace_rank{rank}.json"
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    if args.cprofile:
        host = cProfile.Profile()
        host.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        host.disable()
        with open(args.out / f"cprofile_rank{rank}.txt", "w") as f:
            pstats.Stats(host, stream=f).sort_stats("tottime").print_stats(40)
    summary = {
        "config": vars(args) | {"out": str(args.out)},
        "world": dist.get_world_size(),
        "step_ms": step_ms,
        "stats_per_step": {k: v / args.steps for k, v in stats.items() if isinstance(v, int)},
        "blocking_by_pass": stats["blocking_by_pass"],
        "host_us_per_weight_use": 1e6 * timer.seconds / max(uses, 1),
        "peak_gathered_mib": stats["peak_gathered_bytes"] / 2**20,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trace (2 profiled steps)": analyse_trace(trace_path),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    (args.out / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=2))
    if rank == 0:
        print(json.dumps(summary, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
