"""Step-time ratios that a drifting host cannot move: methods take turns one step at a time.

    python benchmarks/paired_steps.py                                  # CPU, a tiny GPT
    torchrun --nproc_per_node 1 benchmarks/paired_steps.py --model 125M --batch 1 \
        --methods floor gtp_blocks gtp --fused-adamw --cycles 200

bench_step.py's methods (floor, gtp_blocks, gtp, the compiled ones, ...) on bench_step.py's model
and step, at a world of one, all built before the first step. After `--warmup` steps each, the
methods take turns: a cycle runs one step of every method (every other cycle in reverse order),
each step timed between two device synchronizations. A method's ratio to the first method is
the median, over the cycles, of its step divided by the first method's step of the same cycle,
with a distribution-free 95 % interval of that median (order statistics of the binomial).

Note: why one step at a time. An eager step at batch 1 is host-bound, and the hosts of the GPU
machine change speed within a call: bench_step.py's and step_phases.py's rounds (a method's
steps run back to back, then the next method's) read gtp_blocks / floor 1.43, 1.44, 1.19 and
1.01 round by round in one call (RESULTS.md, 2026-12-06), each round a few hundred milliseconds
per method. Steps of two methods a few milliseconds apart run on the host at the same speed,
so the ratio of a cycle's two steps is the engine's cost, and the median over many cycles
leaves out the cycles a neighbour's burst hit.

The host probe (host_probe.py) takes a turn in every cycle too: `host_probe_ms` is the median of
its runs, the host's speed while the steps ran, which `gtp-plan validate` scales a run's host
time by (timed before and after a minute of steps instead, the probe put the 125M batch-1 floor
at 3.8 to 5.2 × its own time over the H100 and H200 calls of 2026-12-03 to 06). The JSON has
step_phases.py's layout (`ms[method]["step"]`, the median step; `host_probe_ms`), so
`stored_runs.phases_runs` reads it for `gtp-plan validate`, and `ratios` besides.

With `--baseline TREE` (another commit's checkout) each gtp method also runs on that tree's
gtp_wrap as `<method>@base`, in the same cycles: an engine change read against the commit
before it on one host at one time (see step_phases.py for what sharing a process implies),
as each method's per-cycle ratio to its baseline (`against_base`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import types
from pathlib import Path
from typing import Any

import torch
from bench_step import METHODS, _build, _sync, batch_of, method_step
from host_probe import HostProbe
from step_phases import MODELS, load_baseline

import gtp_wrap
from gtp_wrap.app.launch import launch
from gtp_wrap.app.model import GPTConfig

PROBE = "host probe"  # the probe's turn in a cycle
AT_BASE = "@base"  # the suffix of a method run on the --baseline tree's gtp_wrap


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """(median, low, high): the median of `values` and a 95 % interval of it from their order
    statistics (normal approximation of the binomial; the whole range below 6 values)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)  # 1.96 standard deviations of Binomial(n, 1/2)
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[low], ordered[high]


def paired(
    device: torch.device,
    cfg: GPTConfig,
    *,
    batch: int,
    seq: int,
    methods: list[str],
    cycles: int,
    warmup: int = 5,
    fused_adamw: bool = True,
    probe: HostProbe | None = None,
    base: types.ModuleType | None = None,
) -> dict[str, Any]:
    """Every method's step times, cycle by cycle, and each method's ratios to the first; with
    `probe`, one run of the host probe in every cycle too, in turn with the steps
    (`host_probe_ms`: their median), so that the host's speed is read when the steps ran; with
    `base` (another tree's gtp_wrap, step_phases.load_baseline), each gtp method also runs on
    it, as `<method>@base`, in the same cycles."""
    idx = batch_of(cfg, batch, seq, device)
    libs = {m: gtp_wrap for m in methods}
    if base is not None:
        libs.update({f"{m}{AT_BASE}": base for m in methods if m.startswith("gtp")})
        methods = list(libs)
    steps = {}
    for method, lib in libs.items():
        name = method.removesuffix(AT_BASE)
        model, optim, autocast = _build(name, cfg, device, 1, {}, fused_adamw, lib)
        steps[method] = method_step(name, model, optim, autocast, idx, warmup)
        for _ in range(warmup):
            steps[method]()
    _sync(device)
    times: dict[str, list[float]] = {m: [] for m in methods}
    probed: list[float] = []
    turns = [*methods, PROBE] if probe is not None else methods
    for cycle in range(cycles):
        for turn in turns[:: -1 if cycle % 2 else 1]:
            if turn == PROBE:
                probed.append(probe.run())  # type: ignore[union-attr]
                continue
            _sync(device)
            began = time.perf_counter()
            steps[turn]()
            _sync(device)
            times[turn].append(1e3 * (time.perf_counter() - began))

    def ratio(m: str, to: str) -> dict[str, float]:
        r = median_interval([t / f for t, f in zip(times[m], times[to], strict=True)])
        return {"median": r[0], "low": r[1], "high": r[2]}

    based = [m for m in methods if f"{m}{AT_BASE}" in times]
    return {
        "ms": {m: {"step": statistics.median(t)} for m, t in times.items()},
        "ratios": {m: ratio(m, methods[0]) for m in methods[1:]},
        **({"against_base": {m: ratio(m, f"{m}{AT_BASE}") for m in based}} if based else {}),
        "reference": methods[0],
        "steps_ms": times,
        **({"host_probe_ms": statistics.median(probed), "probe_ms": probed} if probed else {}),
    }


def table(result: dict[str, Any]) -> str:
    """A line per method: its median step and its ratio to the reference with the interval."""
    lines = [f"| method | median step, ms | / {result['reference']} (95 % interval) |",
             "|---|---|---|"]  # fmt: skip
    for method, ms in result["ms"].items():
        r = result["ratios"].get(method)
        ratio = f"{r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f})" if r else ""
        lines.append(f"| {method} | {ms['step']:.2f} | {ratio} |")
    for method, r in result.get("against_base", {}).items():
        interval = f"{r['low']:.4f}-{r['high']:.4f}"
        lines.append(f"{method} / {method}{AT_BASE}: {r['median']:.4f} ({interval})")
    return "\n".join(lines)


def _rank(device: torch.device, args: argparse.Namespace) -> None:
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host's own time, not intra-op threads'
    measured = paired(device, MODELS[args.model], batch=args.batch, seq=args.seq,
                      methods=args.methods, cycles=args.cycles, warmup=args.warmup,
                      fused_adamw=args.fused_adamw, probe=HostProbe(device),
                      base=load_baseline(args.baseline) if args.baseline else None)  # fmt: skip
    result = {"command": {k: str(v) for k, v in vars(args).items()}, "device": str(device),
              "world": 1, **measured}  # fmt: skip
    print(table(result))
    print(f"host_probe_ms {result['host_probe_ms']:.3f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default: 16 for tiny, else 2048")
    ap.add_argument("--methods", nargs="+", default=["floor", "gtp_blocks", "gtp"],
                    choices=[m for m in METHODS if m != "ddp"],
                    help="the first is the reference of the ratios")  # fmt: skip
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fused-adamw", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout: its gtp methods run as <method>@base")  # fmt: skip
    args = ap.parse_args(argv)
    args.seq = args.seq or (16 if args.model == "tiny" else 2048)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    launch(_rank, 1, args, cpu=not torch.cuda.is_available())


if __name__ == "__main__":
    main()
