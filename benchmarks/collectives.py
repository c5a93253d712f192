"""Time one transformer layer's weight collectives issued one per weight, grouped, or flat.

    torchrun --nproc_per_node 2 benchmarks/collectives.py --out results/collectives.json

GTP gathers each weight on its own. On NVLink a collective of a few MB is latency-bound, so a
layer's seven weights cost more on the wire one by one than the same bytes in one collective.
This measures, for the 1.36B model's layer (q, k, v, o: 2048 x 2048; gate, up: 5632 x 2048;
down: 2048 x 5632) and for the embedding, the bf16 all-gathers and fp32 reduce-scatters of
`--layers` consecutive layers issued as (a) one collective per weight, (b) one grouped NCCL
launch (`allgather_into_tensor_coalesced`), (c) one collective over a flat buffer of the same
bytes. Median of `--iters` CUDA-event timings; host time is the issuing call's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

LAYER = [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632)]


def _time(issue: Callable[[], dist.Work], iters: int) -> tuple[float, float]:
    """Median device ms and median host us of one issue-and-wait of the collectives."""
    dev, host = [], []
    for i in range(iters + 5):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        work = issue()
        host_s = time.perf_counter() - t
        work.wait()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            dev.append(start.elapsed_time(end))
            host.append(host_s * 1e6)
    return statistics.median(dev), statistics.median(host)


class _All:
    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _issuers(kind: str, small: list, big: list) -> dict[str, Callable[[], dist.Work]]:
    """The three ways to issue one kind of collective over these tensors."""
    pg = dist.group.WORLD
    flat_small, flat_big = torch.cat(small), torch.cat(big)
    if kind == "all_gather":
        return {
            "per_weight": lambda: _All([pg._allgather_base(b, s) for b, s in zip(big, small)]),
            "grouped": lambda: pg.allgather_into_tensor_coalesced(big, small),
            "flat": lambda: pg._allgather_base(flat_big, flat_small),
        }
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    return {
        "per_weight": lambda: _All(
            [pg._reduce_scatter_base(s, b, opts) for b, s in zip(big, small)]
        ),
        "grouped": lambda: pg.reduce_scatter_tensor_coalesced(small, big, opts),
        "flat": lambda: pg._reduce_scatter_base(flat_small, flat_big, opts),
    }


def measure(shapes: list[tuple[int, int]], iters: int) -> dict:
    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    numels = [r * c // world for r, c in shapes]
    out: dict = {"weights": len(shapes), "numel": sum(numels) * world}
    for kind, dtype in (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)):
        small = [torch.randn(n, device=dev).to(dtype) for n in numels]
        big = [torch.randn(n * world, device=dev).to(dtype) for n in numels]
        for name, issue in _issuers(kind, small, big).items():
            ms, us = _time(issue, iters)
            out[f"{kind}/{name}_ms"] = round(ms, 4)
            out[f"{kind}/{name}_host_us"] = round(us, 1)
        if dist.get_rank() == 0:
            print(kind, {k: v for k, v in out.items() if k.startswith(kind)}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="results/collectives.json")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    results = {}
    for name, shapes in (
        ("1 layer", LAYER),
        ("2 layers", LAYER * 2),
        ("embedding", [(32000, 2048)]),
    ):
        if dist.get_rank() == 0:
            print("==", name, flush=True)
        results[name] = measure(shapes, args.iters)
    if dist.get_rank() == 0:
        info = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "gpu": torch.cuda.get_device_name(), "world": dist.get_world_size()}  # fmt: skip
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
