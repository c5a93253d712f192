"""Host time the engine adds per weight use, on CPU, with weights too small to cost anything else.

    python benchmarks/host_overhead.py [--weights 16] [--width 64] [--steps 100] [--out f.json]
        [--bias]
    python benchmarks/host_overhead.py --callgrind [--steps 40]     # instructions, world of 1
    python benchmarks/host_overhead.py --block 4       # blocks of 4 layers on gathered weights
    python benchmarks/host_overhead.py --device cuda   # worlds of 1 and faked 2 on a GPU
    python benchmarks/host_overhead.py --device cuda --one-thread   # backward on the caller

A stack of `--weights` tiny `nn.Linear` layers runs forward and backward with and without
GTPWrap, in a world of 1 (the engine's Python path alone: no collective is issued), of 2 spawned
gloo ranks (the path with its gathers and reduce-scatters issued), and of 2 ranks on torch's
fake process group (`world2_fake`: the same collectives issued and waited for as on NCCL,
returning at once; no gloo wait polls, so its counts are the same on every run). Two policies:
fp32 (the default) and bf16 compute over fp32 masters; both gather one weight per collective
(`group_numel: 0`), so each use walks the whole per-use path. With `--bias` the layers have
biases, which are replicated: their gradients take the all-reduce path too. With `--block K` the
layers form blocks of K that run on their weights gathered once per call
(`gtp_wrap.gather_per_block`, as gtp-train runs its transformer blocks) instead of one
interception per use; the reference is the same nesting without GTP.

Beside the time, each row counts the aten ops a step dispatches (a `TorchDispatchMode`
counting every op, collectives included) beyond the plain model's, per weight use: the same
count on every run, where each op costs dispatcher time and, on a GPU, a kernel launch. It also
counts the Python function calls a step makes beyond the plain model's (`sys.setprofile`), per
weight use, on CPU (where backward runs on the calling thread): the same on every run at a
world of 1 (at 2 gloo ranks it moves by a few percent: how often a wait polls), and what the
engine's Python path costs in calls; on the H200 host the same tree's per-use time moved by
2.7 x between two runs of one call.

`--callgrind` counts instructions instead (valgrind's callgrind, world of 1): the same
count for the same code on every run, where CPU time on a shared 2-core machine moved by +-30 %
between runs. Each policy runs twice under valgrind, with `--steps` and twice as many steps;
the difference is the steps' own count, without Python's and torch's start-up.

Note: the figure is the main thread's CPU time (`time.thread_time`), not wall time. Gloo moves
data on threads of its own and the main thread sleeps while it waits, so CPU time counts what
the engine's Python and the ops it dispatches cost, and not how long the peer or the loopback
took. On a GPU (`--device cuda`: a world of 1, and the faked world of 2 with rank 0 on the
GPU and its peer on CPU) the figure is wall time with the device synchronized at the end of
each round: the layers are too small for their kernels to be what
the step waits for. Beside it, a GPU run reports the same from the process's CPU time
(`time.process_time`, every thread: autograd runs a CUDA backward on a thread of its own). On
the H200 host the two read the same within 4 % (`results/cpu_time_1204/`): what moves the
per-use time between hosts (25.6 to 87.6 us for one tree) is how fast the host's cores run the
work (their clock, or caches and memory shared with other tenants: these figures cannot tell
which), not time its threads wait for a core. "Per use" divides the step's extra time by two
uses per weight: its forward use and its re-gather in backward. Each figure is the fastest of
`--rounds` rounds of `--steps` steps, with the garbage collector held off inside a round (as
`timeit` does).

With `--one-thread` every step, plain and wrapped, runs with
`torch.autograd.set_multithreading_enabled(False)`: a GPU's backward runs on the calling thread,
not handed to autograd's device thread (on CPU backward runs there anyway).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fake_world  # noqa: E402

from gtp_wrap import GTPWrap, gather_per_block  # noqa: E402

POLICIES = {
    "fp32": {"min_shard_numel": 0, "group_numel": 0},
    "bf16": {"min_shard_numel": 0, "group_numel": 0, "param_dtype": "bfloat16",
             "reduce_dtype": "float32"},
}  # fmt: skip


def _model(weights: int, width: int, bias: bool, block: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(width, width, bias=bias, device=device) for _ in range(weights)]
    if block:
        layers = [nn.Sequential(*layers[i : i + block]) for i in range(0, weights, block)]
    return nn.Sequential(*layers)


def _wrap(model: nn.Module, policy: dict, block: int) -> nn.Module:
    GTPWrap(model, policy)
    return gather_per_block(model, blocks=list(model)) if block else model


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _steps(model: nn.Module, x: torch.Tensor, n: int) -> None:
    """`n` forward + backward steps, gradients cleared after each: what every figure times or
    counts, after 5 of them as warm-up (the first passes record chains and make buffers)."""
    for _ in range(n):
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)


def _ops_per_step(model: nn.Module, x: torch.Tensor, steps: int = 4) -> collections.Counter[str]:
    """The aten ops of one forward + backward step in steady state (after the warm-up)."""
    _steps(model, x, 5)
    counter = _OpCounter()
    with counter:
        _steps(model, x, steps)
    return collections.Counter({k: v // steps for k, v in counter.counts.items()})


def _python_calls_per_step(model: nn.Module, x: torch.Tensor, steps: int = 4) -> float:
    """Python function calls a forward + backward step makes in steady state (the warm-up
    done): like the op count, the same on every run, where the step's time is not."""
    _steps(model, x, 5)
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    gc.collect()
    gc.disable()
    sys.setprofile(count)
    try:
        _steps(model, x, steps)
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls / steps


def _step_cpu_us(model: nn.Module, x: torch.Tensor, steps: int, rounds: int) -> tuple[float, float]:
    """The fastest round's time per forward + backward step: main-thread CPU time on CPU; on a
    GPU, wall time with the device synchronized, and the process's CPU time (every thread's:
    autograd runs a CUDA backward on a thread of its own), each the fastest of the rounds."""
    cuda = x.is_cuda
    clock = time.perf_counter if cuda else time.thread_time
    _steps(model, x, 5)
    per_round, cpu_per_round = [], []
    for _ in range(rounds):
        gc.collect()
        gc.disable()  # a collection landing in one round would be most of its noise
        start, cpu_start = clock(), time.process_time()
        _steps(model, x, steps)
        if cuda:
            torch.cuda.synchronize()
        per_round.append((clock() - start) / steps * 1e6)
        cpu_per_round.append((time.process_time() - cpu_start) / steps * 1e6)
        gc.enable()
    return min(per_round), min(cpu_per_round)


def measure(args: argparse.Namespace, device: str) -> dict[str, dict[str, float]]:
    """Per policy: the plain and the wrapped step's CPU time and the extra per weight use."""
    weights, steps, rounds = args.weights, args.steps, args.rounds
    # Torch keeps it per thread: this one, which runs every step measured here.
    torch.autograd.set_multithreading_enabled(not args.one_thread)

    def build() -> nn.Module:
        return _model(weights, args.width, args.bias, args.block, device)

    x = torch.randn(4, args.width, device=device)
    plain, plain_cpu = _step_cpu_us(build(), x, steps, rounds)
    out = {}
    for name, policy in POLICIES.items():
        model = _wrap(build(), policy, args.block)
        dtype = torch.bfloat16 if "param_dtype" in policy else torch.float32
        ref, ref_cpu = _step_cpu_us(build().to(dtype), x.to(dtype), steps, rounds)
        wrapped, wrapped_cpu = _step_cpu_us(model, x, steps, rounds)
        base, base_cpu = (ref, ref_cpu) if dtype != torch.float32 else (plain, plain_cpu)
        plain_ops = _ops_per_step(build().to(dtype), x.to(dtype))
        gtp_ops = _ops_per_step(model, x)
        extra = {k: gtp_ops[k] - plain_ops[k] for k in gtp_ops | plain_ops}
        # On a GPU, backward's Python runs on autograd's own threads, which the profile
        # function does not see: counted on CPU only.
        calls = (
            _python_calls_per_step(model, x)
            - _python_calls_per_step(build().to(dtype), x.to(dtype))
            if device == "cpu"
            else None
        )
        out[name] = {
            "plain_step_us": round(base, 1),
            "gtp_step_us": round(wrapped, 1),
            "per_use_us": round((wrapped - base) / (2 * weights), 2),
            # On a GPU, the same from the process's CPU time (see the Note above).
            "per_use_cpu_us": round((wrapped_cpu - base_cpu) / (2 * weights), 2)
            if device != "cpu"
            else None,
            "extra_ops_per_use": round(sum(extra.values()) / (2 * weights), 2),
            "extra_python_calls_per_use": None
            if calls is None
            else round(calls / (2 * weights), 2),
            "extra_ops_per_step": dict(
                sorted(((k, v) for k, v in extra.items() if v), key=lambda kv: -kv[1])
            ),
        }
    return out


def _run_steps(args: argparse.Namespace) -> None:
    """Wrap the stack at world 1 and run `args.run_steps` steps after the warm-up (under
    valgrind)."""
    torch.set_num_threads(1)
    model = _model(args.weights, args.width, args.bias, args.block, "cpu")
    model = _wrap(model, POLICIES[args.policy], args.block)
    x = torch.randn(4, args.width)
    # Held off as in the timed rounds: whether a full collection (every object torch made)
    # lands in the N-step or the 2N-step run depends on the code's allocations. With it on,
    # one run of a tree counted 7-10 % more per step than two runs with it off; those two
    # still differed by 3 %.
    gc.collect()
    gc.disable()
    _steps(model, x, 5 + args.run_steps)


def _instructions(policy: str, steps: int, args: argparse.Namespace) -> int:
    cmd = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
        os.path.abspath(__file__), "--run-steps", str(steps), "--policy", policy,
        "--weights", str(args.weights), "--width", str(args.width), "--block", str(args.block),
    ] + ["--bias"] * args.bias  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def count_instructions(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per policy: instructions per step and per weight use, from runs of N and 2N steps."""
    runs = [(policy, n) for policy in POLICIES for n in (args.steps, 2 * args.steps)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(runs, pool.map(lambda r: _instructions(*r, args), runs)))
    out = {}
    for policy in POLICIES:
        per_step = (counts[policy, 2 * args.steps] - counts[policy, args.steps]) / args.steps
        out[policy] = {
            "instructions_per_step": round(per_step),
            "instructions_per_use": round(per_step / (2 * args.weights)),
        }
    return out


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        got = measure(args, "cpu")
        if rank == 0:
            with open(result, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def _faked(rank: int, device: torch.device, args: argparse.Namespace, result: str) -> None:
    """A rank of the faked world (fake_world.py): rank 0 measures on `device`; the peer runs
    the same steps on CPU, which its agreement checks need."""
    torch.set_num_threads(1)
    got = measure(args, device.type)
    if rank == 0:
        with open(result, "w") as f:
            json.dump(got, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--callgrind", action="store_true", help="count instructions instead")
    parser.add_argument("--run-steps", type=int, help=argparse.SUPPRESS)  # one valgrind run
    parser.add_argument("--policy", choices=list(POLICIES), help=argparse.SUPPRESS)
    parser.add_argument("--bias", action="store_true", help="layers with (replicated) biases")
    parser.add_argument(
        "--block", type=int, default=0, help="layers per block on gathered weights (0: per use)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (worlds of 1 and faked 2)")
    parser.add_argument(
        "--one-thread", action="store_true", help="backward on the calling thread (see above)"
    )
    args = parser.parse_args()
    if args.run_steps is not None:
        _run_steps(args)
        return
    if args.callgrind:
        counted = count_instructions(args)
        for policy, r in counted.items():
            print(f"world1 {policy:<6} {r['instructions_per_step']:>14,} instructions/step"
                  f" {r['instructions_per_use']:>10,} /use")  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"callgrind_world1": counted, "args": vars(args)}, f, indent=1)
        return
    torch.set_num_threads(1)
    results = {"world1": measure(args, args.device)}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        if args.device == "cpu":  # gloo's world of 2: its waits block the host
            mp.start_processes(_rank, args=(2, os.path.join(tmp, "store"), args, result),
                               nprocs=2, start_method="spawn")  # fmt: skip
            with open(result) as f:
                results["world2_gloo"] = json.load(f)
        fake_world.spawn(_faked, 2, args, result)  # the NCCL path's host side, on this device
        with open(result) as f:
            results["world2_fake"] = json.load(f)
    print(
        f"{'world':<12} {'policy':<6} {'plain us/step':>14} {'GTP us/step':>12} {'us/use':>8}"
        f" {'extra ops/use':>14} {'py calls/use':>13} {'CPU us/use':>11}"
    )
    for world, by_policy in results.items():
        for policy, r in by_policy.items():
            print(
                f"{world:<12} {policy:<6} {r['plain_step_us']:>14.1f} {r['gtp_step_us']:>12.1f}"
                f" {r['per_use_us']:>8.2f} {r['extra_ops_per_use']:>14.2f}"
                f" {r['extra_python_calls_per_use'] or '-':>13}"
                f" {r['per_use_cpu_us'] if r['per_use_cpu_us'] is not None else '-':>11}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results | {"args": vars(args), "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
