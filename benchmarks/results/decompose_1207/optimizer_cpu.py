"""The optimizer's host time per tensor on CPU (RESULTS.md, 2026-12-07): fused and foreach AdamW
over 86 small parameters against one of the same elements, then the step of the tiny GPT
wrapped (gtp_blocks) against the plain model (amp), interleaved, and a cProfile of each.

    python benchmarks/results/decompose_1207/optimizer_cpu.py
"""

import cProfile
import dataclasses
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[2]))
import bench_step  # noqa: E402


def median_us(step, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e6


def adamw_us(params: list[torch.nn.Parameter], fused: bool) -> float:
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused, foreach=None if fused else True)
    for _ in range(20):
        opt.step()
    return median_us(opt.step, 300)


CPU = torch.device("cpu")


def tiny_gpt_optimizers(
    model: str = "tiny", device: torch.device = CPU
) -> dict[str, torch.optim.Optimizer]:
    """The fused AdamW of a GPT plain (amp) and wrapped (gtp_blocks), each after one training
    step at batch 1, in a world of one: the tiny GPT (its seq 16), or bench_step's `model` (its
    seq 2048)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if model == "tiny":
        cfg, seq = dataclasses.replace(bench_step.MODELS["125M"], d=64, heads=2, vocab=256,
                                       ffn=128), 16  # fmt: skip
    else:
        cfg, seq = bench_step.MODELS[model], 2048
    optims = {}
    for method in ("amp", "gtp_blocks"):
        net, optim, autocast = bench_step._build(method, cfg, device, 1, {}, True)
        idx = bench_step.batch_of(cfg, 1, seq, device)
        bench_step.train_step(net, optim, autocast)(idx[:, :-1], idx[:, 1:])
        optims[method] = optim
    return optims


def interleaved_medians(
    steps: dict[str, Callable[[], object]], n: int = 400, device: torch.device | None = None
) -> None:
    """Print each step's median time over `n` rounds, the steps taking turns: on a GPU
    (`device`), the host's time to return from the call, the device idle at its start."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            if device is not None:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    for name in steps:
        print(f"{name} step: {sorted(times[name])[n // 2] * 1e6:.0f} us (median of {n})")


if __name__ == "__main__":
    for fused in (True, False):
        many = [torch.nn.Parameter(torch.zeros(8)) for _ in range(86)]
        one = [torch.nn.Parameter(torch.zeros(86 * 8))]
        print("fused" if fused else "foreach", f"86: {adamw_us(many, fused):.0f} us,",
              f"1: {adamw_us(one, fused):.0f} us")  # fmt: skip
    optims = tiny_gpt_optimizers()
    interleaved_medians({method: optim.step for method, optim in optims.items()})
    for method, optim in optims.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            optim.step()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(8)
        print(method, out.getvalue())
