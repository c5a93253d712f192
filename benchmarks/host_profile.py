"""Where a weight use's host time goes: forward and backward apart, the autograd thread's part,
and a profile of the Python functions (issue 21).

    python benchmarks/host_profile.py [--device cuda] [--policy fp32] [--out DIR]

host_overhead.py's stack of tiny Linears (one weight per gather), at a world of 1 and in a faked
world of 2 (fake_world.py, rank 0 on the device), timed per step in four phases: the forward,
the backward, the backward with autograd's device threads off
(`torch.autograd.set_multithreading_enabled`: a GPU's backward then runs on the calling thread),
and `zero_grad`. Each is wall time with the device synchronized after it: the layers are too
small for kernels to be what is waited for. The two kinds of backward alternate step by step, so
neither gains from coming second. On CPU backward always runs on the calling thread; on a GPU,
autograd hands it to a thread of its own, and each Python autograd Function (the engine's) then
takes the GIL on that thread: the difference of the two backward figures is what that hand-off
costs. Last, with the threads off, `cProfile` records forward and backward on rank 0 and the
functions with the most own time are written to `DIR/profile_<world>.txt`: cProfile keeps one
call stack, that of the thread it was enabled on, so a backward on autograd's thread would be
missing from it.

A figure is per weight use beyond the plain model: the phase's extra time divided by the uses of
a step, two per weight (the forward's and backward's re-gather), so the forward's and zero_grad's
figures are their shares of a use. Each is the fastest of `--rounds` rounds of `--steps` steps,
with the garbage collector held off inside a round.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_world  # noqa: E402
from host_overhead import POLICIES, _model, _steps, _wrap  # noqa: E402

PHASES = ("forward", "backward", "backward_one_thread", "zero_grad")


def _phase_us(model: nn.Module, x: torch.Tensor, steps: int, rounds: int) -> dict[str, float]:
    """The fastest round's time per step of each phase, µs."""

    def now() -> float:
        if x.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    _steps(model, x, 5)
    best = dict.fromkeys(PHASES, float("inf"))
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        spent = dict.fromkeys(PHASES, 0.0)
        for step in range(2 * steps):
            one_thread = step % 2 == 1
            start = now()
            loss = model(x).sum()
            forward_done = now()
            with torch.autograd.set_multithreading_enabled(not one_thread):
                loss.backward()
            backward_done = now()
            model.zero_grad(set_to_none=True)
            done = now()
            spent["forward"] += forward_done - start
            backward = "backward_one_thread" if one_thread else "backward"
            spent[backward] += backward_done - forward_done
            spent["zero_grad"] += done - backward_done
        gc.enable()
        for phase in PHASES:
            per_step = spent[phase] / (steps if phase.startswith("backward") else 2 * steps)
            best[phase] = min(best[phase], per_step * 1e6)
    return best


def _profile(model: nn.Module, x: torch.Tensor, steps: int, top: int) -> str:
    """cProfile's own-time table of `steps` steps, backward on the calling thread."""
    _steps(model, x, 5)
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        _steps(model, x, steps)
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
    if top:
        stats.print_stats(top)
    else:
        stats.print_stats()
    return out.getvalue()


def measure(
    args: argparse.Namespace, device: str, profile: bool = True
) -> tuple[dict[str, float], str]:
    """Per weight use beyond the plain model, µs per phase; and the wrapped model's profile
    (empty where `profile` is off)."""
    policy = POLICIES[args.policy]
    dtype = torch.bfloat16 if "param_dtype" in policy else torch.float32

    def build() -> nn.Module:
        return _model(args.weights, args.width, False, 0, device)

    x = torch.randn(4, args.width, device=device)
    plain = _phase_us(build().to(dtype), x.to(dtype), args.steps, args.rounds)
    model = _wrap(build(), policy, 0)
    wrapped = _phase_us(model, x, args.steps, args.rounds)
    uses = 2 * args.weights  # a forward use and a re-gather in backward per weight
    per_use = {p: round((wrapped[p] - plain[p]) / uses, 2) for p in PHASES}
    per_use.update({f"plain_{p}_us": round(plain[p], 1) for p in PHASES})
    return per_use, _profile(model, x, args.steps, args.top) if profile else ""


def _faked(rank: int, device: torch.device, args: argparse.Namespace, out: Path) -> None:
    """A rank of the faked world of 2: rank 0 measures on `device`; the peer wraps the same
    model and records the same chains (the engine's agreement checks go through the store),
    then a single step is all it needs, as faked collectives never wait for it."""
    torch.set_num_threads(1)
    if rank == 0:
        _write(out, "world2_fake", measure(args, device.type))
    else:
        measure(argparse.Namespace(**{**vars(args), "steps": 1, "rounds": 1}), "cpu", False)


def _write(out: Path, world: str, got: tuple[dict[str, float], str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{world}.txt").write_text(got[1])
    (out / f"per_use_{world}.json").write_text(json.dumps(got[0], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policy", choices=list(POLICIES), default="fp32")
    ap.add_argument("--weights", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--top", type=int, default=30, help="functions in each profile (0: all)")
    ap.add_argument("--out", type=Path, default=Path("host_profile"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    _write(args.out, "world1", measure(args, args.device))
    fake_world.spawn(_faked, 2, args, args.out)
    print(f"µs per weight use beyond the plain model ({args.device}, {args.policy}):")
    print(f"{'world':<12} " + " ".join(f"{p:>20}" for p in PHASES))
    for world in ("world1", "world2_fake"):
        per_use = json.loads((args.out / f"per_use_{world}.json").read_text())
        print(f"{world:<12} " + " ".join(f"{per_use[p]:>20.2f}" for p in PHASES))
    print(f"profiles: {args.out}/profile_world1.txt, {args.out}/profile_world2_fake.txt")


if __name__ == "__main__":
    main()
