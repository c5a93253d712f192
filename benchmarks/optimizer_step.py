"""The optimizer step of a wrapped model: owner-based Muon against duplicated Muon and AdamW, its
share of the training step, its collectives, and the Newton–Schulz balance of the owners.

    torchrun --nproc_per_node 2 benchmarks/optimizer_step.py --plan "1.36B:1,8"
    python benchmarks/optimizer_step.py --smoke        # CPU, 2 gloo ranks, no timing claims
    python benchmarks/optimizer_step.py --smoke --plan 125M:1 --modes muon muon_duplicated
    python benchmarks/optimizer_step.py --balance 1.36B  # owners' NS load at 2..64 ranks, no GPU

Modes, each on the bench_step model wrapped with bf16 gathers and fp32 reductions:
- adamw: torch.optim.AdamW (fused on GPUs) on every parameter;
- muon: gtp_wrap.optim.Muon, embedding and head on AdamW: each matrix orthogonalized once, by
  its owner, two all-to-alls per step;
- muon_duplicated: the same update, but every rank all-gathers every matrix's update (one
  collective per matrix) and orthogonalizes all of them, as Megatron's default does.
Each reports the median optimizer step and whole step (forward, backward, step) in ms, the
optimizer's share, and the collectives one optimizer step issued on rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_step import MODELS, _model, batch_of

from gtp_wrap import GTPWrap
from gtp_wrap.app.launch import launch, under_torchrun
from gtp_wrap.io.state_dict import to_dtensor
from gtp_wrap.optim import Muon, muon_param_groups
from gtp_wrap.optim.muon import _box, _engine_of, _full, _managed
from gtp_wrap.optim.newton_schulz import cost
from gtp_wrap.optim.owners import assign_owners

MODES = ("adamw", "muon", "muon_duplicated")


class DuplicatedMuon(Muon):
    """The baseline: every rank gathers every whole update and orthogonalizes every matrix."""

    def _orthogonalized(self, items: list) -> list[torch.Tensor]:
        engine = _engine_of([p for p, _, _ in items])
        if engine is None:
            return super()._orthogonalized(items)
        fulls = []
        for p, group, update in items:
            w = _managed(p)
            if w is not None and _box(engine, p) != _full(p):  # a part: gather the rest
                update = to_dtensor(engine, w, update.contiguous()).full_tensor()
                self.collectives += 1
            fulls.append((update, group))
        done = self._orthogonalize_all(fulls)
        return [d[_box(engine, p).index] for d, (p, _, _) in zip(done, items)]


def _optimizer(mode: str, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if mode == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    groups = muon_param_groups(model, adamw=["embed.*", "head.*"], lr=0.02)
    return (Muon if mode == "muon" else DuplicatedMuon)(groups, lr=1e-4)


def measure(mode: str, model_name: str, batch: int, seq: int, steps: int,
            device: torch.device) -> dict:  # fmt: skip
    cfg = MODELS[model_name]
    model = _model(cfg, device, torch.float32)
    policy: dict[str, Any] = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    if cfg.d < 512:
        policy["min_shard_numel"] = 0
    GTPWrap(model, policy)
    optim = _optimizer(mode, model, device)
    idx = batch_of(cfg, batch, seq, device)
    whole, opt_times, collectives = [], [], 0
    for i in range(2 + steps):
        _sync(device)
        began = time.perf_counter()
        loss = F.cross_entropy(model(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        _sync(device)
        mid = time.perf_counter()
        before = getattr(optim, "collectives", 0)
        optim.step()
        _sync(device)
        end = time.perf_counter()
        collectives = getattr(optim, "collectives", 0) - before
        optim.zero_grad(set_to_none=True)
        if i >= 2:
            whole.append(end - began)
            opt_times.append(end - mid)
    step_ms, opt_ms = 1e3 * statistics.median(whole), 1e3 * statistics.median(opt_times)
    out = {"mode": mode, "model": model_name, "batch": batch, "step_ms": step_ms,
           "optimizer_ms": opt_ms, "optimizer_share": opt_ms / step_ms,
           "collectives_per_step": collectives}  # fmt: skip
    if isinstance(optim, Muon):
        load = optim.ns_load()
        out["ns_balance"] = max(load) / (sum(load) / len(load))
    del model, optim
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def balance(model_name: str) -> list[dict]:
    """The owners' NS balance (max rank's cost over the mean) at 2..64 ranks, from the shapes
    alone: the Muon matrices of `model_name` with embedding and head on AdamW."""
    with torch.device("meta"):
        model = _model(MODELS[model_name], torch.device("meta"), torch.float32)
    shapes = [p.shape for n, p in model.named_parameters()
              if p.ndim >= 2 and not n.startswith(("embed.", "head."))]  # fmt: skip
    rows = []
    for world in (2, 4, 8, 16, 32, 64):
        load = [0] * world
        for owner, shape in zip(assign_owners(shapes, world), shapes):
            load[owner] += cost(shape)
        rows.append({"world": world, "matrices": len(shapes),
                     "balance": max(load) / (sum(load) / world)})  # fmt: skip
    return rows


def _rank(device: torch.device, args: argparse.Namespace) -> None:
    rows = []
    for item in args.plan.split(";"):
        name, batches = item.split(":")
        for batch in map(int, batches.split(",")):
            for mode in args.modes:
                rows.append(measure(mode, name, batch, args.seq, args.steps, device))
                if dist.get_rank() == 0:
                    print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0 and args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        meta = {"world": dist.get_world_size(), "device": str(device), "gpu": gpu}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default=None, help="model:batches;... (default 1.36B:1,8)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--balance", default=None, metavar="MODEL")
    args = ap.parse_args(argv)
    if args.balance:
        for row in balance(args.balance):
            print(json.dumps(row))
        return
    if args.smoke:  # CPU ranks: the smoke model unless a plan is given, short sequences
        args.plan, args.seq, args.steps = args.plan or "smoke:2", 32, 2
    args.plan = args.plan or "1.36B:1,8"
    if not under_torchrun() and not args.smoke:
        sys.exit("run under torchrun (see the module docstring), or pass --smoke")
    launch(_rank, 2, args, cpu=args.smoke)


if __name__ == "__main__":
    main()
