"""Training checkpoints of the app: each rank's local shards and optimizer state, saved atomically.

Each rank writes its own file into `step_N.tmp/`; once every rank has written, rank 0 renames
the folder to `step_N/`, so a crash mid-save leaves only complete checkpoints behind. Files are
read with `torch.load(weights_only=True)`: nothing is unpickled. A checkpoint resumes at the
same mesh shape; resharding belongs to torch.distributed.checkpoint (see gtp_wrap.state_dict).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def latest(root: Path) -> Path | None:
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def save(
    root: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer, sched: Any, meta: dict
) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {
        "model": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optim": optim.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
        "world": world,
    }
    torch.save(state, tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def prune(root: Path, keep: int) -> None:
    if dist.get_rank() != 0 or keep <= 0:
        return
    done = sorted(
        (p for p in root.glob("step_*") if not p.name.endswith(".tmp")),
        key=lambda p: int(p.name.split("_")[1]),
    )
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(
    path: Path, model: nn.Module, optim: torch.optim.Optimizer, sched: Any
) -> tuple[int, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = torch.load(path / f"rank{rank}.pt", weights_only=True)
    if state["world"] != world:
        raise ValueError(
            f"{path} was saved by {state['world']} ranks, this run has {world}; resume with the "
            "same nproc and mesh"
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state["model"][name])
    optim.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])
    return state["step"], json.loads((path / "meta.json").read_text())
