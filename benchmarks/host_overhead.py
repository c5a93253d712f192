"""Host time the engine adds per weight use, on CPU, with weights too small to cost anything else.

    python benchmarks/host_overhead.py [--weights 16] [--width 64] [--steps 100] [--out f.json]

A stack of `--weights` tiny `nn.Linear` layers runs forward and backward with and without
GTPWrap, in a world of 1 (the engine's Python path alone: no collective is issued) and of 2
spawned gloo ranks (the path with its gathers and reduce-scatters issued). Two policies: fp32
(the default) and bf16 compute over fp32 masters; both gather one weight per collective
(`group_numel: 0`), so each use walks the whole per-use path.

Note: the figure is the main thread's CPU time (`time.thread_time`), not wall time. Gloo moves
data on threads of its own and the main thread sleeps while it waits, so CPU time counts what
the engine's Python and the ops it dispatches cost, and not how long the peer or the loopback
took. "Per use" divides the step's extra time by two uses per weight: its forward use and its
re-gather in backward. Each figure is the median over rounds of the mean over `--steps` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gtp_wrap import GTPWrap  # noqa: E402

POLICIES = {
    "fp32": {"min_shard_numel": 0, "group_numel": 0},
    "bf16": {"min_shard_numel": 0, "group_numel": 0, "param_dtype": "bfloat16",
             "reduce_dtype": "float32"},
}  # fmt: skip


def _model(weights: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(weights)))


def _step_cpu_us(model: nn.Module, x: torch.Tensor, steps: int, rounds: int) -> float:
    """Median over rounds of the main thread's CPU time per forward + backward step."""
    for _ in range(5):  # the first passes record chains and make buffers
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
    per_round = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(steps):
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)
        per_round.append((time.thread_time() - start) / steps * 1e6)
    return statistics.median(per_round)


def measure(weights: int, width: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per policy: the plain and the wrapped step's CPU time and the extra per weight use."""
    x = torch.randn(4, width)
    plain = _step_cpu_us(_model(weights, width), x, steps, rounds)
    out = {}
    for name, policy in POLICIES.items():
        model = GTPWrap(_model(weights, width), policy)
        dtype = torch.bfloat16 if "param_dtype" in policy else torch.float32
        ref = _step_cpu_us(_model(weights, width).to(dtype), x.to(dtype), steps, rounds)
        wrapped = _step_cpu_us(model, x, steps, rounds)
        base = ref if dtype != torch.float32 else plain
        out[name] = {
            "plain_step_us": round(base, 1),
            "gtp_step_us": round(wrapped, 1),
            "per_use_us": round((wrapped - base) / (2 * weights), 2),
        }
    return out


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        got = measure(args.weights, args.width, args.steps, args.rounds)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"world1": measure(args.weights, args.width, args.steps, args.rounds)}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(
            _rank, args=(2, os.path.join(tmp, "store"), args, result), nprocs=2,
            start_method="spawn",
        )  # fmt: skip
        with open(result) as f:
            results["world2_gloo"] = json.load(f)
    print(f"{'world':<12} {'policy':<6} {'plain us/step':>14} {'GTP us/step':>12} {'us/use':>8}")
    for world, by_policy in results.items():
        for policy, r in by_policy.items():
            print(
                f"{world:<12} {policy:<6} {r['plain_step_us']:>14.1f} {r['gtp_step_us']:>12.1f}"
                f" {r['per_use_us']:>8.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results | {"args": vars(args), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
