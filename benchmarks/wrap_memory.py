"""Wrap time and memory per rank: a model built on the meta device and wrapped (each rank
allocates and initializes only its part) against one built whole and then wrapped.

    torchrun --nproc_per_node 1 benchmarks/wrap_memory.py --model 1.36B   # GPUs: allocator peak
    python benchmarks/wrap_memory.py --cpu 4 --model 125M                  # CPU ranks

Per rank and mode: the seconds from building the model to the end of GTPWrap; the peak memory
allocated meanwhile (the CUDA allocator's high-water mark on GPUs; on CPU ranks the peak of live
tensor storages that torch ops made, `LiveBytes`, and the growth of the process's peak RSS);
what the rank keeps (its shards, replicated parameters and buffers); and the bound the meta
path is held to, 1.1 x (kept + the largest weight, staged whole during the init). The peak RSS
is a process's lifetime high-water mark: give one mode per run (`--modes meta`) to read it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from bench_step import MODELS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gtp_wrap import GTPWrap
from gtp_wrap.app.launch import launch, under_torchrun
from gtp_wrap.app.model import GPT


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of CPU tensor storages alive at once, among those that torch ops
    made inside it: an allocator's high-water mark for what the body allocates on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.views: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # a wrapper without storage of its own
                continue
            if not ptr:
                continue
            if ptr not in self.views:
                self.views[ptr], self.size[ptr] = 0, storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.views[ptr] += 1
            weakref.finalize(t, self._drop, ptr)
        return out

    def _drop(self, ptr: int) -> None:
        self.views[ptr] -= 1
        if not self.views[ptr]:
            del self.views[ptr]
            self.now -= self.size.pop(ptr)


def measure(mode: str, model_name: str, device: torch.device) -> dict[str, Any]:
    cfg = MODELS[model_name]
    # fp32, so that what a rank keeps is its parameters and buffers (no compute copies).
    policy = {"min_shard_numel": 0} if cfg.d < 512 else {}
    live = LiveBytes()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    began = time.perf_counter()
    with live if device.type == "cpu" else torch.no_grad():
        if mode == "meta":
            with torch.device("meta"):
                model = GPT(cfg)
            GTPWrap(model, policy, device=device)
        else:
            with torch.device(device):
                model = GPT(cfg)
            GTPWrap(model, policy)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    with torch._C.DisableTorchFunctionSubclass():
        kept = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    with torch.device("meta"):
        largest = max(p.numel() * p.element_size() for p in GPT(cfg).parameters())
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else live.peak
    del model
    return {
        "mode": mode, "model": model_name, "rank": dist.get_rank(), "seconds": seconds,
        "peak_gib": peak / 2**30, "kept_gib": kept / 2**30, "largest_gib": largest / 2**30,
        "bound_gib": 1.1 * (kept + largest) / 2**30,
        "rss_growth_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 2**20,
    }  # fmt: skip


def _rank(device: torch.device, args: argparse.Namespace) -> None:
    for mode in args.modes:
        row = measure(mode, args.model, device)
        for r in range(dist.get_world_size()):  # one rank's line at a time
            if r == dist.get_rank():
                print(json.dumps(row), flush=True)
            dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1.36B", choices=list(MODELS))
    ap.add_argument("--modes", nargs="*", default=["meta", "full"], choices=["meta", "full"])
    ap.add_argument("--cpu", type=int, default=0, metavar="RANKS", help="CPU ranks to spawn")
    args = ap.parse_args()
    if not under_torchrun() and not args.cpu:
        raise SystemExit("run under torchrun (see the module docstring), or pass --cpu RANKS")
    launch(_rank, args.cpu or 1, args, cpu=bool(args.cpu), oversubscribe=True)


if __name__ == "__main__":
    main()
