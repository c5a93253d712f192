"""Where an eager step's host time goes, timed in place: per phase, and per engine function.

    python benchmarks/step_phases.py                                    # CPU, a tiny GPT
    torchrun --nproc_per_node 1 benchmarks/step_phases.py --model 125M --batch 1 --fused-adamw

bench_step.py's methods (floor, gtp, gtp_blocks, ...) on bench_step.py's model and step, at a
world of one, interleaved over `--rounds` rounds (every other one in reverse order). Each step
is cut into its phases (forward and loss, backward, optimizer step, zero_grad) and each phase's
host time is read with `time.perf_counter` around it, with no device synchronization inside the
step: at batch 1 the step is host-bound, so the host's time per phase is what the step is made
of (the device is synchronized once per step, after it). `step_cpu` is the process's CPU time
over the four phases (every thread's: a GPU's backward runs on autograd's own thread), without
the wait for the device after them: what the host worked for the step. On the H200 host it read
within 2 % of the step's wall time for every method (`results/cpu_time_1204/`): its threads are
not kept waiting for a core; what moves steps between calls is how fast the host's cores run the
work (their clock, or caches and memory shared with other tenants: these figures cannot tell
which). The JSON carries `host_probe_ms` (benchmarks/host_probe.py, timed after the rounds),
which `gtp-plan validate` scales a stored run's host time by. Besides, the engine functions of
`TIMED` are timed where they run (on the autograd thread too, where a GPU's backward runs them),
so their share of each phase is read without a profiler, whose own overhead grows with the
Python it traces. Each figure is the smallest, over the rounds, of a round's median per step;
the JSON's `rounds_ms` (and the log's `rounds_ms` lines) keep every round's median step, the
spread the best round hides.

With `--fake-world N` the step runs at a world of N whose collectives are faked (torch's "fake"
process-group backend: every collective returns at once and moves nothing), on one device: the
engine's whole path for N ranks (gathers issued and waited for, saved weights rematerialized,
gradients reduce-scattered, FSDP2's copy-in and copy-out) without a second GPU. At batch 1 the
step is host-bound and the collectives' device time small (see [Note: a faked world] in
fake_world.py), so this is the host side of an N-GPU step, the one no one-GPU run shows. Rank 0
measures on the GPU (or CPU); the other ranks run the same wrap and warm-up steps on CPU at a
short sequence, which is all the engine asks of its peers (the agreement checks at wrap and when
a chain is recorded, through the store), then wait for rank 0.

With `--baseline TREE` (a checkout of another commit, e.g. `git worktree add /tmp/base HEAD~3`)
each gtp method also runs on that tree's gtp_wrap, imported beside this one as
`gtp_wrap_baseline`, as `<method>@base`: both trees' methods take turns, round by round, in
one process on one host, where two runs one after the other moved the floor by 15-20 % on the
H200 host. Both packages' global optimizer-step hooks then run on every step, so figures with
`--baseline` compare with each other, not with runs without it.

With `--one-thread` each method also runs as `<method>/1t`, its steps under
`torch.autograd.set_multithreading_enabled(False)`: a GPU's backward then runs on the calling
thread instead of autograd's device thread (on CPU it does anyway). Both share the model and
optimizer and take turns as above, so what tells them apart is the hand-off to that thread and
the host's noise.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fake_world
import torch
import torch.nn.functional as F
from bench_step import MODELS, _build, batch_of, clear_grads
from host_probe import HostProbe

import gtp_wrap
from gtp_wrap.app.launch import launch
from gtp_wrap.app.model import GPTConfig

MODELS = {**MODELS, "tiny": GPTConfig(vocab=256, d=64, layers=12, heads=4, ffn=128, max_seq=64)}
PHASES = ("forward", "backward", "optimizer", "zero_grad")
# (module of runtime/, class, attribute): the engine's per-block, per-use and per-pass functions.
TIMED = (
    ("uses", "BlockWeights", "forward"),
    ("uses", "BlockWeights", "backward"),
    ("uses", "Uses", "use"),
    ("uses", "ShardedLinear", "forward"),
    ("uses", "ShardedLinear", "backward"),
    ("reduce", "GradReducer", "reduce_grad"),
    ("reduce", "GradReducer", "reduce_grads"),
    ("gather", "Gatherer", "gather"),
    ("gather", "Gatherer", "_issue"),
    ("casts", "Casts", "refresh"),
    ("engine", "GTPEngine", "open_forward"),
    ("engine", "GTPEngine", "close_forward"),
    ("engine", "GTPEngine", "_end_backward"),
)
BASELINE = "gtp_wrap_baseline"
ONE_THREAD = "/1t"  # the suffix of a method run with its backward on the calling thread


def load_baseline(tree: Path) -> types.ModuleType:
    """The gtp_wrap package of the checkout at `tree`, imported as `gtp_wrap_baseline` (the
    library's own imports are relative, so its modules are all that copy's)."""
    init = tree / "gtp_wrap" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--baseline {tree}: no gtp_wrap/__init__.py there")
    spec = importlib.util.spec_from_file_location(
        BASELINE, init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    lib = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE] = lib
    spec.loader.exec_module(lib)
    return lib


class Timers:
    """Host time and calls of the `TIMED` functions of each package in `libs`, while `on`
    (a baseline's that it lacks are left out)."""

    def __init__(self, libs: list[types.ModuleType]) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False
        for lib in libs:
            for module, cls, name in TIMED:
                owner = getattr(importlib.import_module(f"{lib.__name__}.runtime.{module}"), cls)
                fn = owner.__dict__.get(name)
                if fn is None and lib.__name__ == BASELINE:
                    continue
                if fn is None:
                    raise SystemExit(f"step_phases: TIMED names {cls}.{name}, which is gone")
                static = isinstance(fn, staticmethod)
                timed = self._timed(f"{cls}.{name}", fn.__func__ if static else fn)
                setattr(owner, name, staticmethod(timed) if static else timed)

    def _timed(self, key: str, fn: Callable) -> Callable:
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += clock() - began
                self.calls[key] += 1

        return timed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, device: torch.device, world: int = 1) -> dict[str, Any]:
    cfg = MODELS[args.model]
    base = load_baseline(args.baseline) if args.baseline else None
    timers = Timers([gtp_wrap] if base is None else [gtp_wrap, base])
    # (model, optimizer, autocast dtype or None) per method
    built = {m: _build(m, cfg, device, world, {}, args.fused_adamw) for m in args.methods}
    if base is not None:
        for m in [m for m in args.methods if m.startswith("gtp")]:
            built[f"{m}@base"] = _build(m, cfg, device, world, {}, args.fused_adamw, base)
    if args.one_thread:
        built.update({f"{m}{ONE_THREAD}": b for m, b in list(built.items())})
    idx = batch_of(cfg, args.batch, args.seq, device)
    x, y = idx[:, :-1], idx[:, 1:]
    best: dict[str, dict[str, float]] = {m: {} for m in built}
    # Each round's median step per method, to see the host's spread beside the best round.
    rounds: dict[str, list[float]] = {m: [] for m in built}
    calls: dict[str, dict[str, int]] = {}
    for r in range(args.rounds):
        # Every other round in reverse, so that no method always runs after the same others
        # (a drift within a round would favour the ones it reaches last).
        order = list(built.items())
        for method, (model, optim, autocast) in order[::-1] if r % 2 else order:
            per: dict[str, list[float]] = collections.defaultdict(list)
            timers.calls.clear()
            # Set once for the method's steps, outside the phases it would add to.
            with torch.autograd.set_multithreading_enabled(not method.endswith(ONE_THREAD)):
                for step in range(args.warmup + args.steps):
                    timed = step >= args.warmup
                    timers.on = timed and method.startswith("gtp")
                    before = dict(timers.seconds)
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    with torch.autocast(device.type, autocast, enabled=autocast is not None):
                        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    optim.step()
                    t3 = time.perf_counter()
                    clear_grads(method, model, optim)
                    t4, c4 = time.perf_counter(), time.process_time()
                    _sync(device)
                    t5 = time.perf_counter()
                    if not timed:
                        continue
                    for phase, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
                        per[phase].append(b - a)
                    per["step"].append(t5 - t0)
                    per["step_cpu"].append(c4 - c0)
                    for key in timers.calls:
                        per[key].append(timers.seconds[key] - before.get(key, 0.0))
            calls[method] = {k: v // args.steps for k, v in timers.calls.items()}
            for key, values in per.items():
                median = statistics.median(values)
                best[method][key] = min(best[method].get(key, median), median)
            rounds[method].append(1e3 * statistics.median(per["step"]))
    # The package whose engine each gtp method ran on.
    packages = {m: type(model._gtp_engine).__module__.split(".")[0]
                for m, (model, _, _) in built.items() if m.startswith("gtp")}  # fmt: skip
    return {"ms": {m: {k: 1e3 * v for k, v in b.items()} for m, b in best.items()},
            "calls_per_step": calls, "packages": packages, "rounds_ms": rounds}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    """Milliseconds per step, a column per method; an engine function's calls per step after
    its time."""
    ms, calls = result["ms"], result["calls_per_step"]
    methods = list(ms)
    first = ["step", "step_cpu", *PHASES]
    keys = first + sorted({k for m in methods for k in ms[m]} - set(first))
    lines = ["| ms per step | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for key in keys:
        row = [
            f"{ms[m][key]:.2f}" + (f" ({calls[m][key]})" if key in calls[m] else "")
            if key in ms[m]
            else ""
            for m in methods
        ]
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default: 16 for tiny, else 2048")
    ap.add_argument("--methods", nargs="+", default=["floor", "gtp", "gtp_blocks"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fused-adamw", action="store_true")
    ap.add_argument("--baseline", type=Path, default=None, help="another commit's checkout")
    ap.add_argument(
        "--fake-world",
        type=int,
        default=1,
        metavar="N",
        help="a world of N ranks whose collectives are faked (one device)",
    )
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="also run each method with its backward on the calling thread (<method>/1t)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    args.seq = args.seq or (16 if args.model == "tiny" else 2048)
    if args.fake_world > 1:
        if MODELS[args.model].experts:
            raise SystemExit(
                "--fake-world: a mixture of experts routes on its (faked) weights, "
                "so ranks would diverge; use a dense model"
            )
        fake_world.spawn(_faked, args.fake_world, args)
        return
    launch(_rank, 1, args, cpu=not torch.cuda.is_available())


def _rank(device: torch.device, args: argparse.Namespace, world: int = 1) -> None:
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host's own time, not intra-op threads'
    measured = measure(args, device, world)
    # The host's speed (host_probe.py), after the rounds: before them, a faked world's peers
    # are still building their models on this host's cores.
    host_probe_ms = HostProbe(device)()
    result = {"command": {k: str(v) for k, v in vars(args).items()}, "device": str(device),
              "world": world, "host_probe_ms": host_probe_ms, **measured}  # fmt: skip
    print(table(result))
    print(f"host_probe_ms {host_probe_ms:.3f}")
    for method, values in measured["rounds_ms"].items():
        print(f"rounds_ms {method} " + " ".join(f"{v:.2f}" for v in values))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def _faked(rank: int, device: torch.device, args: argparse.Namespace) -> None:
    """One rank of `--fake-world` (see [Note: a faked world] in fake_world.py): rank 0
    measures; the others wrap the same models and run their warm-up steps on CPU at a short
    sequence, so that every agreement check the engine makes finds them."""
    if rank == 0:
        _rank(device, args, args.fake_world)
        return
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // 4)))
    peer = argparse.Namespace(**{**vars(args), "seq": 16, "rounds": 1, "steps": 1})
    measure(peer, device, args.fake_world)


if __name__ == "__main__":
    main()
