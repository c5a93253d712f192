"""Collectives and bytes per training step: GTP against torch's tensor parallelism and FSDP2, on
any two ranks (CPU gloo or GPUs), no timing.

    torchrun --nproc_per_node 2 benchmarks/collective_counts.py --model 1.36B --batch 1 4 8

What GTP2 and TP2 move differs in kind: GTP gathers weights and reduce-scatters their gradients
(bytes fixed per step, whatever the batch), tensor parallelism with sequence parallelism
all-gathers and reduce-scatters activations (bytes in proportion to the tokens). Every
collective of one forward + backward is counted on rank 0 by a dispatch mode (c10d and
functional collectives alike), with its payload: a gather's output, a reduce-scatter's input,
an all-reduce's tensor. The optimizer step issues none for these methods.

A step of the full model is too slow on a CPU, so each method runs the model's widths with 1
and 2 layers at two short sequences, and the counts are fitted exactly as
`a + b·layers + c·tokens + d·layers·tokens` (what a layer adds is the same for every layer) and
projected to the model's layers and `batch x seq` tokens per data rank. Methods (bf16 compute,
fp32 gradient reductions, as bench_step.py's):
- gtp: GTPWrap over both ranks (two data ranks);
- fsdp2: fully_shard per block and at the root (two data ranks);
- tp: the blocks split by torch's TP with sequence parallelism (`tensor_parallel_plan`, the
  embedding and head whole on both ranks); one data rank: both ranks read the same batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_step import MODELS
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig, tensor_parallel_plan

METHODS = ("gtp", "fsdp2", "tp")


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched under it, and their payload bytes, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        functional = func.namespace == "_c10d_functional"
        if (func.namespace == "c10d" or functional) and "wait" not in name and "wrap" not in name:
            if "gather" in name:  # c10d: (output, input); functional: (input, group_size)
                kind, nbytes = "all_gather", _nbytes(args[0]) * (args[1] if functional else 1)
            elif "reduce_scatter" in name:  # c10d: (output, input); functional: (input, ...)
                kind, nbytes = "reduce_scatter", _nbytes(args[0] if functional else args[1])
            elif "reduce" in name:
                kind, nbytes = "all_reduce", _nbytes(args[0])
            else:
                kind, nbytes = name.strip("_"), _nbytes(args[0])
            self.count[kind] = self.count.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        return func(*args, **(kwargs or {}))


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def measure(method: str, cfg: GPTConfig, tokens: int, seq: int, device: torch.device) -> dict:
    """Collectives and bytes of one steady-state forward + backward (after one warm-up)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    world, rank = dist.get_world_size(), dist.get_rank()
    data_ranks = world
    if method == "gtp":
        GTPWrap(model, {"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    elif method == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    else:
        model.to(torch.bfloat16)
        mesh, _ = gtp_wrap.make_mesh(gtp=1, tp=world, device_type=device.type)
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence=True))
        data_ranks, rank = 1, 0
    batch = tokens // seq
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(device)

    def step() -> None:
        logits = model(idx[:, :-1]).float()
        F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()
    counter = Collectives()
    with counter:
        step()
    return {"count": counter.count, "bytes": counter.bytes, "data_ranks": data_ranks}


def project(points: list[tuple[int, int, float]], layers: int, tokens: int) -> float:
    """The exact fit of `a + b·L + c·T + d·L·T` through four (L, T, value) points, at
    (`layers`, `tokens`)."""
    a = np.array([[1, L, T, L * T] for L, T, _ in points], dtype=np.float64)
    coef = np.linalg.solve(a, np.array([v for _, _, v in points], dtype=np.float64))
    return float(coef @ np.array([1, layers, tokens, layers * tokens]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1.36B", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=2048, help="the projected step's sequence")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--short-seqs", type=int, nargs=2, default=[8, 16],
                    help="the two sequences actually run")  # fmt: skip
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", type=Path, default=Path("results/collective_counts.json"))
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    full = MODELS[args.model]
    rows = []
    for method in args.methods:
        runs = {}
        for layers in (1, 2):
            cfg = dataclasses.replace(full, layers=layers)
            for seq in args.short_seqs:
                runs[layers, seq] = measure(method, cfg, seq, seq, device)
        kinds = sorted({k for r in runs.values() for k in r["count"]})
        for batch in args.batch:
            tokens = batch * args.seq
            row: dict[str, Any] = {"method": method, "batch": batch, "seq": args.seq}
            for field in ("count", "bytes"):
                for kind in kinds:
                    points = [(L, s, r[field].get(kind, 0)) for (L, s), r in runs.items()]
                    row[f"{field}_{kind}"] = round(project(points, full.layers, tokens))
            row["bytes_total"] = sum(v for k, v in row.items() if k.startswith("bytes_"))
            row["data_ranks"] = runs[1, args.short_seqs[0]]["data_ranks"]
            rows.append(row)
        if dist.get_rank() == 0:
            print(method, {k: v for k, v in runs.items()}, flush=True)
    if dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        head = {"model": args.model, "world": dist.get_world_size(), "device": device.type}
        args.out.write_text(json.dumps(head | {"rows": rows}, indent=2))
        for row in rows:
            gib = row["bytes_total"] / 2**30
            counts = {k[6:]: v for k, v in row.items() if k.startswith("count_")}
            print(f"{row['method']:>6} b{row['batch']}: {gib:7.2f} GiB per rank per step, "
                  f"collectives {counts}, data ranks {row['data_ranks']}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
