"""What occupies GPU memory at the peak of a training step, by the code that allocated it.

    torchrun --nproc_per_node 2 benchmarks/memory_breakdown.py --method gtp --batch 1

Each method runs in a process of its own (a previous method's cached or late-freed memory would
otherwise count against the next one). The CUDA caching allocator records every allocation with
its Python stack from before the model is built; after the warm-up steps one more step runs, and
its trace is replayed to find the moment `memory_allocated` peaks. The blocks live at that moment
are grouped by the code that made them: the innermost frame in gtp_wrap's library, else in the
model, the optimizer, FSDP, or "backward (no Python frame)" for autograd's own allocations.
Rank 0 prints the groups and writes them to JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from bench_step import MODELS, _build, batch_of, common_args, method_step

from gtp_wrap.app.launch import launch, under_torchrun

_MAX_ENTRIES = 2_000_000  # allocation events kept; the analysis needs all of them

# Frames that only pass a call through: the allocation belongs to what they call.
_PASS_THROUGH = {"use", "__torch_function__", "full_weight", "forward"}


def category(frames: list[dict]) -> str:
    """Who allocated a block, from its Python stack (innermost frame first)."""
    for f in frames:
        name = f["filename"]
        if "/gtp_wrap/" in name and "/gtp_wrap/app/" not in name and f["name"] not in _PASS_THROUGH:
            return f"gtp_wrap/{name.rsplit('/gtp_wrap/', 1)[1]}:{f['name']}"
    for f in frames:
        name = f["filename"]
        if "/gtp_wrap/app/" in name or "bench_step.py" in name:
            return f"model/step: {name.rsplit('/', 1)[1]}:{f['name']}:{f['line']}"
        if "/torch/optim/" in name:
            return "optimizer state"
        if "/torch/distributed/fsdp/" in name:
            return f"fsdp: {f['name']}"
    if not frames:
        return "backward (no Python frame)"
    return f"{frames[0]['filename'].rsplit('/', 1)[1]}:{frames[0]['name']}"


def peak_breakdown(trace: list[dict], start: int) -> tuple[int, dict[str, int]]:
    """Replay allocation events; return the peak of live bytes reached at or after event
    `start` and the live bytes per category at that moment."""
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    peak_at = None
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
        if i >= start and total > peak:
            peak, peak_at = total, i
    live.clear()
    for ev in trace[: (peak_at or 0) + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    groups: dict[str, int] = defaultdict(int)
    for size, frames in live.values():
        groups[category(frames)] += size
    return peak, dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _rank(device: torch.device, args: argparse.Namespace) -> None:
    cfg = MODELS[args.model]
    torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES, stacks="python")
    world = dist.get_world_size()
    model, optim, autocast = _build(
        args.method, cfg, device, world, args.gtp_policy, args.fused_adamw
    )
    idx = batch_of(cfg, args.batch, args.seq, device)
    step = method_step(args.method, model, optim, autocast, idx, graph_warmup=0)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = len(torch.cuda.memory._snapshot()["device_traces"][device.index])
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    torch.cuda.memory._record_memory_history(enabled=None)
    if len(trace) >= _MAX_ENTRIES:
        sys.exit("the allocation trace wrapped around: raise _MAX_ENTRIES or use fewer steps")
    peak, groups = peak_breakdown(trace, start)
    if dist.get_rank() == 0:
        result = {
            "method": args.method, "policy": args.gtp_policy, "model": args.model,
            "batch": args.batch, "seq": args.seq,
            "allocated_between_steps_gib": before / 2**30, "step_peak_gib": peak / 2**30,
            "live_at_peak_gib": {k: v / 2**30 for k, v in groups.items()},
        }  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "".join(f"_{k}={v}" for k, v in args.gtp_policy.items())
        path = args.out / f"memory_{args.method}_{args.model}_b{args.batch}{tag}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"{args.method} b{args.batch}: between steps {before / 2**30:.2f} GiB, "
              f"step peak {peak / 2**30:.2f} GiB")  # fmt: skip
        for k, v in list(groups.items())[: args.top]:
            print(f"  {v / 2**30:7.3f} GiB  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--method", default="gtp", choices=["ddp", "fsdp2", "gtp", "gtp_fp8"])
    ap.add_argument("--model", default="1.36B", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    common_args(ap, Path("benchmarks/results"), "compute_copy=true")
    args = ap.parse_args()
    args.gtp_policy = dict(args.gtp_policy)
    if not under_torchrun() or not torch.cuda.is_available():
        sys.exit("run under torchrun on GPUs (see the module docstring)")
    launch(_rank, 2, args)


if __name__ == "__main__":
    main()
