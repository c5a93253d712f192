"""`gtp-train`: train the reference GPT with GTP on the machine at hand (a Hydra app).

Not under torchrun it starts `nproc` local ranks itself (gloo on CPU, NCCL with one rank per
GPU); under torchrun it uses the ranks torchrun started. Bad input is refused with one message
before any rank starts. Rank 0 logs through `logging` (loggers under `gtp_wrap.app`) as Hydra set
it up: the console and the run directory's train.log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import logging
import logging.config
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import gtp_wrap
from gtp_wrap import GTPPolicy, GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.config.policy import resolve_policy
from gtp_wrap.errors import CheckpointError, PolicyError
from gtp_wrap.mesh import MESH_LAYOUTS, dense_mesh, make_expert_mesh
from gtp_wrap.optim import Muon, muon_param_groups

from ..io import checkpoint
from . import report
from .data import DataConfig, DataError, TokenStream
from .launch import (
    LaunchError,
    RankStoppedError,
    check_local_devices,
    launch,
    under_torchrun,
)
from .model import GPT, GPTConfig

# The built-in configs: the repository's configs/, shipped in the package as gtp_wrap.configs
# (setup.cfg maps it), so an editable install sees edits to configs/ and a wheel carries a copy.
CONFIG_DIR = str(importlib.resources.files("gtp_wrap.configs"))

log = logging.getLogger("gtp_wrap.app.train")
# The per-step lines: on a terminal the progress bar shows them, so they go to the log file only.
progress = logging.getLogger("gtp_wrap.app.progress")

# The longest run-directory name suffix kept as it is; file systems allow 255 bytes per name.
_MAX_SUFFIX = 160


def _run_suffix(override_dirname: str) -> str:
    """`,key=value,...` from Hydra's override_dirname ('' when there is none), for out_dir.

    A path's slashes become %2F so the name stays one directory; a suffix too long for a file
    name is cut and ends in a hash of the whole, so different overrides still differ.
    """
    if not override_dirname:
        return ""
    suffix = "," + override_dirname.replace("/", "%2F")
    if len(suffix) > _MAX_SUFFIX:
        digest = hashlib.sha256(suffix.encode()).hexdigest()[:16]
        suffix = f"{suffix[: _MAX_SUFFIX - 17]}-{digest}"
    return suffix


OmegaConf.register_new_resolver("gtp_run_suffix", _run_suffix, replace=True)


def _checkpoints(run_dir: str) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def _validate(cfg: dict, run_dir: str) -> None:
    """Everything a user can get wrong, checked before any rank starts."""
    policy = resolve_policy(cfg["policy"])
    _model_config(cfg["model"])
    init = cfg["model"].get("init", "auto")
    if init not in ("auto", "meta", "full"):
        raise LaunchError(f"model.init={init!r}: use auto, meta or full")
    if init == "meta" and _beside_tp(cfg, policy):
        raise LaunchError(
            "model.init=meta with tensor parallelism is not supported yet: use model.init=full"
        )
    if cfg["init_from"] is not None and not os.path.exists(cfg["init_from"]):
        raise LaunchError(
            f"init_from={cfg['init_from']!r} does not exist: give a .safetensors file, an HF "
            "model.safetensors.index.json, a directory holding one, or a checkpoint folder"
        )
    if cfg["device"] not in ("auto", "cpu"):
        raise LaunchError(f"device={cfg['device']!r}: use auto (GPUs where present) or cpu")
    on_cpu = cfg["device"] == "cpu" or not torch.cuda.is_available()
    if policy.collectives == "copy_engine" and on_cpu:
        raise LaunchError(
            "policy collectives=copy_engine moves data between GPUs; on CPU ranks use "
            "collectives=process_group"
        )
    opt = cfg["optimizer"]
    if opt.get("name") not in ("adamw", "muon"):
        raise LaunchError(
            f"optimizer.name={opt.get('name')!r}: use optimizer=adamw or optimizer=muon"
        )
    if opt["name"] == "muon":
        try:  # its own checks of lr, momentum, ns_steps and adjust_lr_fn
            Muon([torch.zeros(2, 2)], lr=opt["lr"], momentum=opt["momentum"],
                 ns_steps=opt["ns_steps"], adjust_lr_fn=opt["adjust_lr_fn"])  # fmt: skip
        except ValueError as e:
            raise LaunchError(f"optimizer=muon: {e}") from e
    t = cfg["trainer"]
    for key in ("steps", "batch", "seq", "accumulation", "eval_batches"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise LaunchError(f"trainer.{key}={t[key]!r}: must be a whole number >= 1")
    for key in ("lr", "min_lr", "weight_decay", "grad_clip"):
        value = t[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value)) or value < 0 or (key == "lr" and value == 0):
            bound = "> 0" if key == "lr" else ">= 0"
            raise LaunchError(f"trainer.{key}={value!r}: must be a finite number {bound}")
    if t["min_lr"] > t["lr"]:
        raise LaunchError(f"trainer.min_lr={t['min_lr']} exceeds trainer.lr={t['lr']}")
    if not isinstance(t["warmup"], int) or isinstance(t["warmup"], bool) or t["warmup"] < 0:
        raise LaunchError(f"trainer.warmup={t['warmup']!r}: must be a whole number >= 0")
    if t.get("on_nonfinite") not in ("raise", "skip"):
        raise LaunchError(f"trainer.on_nonfinite={t.get('on_nonfinite')!r}: use raise or skip")
    for key in ("compile", "gather_per_block", "backward_on_calling_thread"):
        if not isinstance(t[key], bool):
            raise LaunchError(f"trainer.{key}={t[key]!r}: must be true or false")
    if not isinstance(t["log_every"], int) or t["log_every"] < 0:
        raise LaunchError(f"trainer.log_every={t['log_every']!r}: must be a whole number >= 0")
    for key in ("every", "keep"):
        value = cfg["checkpoint"][key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise LaunchError(f"checkpoint.{key}={value!r}: must be a whole number >= 0")
    if t["seq"] > cfg["model"]["max_seq"]:
        raise LaunchError(f"trainer.seq={t['seq']} exceeds model.max_seq={cfg['model']['max_seq']}")
    if not 0 < cfg["data"]["val_fraction"] < 1:
        raise LaunchError(
            f"data.val_fraction={cfg['data']['val_fraction']}: must be between 0 and 1 (exclusive)"
        )
    # The splits and the token ids against the vocab, as every rank will check them.
    TokenStream(DataConfig(**cfg["data"]), t["seq"], cfg["model"]["vocab"], cfg["seed"])
    if cfg.get("mesh_layout", "gtp_inner") not in MESH_LAYOUTS:
        raise LaunchError(f"mesh_layout={cfg['mesh_layout']!r}: use gtp_inner or gtp_outer")
    if cfg.get("mesh_layout") == "gtp_outer" and cfg["mesh"] is None:
        raise LaunchError(
            "mesh_layout=gtp_outer lays out a mesh of dp and gtp: give mesh=[dp, gtp] too (without "
            "it every rank is in the one gtp group)"
        )
    if cfg["mesh"] is not None and len(cfg["mesh"]) not in (2, 3):
        raise LaunchError(f"mesh={cfg['mesh']}: give two sizes, [dp, gtp], or three, [dp, gtp, tp]")
    if cfg["mesh"] is not None and not all(isinstance(n, int) and n >= 1 for n in cfg["mesh"]):
        raise LaunchError(f"mesh={cfg['mesh']}: every size must be a whole number >= 1")
    tp = _tp_size(cfg["mesh"])
    if tp > 1 and not any(rule.tp for rule in policy.rules):
        raise LaunchError(
            f"mesh={cfg['mesh']} has tp={tp}, but the policy has no tp rules: its tp ranks "
            "would compute the same thing twice; use policy=tp (or your own with tp rules)"
        )
    if cfg["model"]["heads"] % tp:
        raise LaunchError(
            f"mesh={cfg['mesh']}: tp={tp} does not divide model.heads={cfg['model']['heads']}; "
            "tensor parallelism gives each tp rank whole attention heads"
        )
    experts = cfg.get("expert_mesh")
    if experts is not None and (
        len(experts) != 2 or not all(isinstance(n, int) and n >= 1 for n in experts)
    ):
        raise LaunchError(f"expert_mesh={experts}: give two whole numbers >= 1, [ep, egtp]")
    if experts is not None and tp > 1:
        raise LaunchError(
            f"expert_mesh={experts} with mesh={cfg['mesh']}: experts beside tensor parallelism "
            "are not supported yet; leave tp out of the mesh"
        )
    if under_torchrun():  # checked on every rank before any collective: none waits for another
        world = int(os.environ["WORLD_SIZE"])
        started = f"the {world} ranks torchrun started (nnodes x nproc_per_node)"
    else:
        check_local_devices(cfg["nproc"], cpu=cfg["device"] == "cpu")
        world = cfg["nproc"]
        started = f"nproc={world}"
    if cfg["mesh"] is not None and math.prod(cfg["mesh"]) != world:
        raise LaunchError(f"mesh={cfg['mesh']} does not multiply to {started}")
    if experts is not None and world % math.prod(experts):
        raise LaunchError(f"expert_mesh={experts}: ep x egtp must divide {started}")
    if not cfg["resume"] and (found := checkpoint.latest(_checkpoints(run_dir))) is not None:
        raise LaunchError(
            f"{run_dir} already holds checkpoints ({found.name}) that a fresh run would "
            "overwrite; continue that run with resume=true, or start a new one elsewhere with "
            "out_dir=<another directory>"
        )


def _lr_lambda(t: dict):
    def factor(step: int) -> float:
        if step < t["warmup"]:
            return (step + 1) / t["warmup"]
        progress = (step - t["warmup"]) / max(1, t["steps"] - t["warmup"])
        floor = t["min_lr"] / t["lr"]
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _model_config(model: dict) -> GPTConfig:
    """The model group's GPTConfig (its `init` says how it is built, not what it is)."""
    return GPTConfig(**{k: v for k, v in model.items() if k != "init"})


def _on_meta(cfg: dict, policy: GTPPolicy) -> bool:
    """Whether the model is built on the meta device and initialized by GTPWrap (model.init:
    meta, or auto where that is supported: not beside tensor parallelism)."""
    init = cfg["model"].get("init", "auto")
    return init == "meta" or (init == "auto" and not _beside_tp(cfg, policy))


def _beside_tp(cfg: dict, policy: GTPPolicy) -> bool:
    """Whether the run uses tensor parallelism (a tp dim, or the policy's tp rules)."""
    return _tp_size(cfg["mesh"]) > 1 or any(rule.tp for rule in policy.rules)


def _optimizer(model: torch.nn.Module, opt: dict, t: dict) -> torch.optim.Optimizer:
    """The `optimizer` group's choice: AdamW, or Muon with AdamW for the rest (trainer.lr)."""
    if opt["name"] == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    groups = muon_param_groups(model, adamw=opt["adamw"], lr=opt["lr"])
    groups[1].update(lr=t["lr"], weight_decay=t["weight_decay"])
    return Muon(
        groups,
        weight_decay=t["weight_decay"],
        momentum=opt["momentum"],
        nesterov=opt["nesterov"],
        ns_steps=opt["ns_steps"],
        adjust_lr_fn=opt["adjust_lr_fn"],
    )


def _tp_size(mesh: Any) -> int:
    """The tp size of a `mesh` setting ([dp, gtp] or [dp, gtp, tp]; null: no tp)."""
    return int(mesh[2]) if mesh is not None and len(mesh) == 3 else 1


def _mean(value: torch.Tensor) -> float:
    dist.all_reduce(value, op=dist.ReduceOp.AVG if value.is_cuda else dist.ReduceOp.SUM)
    return value.item() / (1 if value.is_cuda else dist.get_world_size())


@contextlib.contextmanager
def _progress_bar(show: bool, total: int, initial: int) -> Iterator[tqdm]:
    """The progress bar, shown only if `show` (rank 0, stderr a terminal).

    While it shows, console log records are printed above it, and the per-step lines go to the
    log files only. Without it (stderr a pipe or a file, where each refresh of a bar would be a
    line), the per-step lines on the console are the progress.
    """
    if not show:
        yield tqdm(disable=True)
        return
    progress.handlers = [
        h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
    ]
    progress.propagate = False
    try:
        with (
            logging_redirect_tqdm(),
            tqdm(total=total, initial=initial, desc="gtp-train", unit="step") as bar,
        ):
            yield bar
    finally:
        progress.handlers, progress.propagate = [], True


def _log_layout(model: torch.nn.Module, rank: int) -> None:
    """Rank 0 logs the meshes the engine trains on (dense and expert), with every rank's host
    (a collective)."""
    engine = engine_of(model)
    if engine.mesh.device_mesh is None:
        return
    per_rank = engine.agreement.exchange(
        "hosts", list(socket.gethostname().encode()), "the exchange of the ranks' host names"
    )
    if rank == 0:
        hosts = [bytes(name).decode(errors="replace") for name in per_rank]
        meshes = [engine.mesh.device_mesh, engine.mesh.expert_mesh]
        log.info("%s", report.mesh_layout([m for m in meshes if m is not None], hosts))


def train(device: torch.device, cfg: dict, run_dir: str, job_logging: dict) -> None:
    """One rank's training loop. `job_logging` is Hydra's logging config of the launch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not logging.getLogger().handlers:
        # A rank that `launch` started has no logging set up (under torchrun Hydra has set up
        # each process): log as the launching process does, to the console and train.log.
        logging.config.dictConfig(job_logging)
    out, t = Path(run_dir), cfg["trainer"]
    torch.manual_seed(cfg["seed"])
    model_cfg = _model_config(cfg["model"])
    mesh = None
    if cfg["mesh"] is not None:
        dp, gtp, tp = (*cfg["mesh"], 1)[:3]
        mesh = dense_mesh(dp, gtp, tp, device.type, cfg.get("mesh_layout", "gtp_inner"))
    # The ranks of one tp group (innermost, consecutive) read the same batch.
    data_rank = rank // _tp_size(cfg["mesh"])
    expert_mesh = None
    if cfg.get("expert_mesh") is not None:
        ep, egtp = cfg["expert_mesh"]
        expert_mesh = make_expert_mesh(ep, egtp, device.type)
    # Every step's gradients are checked: a non-finite one raises (naming the weight) or skips.
    policy = dataclasses.replace(resolve_policy(cfg["policy"]), check_finite=True)
    if _on_meta(cfg, policy):  # only this rank's part is ever allocated, then initialized
        with torch.device("meta"):
            model = GPT(model_cfg)
        GTPWrap(model, policy, mesh=mesh, expert_mesh=expert_mesh, device=device)
    else:  # built where the meta build initializes: the same generator, the same weights
        with torch.device(device):
            model = GPT(model_cfg)
        GTPWrap(model, policy, mesh=mesh, expert_mesh=expert_mesh)
    if cfg["init_from"] is not None and checkpoint.is_checkpoint(cfg["init_from"]):
        # Its weights only: the run starts at step 0, with this run's seed's random state (a
        # load would restore the saved run's).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            checkpoint.load(cfg["init_from"], model)
    elif cfg["init_from"] is not None:
        gtp_wrap.load_pretrained(model, cfg["init_from"])
    # The GPT's blocks by name: the default choice takes only blocks holding a sharded weight,
    # and a policy may leave every block whole (replicate_all, a model under min_shard_numel).
    if t["compile"]:
        gtp_wrap.compile(model, blocks=model.blocks)  # GTP's gathers between compiled blocks
    elif t["gather_per_block"] and not policy.fp8_matmul:  # FP8 GEMMs need per-use gathers
        gtp_wrap.gather_per_block(model, blocks=model.blocks)  # eager, on gathered weights
    _log_layout(model, rank)
    if rank == 0:
        log.info("what the policy did (gtp_wrap.describe):\n%s", gtp_wrap.describe(model))
    optim = _optimizer(model, cfg["optimizer"], t)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(t))
    data = TokenStream(DataConfig(**cfg["data"]), t["seq"], model_cfg.vocab, cfg["seed"])

    history: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    start = 0
    ckpt_root = _checkpoints(run_dir)
    data_ranks = world // _tp_size(cfg["mesh"])
    configured = _settings(optim)
    if cfg["resume"] and (resumed := _resume(ckpt_root, model, optim)) is not None:
        found, extra = resumed
        start, history = extra["step"], extra["history"]
        _resume_settings(sched, configured, extra["scheduler"], start)
        if rank == 0:
            log.info("resumed from %s (step %d)", found, start)
            saved_ranks = extra.get("data_ranks", data_ranks)
            if saved_ranks != data_ranks:
                total = t["batch"] * saved_ranks
                keep = (f"trainer.batch={total // data_ranks} keeps it" if total % data_ranks == 0
                        else "no whole trainer.batch keeps it")  # fmt: skip
                log.warning(
                    "resumed on %d data rank(s), where %s was saved on %d: trainer.batch is per "
                    "rank, so a step now takes %d sequences instead of %d (%s), and the steps "
                    "differ from the run's own", data_ranks, found.name, saved_ranks,
                    t["batch"] * data_ranks, total, keep,
                )  # fmt: skip
    elif cfg["resume"] and rank == 0:  # a requeued job's first attempt, or a renamed run
        log.warning(
            "resume=true, but %s holds no checkpoint: starting at step 0. The run directory "
            "is named by the overrides that change training (a new trainer.steps names a new "
            "one); out_dir=<its directory> continues an earlier run",
            ckpt_root,
        )

    def evaluate(step: int) -> float:
        model.eval()
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for i in range(t["eval_batches"]):
                x, y = (z.to(device) for z in data.batch("val", 0, data_rank, i, t["batch"]))
                total += F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.train()
        return _mean(total / t["eval_batches"])

    # Routed token slots per MoE block and expert over this invocation's steps.
    expert_tokens = torch.zeros(model.tokens_per_expert().shape, dtype=torch.long, device=device)
    stop = t["steps"] if t["stop_at"] is None else min(t["stop_at"], t["steps"])
    tokens_per_step = world // _tp_size(cfg["mesh"]) * t["batch"] * t["seq"] * t["accumulation"]
    # Torch keeps the setting per thread: this one's, which calls every backward of the loop.
    threads = torch.autograd.set_multithreading_enabled(not t["backward_on_calling_thread"])
    with _progress_bar(rank == 0 and sys.stderr.isatty(), stop, start) as bar, threads:
        # A CPU backward runs on the calling thread whatever the setting: CPU has no device thread.
        on_device = device.type != "cpu" and torch.autograd.is_multithreading_enabled()
        backward_thread = "device" if on_device else "calling"
        for step in range(start, stop):
            began = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(t["accumulation"]):
                x, y = data.batch("train", step, data_rank, micro, t["batch"])
                x, y = x.to(device), y.to(device)
                last = micro == t["accumulation"] - 1
                with contextlib.nullcontext() if last else gtp_wrap.no_sync(model):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / t["accumulation"]
                    # The MoE blocks' load-balancing loss trains the routers (zero when dense).
                    (loss + model.aux_loss().to(device) / t["accumulation"]).backward()
                loss_sum += loss.detach()
                if model_cfg.experts:
                    expert_tokens += model.tokens_per_expert()
            bad = gtp_wrap.nonfinite_grads(model) if t["on_nonfinite"] == "skip" else []
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                log.warning("step %d skipped: the gradient of '%s'%s is not finite",
                            step + 1, bad[0], more)  # fmt: skip
            else:
                if t["grad_clip"]:
                    gtp_wrap.clip_grad_norm_(model, t["grad_clip"])
                optim.step()  # with on_nonfinite: raise, a NonFiniteError names the weight
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
            if rank == 0 and t["log_every"] and (step + 1) % t["log_every"] == 0:
                progress.info(
                    "step %d/%d: loss %.3f, %s tok/s, %.0f ms/step", step + 1, t["steps"],
                    loss_value, f"{tokens_per_step / elapsed:,.0f}", 1e3 * elapsed,
                )  # fmt: skip
            if step == start:  # the summary shows the steady state: chains are recorded by now
                gtp_wrap.reset_stats(model)
            done = step + 1 == stop
            if (t["eval_every"] and (step + 1) % t["eval_every"] == 0) or done:
                history["val_step"].append(step + 1)
                history["val_loss"].append(evaluate(step))
                if rank == 0:
                    log.info("step %d: validation loss %.4f", step + 1, history["val_loss"][-1])
            every = cfg["checkpoint"]["every"]
            if (every and (step + 1) % every == 0) or done:
                extra = {"step": step + 1, "history": history, "scheduler": sched.state_dict(),
                         "data_ranks": data_ranks}  # fmt: skip
                checkpoint.save(ckpt_root, model, optim, step=step + 1, extra=extra)
                checkpoint.prune(ckpt_root, cfg["checkpoint"]["keep"])

    stats = gtp_wrap.stats(model)
    if model_cfg.experts:  # every data rank's tokens (a tp group's ranks route the same ones)
        dist.all_reduce(expert_tokens)
        expert_tokens //= _tp_size(cfg["mesh"])
        if rank == 0:
            log.info("routed token slots per expert:\n%s", report.expert_table(expert_tokens))
    if rank == 0:
        rows = report.memory_rows(model, optim, model_cfg.n_params)
        table = report.summary_table(rows, stats, stop - start - 1)
        log.info("%d ranks, data: %s\n%s", world, data.source, table)
        report.plot_losses(history, out / "loss.png")
        report.write_metrics(
            out / "metrics.json",
            {
                "config": cfg,
                "world": world,
                "history": history,
                "memory": [{"what": n, "gtp_bytes": a, "unsharded_bytes": b} for n, a, b in rows],
                "stats": stats,
                "tokens_per_expert": expert_tokens.tolist(),
                "backward_thread": backward_thread,  # where the loop's backward ran
            },
        )
        log.info("run directory: %s (train.log, loss.png, metrics.json, checkpoints/)", out)


def _settings(optim: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's hyperparameters per param group, but its learning rates (the schedule's)."""
    skip = ("params", "lr", "initial_lr")
    return [{k: v for k, v in g.items() if k not in skip} for g in optim.param_groups]


def _resume_settings(
    sched: torch.optim.lr_scheduler.LambdaLR, configured: list[dict], saved: dict, step: int
) -> None:
    """After a resume, the hyperparameters of this run's config over the checkpoint's.

    [Note: settings changed on resume] A load restores the optimizer's hyperparameters and the
    scheduler's peak rates as saved, so a resume with another trainer.lr, optimizer.lr or
    trainer.weight_decay would silently train on with the old ones. Where the config differs
    from the checkpoint, the config's are taken, and the change logged: the schedule goes on
    from `step` at the new peak rates. With the same config nothing changes.
    """
    optim = sched.optimizer
    peaks = list(sched.base_lrs)  # this run's, before the saved state replaces them
    sched.load_state_dict(saved)
    speaks = dist.get_rank() == 0  # every rank takes the new settings, rank 0 logs them
    if sched.base_lrs != peaks:
        if speaks:
            log.warning(
                "peak learning rate(s) %s differ from the checkpoint's %s: the schedule goes on "
                "from step %d at the new ones", peaks, sched.base_lrs, step,
            )  # fmt: skip
        sched.base_lrs = peaks
        for group, base, f in zip(optim.param_groups, peaks, sched.lr_lambdas):
            group["initial_lr"], group["lr"] = base, base * f(sched.last_epoch)
    if _settings(optim) != configured:
        if speaks:
            log.warning(
                "optimizer settings %s differ from the checkpoint's %s: taking the new ones",
                configured, _settings(optim),
            )  # fmt: skip
        for group, settings in zip(optim.param_groups, configured):
            group.update(settings)


def _resume(
    root: Path, model: torch.nn.Module, optim: torch.optim.Optimizer
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint under `root` that loads intact on every rank; its folder and
    the `extra` it was saved with (None: there is none). A collective: every rank calls it.

    [Note: resume past a damaged checkpoint] A load checks what it reads (the files' checksums,
    keys and shapes) and fails on every rank where any rank found damage (see [Note: a load
    fails on every rank], io/checkpoint.py), so all ranks fall back to the checkpoint before it
    together: a flipped byte on disk costs the steps since that one, not the run. The older load
    overwrites all the failed one filled in (weights, optimizer state and hyperparameters, RNG
    states). Every failure is logged with its CheckpointError; with no intact checkpoint left,
    the newest one's error is raised.
    """
    first: CheckpointError | None = None
    for ckpt in reversed(checkpoint.checkpoints(root)):
        try:
            return ckpt, checkpoint.load(ckpt, model, optim)
        except CheckpointError as error:  # on ranks > 0, logging's last resort prints it
            first = first or error
            log.warning("rank %d cannot resume from %s: CheckpointError: %s; trying the "
                        "checkpoint before it", dist.get_rank(), ckpt, error)  # fmt: skip
    if first is not None:
        raise CheckpointError(
            f"{first}. resume=true continues the run saved in {root} with the model, policy and "
            "optimizer it was saved with; to train another one, start a new run with "
            "out_dir=<another directory> (init_from=<a checkpoint folder> starts it from these "
            "weights)"
        ) from first
    return None


def _refuse(error: Exception) -> NoReturn:
    """Bad input: one line on stderr, exit status 2, nothing started."""
    print(f"gtp-train: {error}", file=sys.stderr)
    sys.exit(2)


def _run(cfg: DictConfig) -> None:
    """The Hydra task: validate the composed config, then start the ranks."""
    plain: Any = OmegaConf.to_container(cfg, resolve=True)
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    try:
        _validate(plain, run_dir)
    except (PolicyError, DataError, LaunchError, ValueError, TypeError) as e:
        _refuse(e)
    job_logging: Any = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)
    try:
        launch(train, plain["nproc"], plain, run_dir, job_logging, cpu=plain["device"] == "cpu")
    except RankStoppedError:  # the rank printed its error (see [Note: a rank's own errors])
        sys.exit(1)


_hydra_main: Callable[[], None] = hydra.main(
    config_path=CONFIG_DIR, config_name="train", version_base="1.3"
)(_run)

# Config groups whose choice may be given as a YAML file's path.
_FILE_GROUPS = ("policy", "model")


def _file_choices(args: list[str], search_dir: Path) -> list[str]:
    """The command-line overrides with `policy=<file>` / `model=<file>` made Hydra choices.

    Hydra's config groups take names only. A path (an existing file, or a name ending in .yaml
    or .yml) is linked as `<search_dir>/<group>/<stem>.yaml` and chosen by its stem, with
    `search_dir` added to Hydra's search path: the file's own defaults list (e.g.
    `[default, _self_]`) still finds the built-in configs of its group.
    """
    out, linked = [], False
    for arg in args:
        group, sep, value = arg.partition("=")
        if group not in _FILE_GROUPS or not sep:
            out.append(arg)
            continue
        file = Path(value).expanduser()
        if not (file.is_file() or file.suffix in (".yaml", ".yml")):
            out.append(arg)
            continue
        if not file.is_file():
            raise LaunchError(
                f"{arg}: no such file; give an existing YAML file or a built-in {group} name "
                f"from {Path(CONFIG_DIR) / group}"
            )
        builtin = Path(CONFIG_DIR) / group / f"{file.stem}.yaml"
        if builtin.is_file() and not builtin.samefile(file):
            # Hydra's search path puts the built-in configs first: the file would be ignored.
            raise LaunchError(
                f"{arg}: {file.name} has the name of the built-in {builtin}, which Hydra would "
                f"take instead; rename the file (e.g. my_{file.stem}.yaml)"
            )
        if not builtin.is_file():
            (search_dir / group).mkdir(exist_ok=True)
            (search_dir / group / f"{file.stem}.yaml").symlink_to(file.resolve())
            linked = True
        out.append(f"{group}={file.stem}")
    if linked:
        out.append(f"hydra.searchpath=['file://{search_dir}']")
    return out


def main() -> None:
    """The `gtp-train` command: file paths for config groups turned into choices, then Hydra."""
    with tempfile.TemporaryDirectory(prefix="gtp-train-") as search_dir:
        try:
            sys.argv[1:] = _file_choices(sys.argv[1:], Path(search_dir))
        except LaunchError as e:
            _refuse(e)
        _hydra_main()


if __name__ == "__main__":
    main()
