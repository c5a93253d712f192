"""`gtp-train`: train the reference GPT with GTP on the machine at hand (a Hydra app).

Not under torchrun it starts `nproc` local ranks itself (gloo on CPU, NCCL with one rank per
GPU); under torchrun it uses the ranks torchrun started. Bad input is refused with one message
before any rank starts.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import gtp_wrap
from gtp_wrap import GTPPolicy, GTPWrap
from gtp_wrap.config.policy import resolve_policy
from gtp_wrap.errors import PolicyError
from gtp_wrap.mesh import MESH_DIMS

from ..io import checkpoint
from . import report
from .data import DataConfig, DataError, TokenStream
from .launch import LaunchError, check_local_devices, launch, under_torchrun
from .model import GPT, GPTConfig


def _validate(cfg: dict) -> None:
    """Everything a user can get wrong, checked before any rank starts."""
    policy = resolve_policy(cfg["policy"])
    GPTConfig(**cfg["model"])
    if cfg["device"] not in ("auto", "cpu"):
        raise LaunchError(f"device={cfg['device']!r}: use auto (GPUs where present) or cpu")
    on_cpu = cfg["device"] == "cpu" or not torch.cuda.is_available()
    if policy.collectives == "copy_engine" and on_cpu:
        raise LaunchError(
            "policy collectives=copy_engine moves data between GPUs; on CPU ranks use "
            "collectives=process_group"
        )
    t = cfg["trainer"]
    for key in ("steps", "batch", "seq", "accumulation", "eval_batches"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise LaunchError(f"trainer.{key}={t[key]!r}: must be a whole number >= 1")
    if t["seq"] > cfg["model"]["max_seq"]:
        raise LaunchError(f"trainer.seq={t['seq']} exceeds model.max_seq={cfg['model']['max_seq']}")
    if not 0 < cfg["data"]["val_fraction"] < 1:
        raise LaunchError(
            f"data.val_fraction={cfg['data']['val_fraction']}: must be between 0 and 1 (exclusive)"
        )
    # The splits and the token ids against the vocab, as every rank will check them.
    TokenStream(DataConfig(**cfg["data"]), t["seq"], cfg["model"]["vocab"], cfg["seed"])
    if cfg["mesh"] is not None and len(cfg["mesh"]) != 2:
        raise LaunchError(f"mesh={cfg['mesh']}: give two sizes, [dp, gtp]")
    if not under_torchrun():
        check_local_devices(cfg["nproc"], cpu=cfg["device"] == "cpu")
        world = cfg["nproc"]
        if cfg["mesh"] is not None and math.prod(cfg["mesh"]) != world:
            raise LaunchError(f"mesh={cfg['mesh']} does not multiply to nproc={world}")


def _lr_lambda(t: dict):
    def factor(step: int) -> float:
        if step < t["warmup"]:
            return (step + 1) / t["warmup"]
        progress = (step - t["warmup"]) / max(1, t["steps"] - t["warmup"])
        floor = t["min_lr"] / t["lr"]
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _mean(value: torch.Tensor) -> float:
    dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
    return value.item() / (1 if value.is_cuda else dist.get_world_size())


def train(device: torch.device, cfg: dict, run_dir: str) -> None:
    """One rank's training loop."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, t = Path(run_dir), cfg["trainer"]
    torch.manual_seed(cfg["seed"])
    model_cfg = GPTConfig(**cfg["model"])
    model = GPT(model_cfg).to(device)
    mesh = None
    if cfg["mesh"] is not None:
        mesh = init_device_mesh(device.type, tuple(cfg["mesh"]), mesh_dim_names=MESH_DIMS)
    policy: GTPPolicy = resolve_policy(cfg["policy"])
    GTPWrap(model, policy, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(t))
    data = TokenStream(DataConfig(**cfg["data"]), t["seq"], model_cfg.vocab, cfg["seed"])

    history: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    start = 0
    ckpt_root = out / "checkpoints"
    if cfg["resume"] and (found := checkpoint.latest(ckpt_root)) is not None:
        extra = checkpoint.load(found, model, optim)
        start, history = extra["step"], extra["history"]
        sched.load_state_dict(extra["scheduler"])

    def evaluate(step: int) -> float:
        model.eval()
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for i in range(t["eval_batches"]):
                x, y = (z.to(device) for z in data.batch("val", 0, rank, i, t["batch"]))
                total += F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.train()
        return _mean(total / t["eval_batches"])

    stop = t["steps"] if t["stop_at"] is None else min(t["stop_at"], t["steps"])
    bar = tqdm(total=stop, initial=start, disable=rank != 0, desc="gtp-train", unit="step")
    tokens_per_step = world * t["batch"] * t["seq"] * t["accumulation"]
    for step in range(start, stop):
        began = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(t["accumulation"]):
            x, y = (z.to(device) for z in data.batch("train", step, rank, micro, t["batch"]))
            last = micro == t["accumulation"] - 1
            with contextlib.nullcontext() if last else gtp_wrap.no_sync(model):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / t["accumulation"]
                loss.backward()
            loss_sum += loss.detach()
        if t["grad_clip"]:
            gtp_wrap.clip_grad_norm_(model, t["grad_clip"])
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        loss_value = _mean(loss_sum)
        elapsed = time.perf_counter() - began
        history["step"].append(step + 1)
        history["loss"].append(loss_value)
        bar.set_postfix(
            loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
            step_ms=f"{1e3 * elapsed:.0f}",
        )  # fmt: skip
        bar.update()
        if step == start:  # the summary shows the steady state: chains are recorded by now
            gtp_wrap.reset_stats(model)
        done = step + 1 == stop
        if (t["eval_every"] and (step + 1) % t["eval_every"] == 0) or done:
            history["val_step"].append(step + 1)
            history["val_loss"].append(evaluate(step))
            if rank == 0:
                bar.write(f"step {step + 1}: validation loss {history['val_loss'][-1]:.4f}")
        if (cfg["checkpoint"]["every"] and (step + 1) % cfg["checkpoint"]["every"] == 0) or done:
            extra = {"step": step + 1, "history": history, "scheduler": sched.state_dict()}
            checkpoint.save(ckpt_root, model, optim, extra=extra)
            checkpoint.prune(ckpt_root, cfg["checkpoint"]["keep"])
    bar.close()

    stats = gtp_wrap.stats(model)
    if rank == 0:
        rows = report.memory_rows(model, optim, model_cfg.n_params)
        table = report.summary_table(rows, stats, stop - start - 1)
        print(f"\n{world} ranks, data: {data.source}\n{table}")
        report.plot_losses(history, out / "loss.png")
        report.write_metrics(
            out / "metrics.json",
            {
                "config": cfg,
                "world": world,
                "history": history,
                "memory": [{"what": n, "gtp_bytes": a, "unsharded_bytes": b} for n, a, b in rows],
                "stats": stats,
            },
        )
        print(f"run directory: {out} (loss.png, metrics.json, checkpoints/)")


# The repository's configs/ (the package is installed editable, as the README says).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    plain: Any = OmegaConf.to_container(cfg, resolve=True)
    try:
        _validate(plain)
    except (PolicyError, DataError, LaunchError, ValueError, TypeError) as e:
        print(f"gtp-train: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = HydraConfig.get().runtime.output_dir
    launch(train, plain["nproc"], plain, run_dir, cpu=plain["device"] == "cpu")


if __name__ == "__main__":
    main()
