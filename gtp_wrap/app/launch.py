"""Start ranks: the ones torchrun started (any number of nodes), or `nproc` local ones."""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gtp_wrap.errors import GTPError
from gtp_wrap.graphs import release_graphs


class LaunchError(ValueError):
    """The requested ranks do not fit the machine."""


class RankStoppedError(RuntimeError):
    """A rank stopped on an error of gtp_wrap's own (a `GTPError`: bad input, a damaged
    checkpoint, a peer that failed), which the rank printed as one line (see [Note: a rank's
    own errors])."""


# A spawned rank's exit status after it printed its GTPError.
_REPORTED = 3


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _on_gpus(cpu: bool) -> bool:
    """Whether ranks run one per GPU (NCCL), rather than as CPU processes (gloo)."""
    return torch.cuda.is_available() and not cpu


def check_local_devices(nproc: int, cpu: bool = False) -> None:
    """Refuse more local ranks than the machine has GPUs (or CPU cores, for CPU ranks)."""
    if nproc < 1:
        raise LaunchError(f"nproc={nproc}: start at least one rank")
    if _on_gpus(cpu):
        if nproc > torch.cuda.device_count():
            raise LaunchError(
                f"nproc={nproc} but this machine has {torch.cuda.device_count()} GPU(s); "
                "use nproc <= the GPU count (one rank per GPU)"
            )
    elif nproc > (os.cpu_count() or 1):
        raise LaunchError(
            f"nproc={nproc} but this machine has {os.cpu_count()} CPU core(s); "
            "use nproc <= the core count"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(
    local_rank: int, fn: Callable, world: int, port: int, args: tuple, cpu: bool
) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    # A forked rank inherits the launcher's logging (Hydra's console and train.log handlers);
    # a spawned one starts with none, as gtp-train's ranks expect (rank 0 sets up its own).
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    try:
        run_rank(fn, args, cpu)
    except GTPError as error:
        # [Note: a rank's own errors] An error gtp_wrap raises on purpose names its cause and
        # its fix; torch.multiprocessing would hand it to the launcher as the rank's whole
        # traceback, where the message is the last of some thirty lines (and Hydra adds its own
        # "Error executing job"). The rank prints that one line instead (rank 0 to its run's log
        # too) and exits with a status of its own, which `launch` turns into RankStoppedError.
        # Errors of any other kind (bugs) keep their traceback.
        _report_stop(local_rank, error)
        sys.exit(_REPORTED)


def _report_stop(rank: int, error: BaseException) -> None:
    """Print the error a rank stops on as one line on stderr, and write it to the run's log
    files where this rank keeps any (see [Note: a rank's own errors])."""
    line = f"rank {rank}: {type(error).__name__}: {error}"
    print(line, file=sys.stderr, flush=True)
    record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.root.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_rank(fn: Callable, args: tuple, cpu: bool = False) -> Any:
    """Join the process group from torchrun-style environment variables and run `fn`."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if _on_gpus(cpu):
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return fn(device, *args)
    finally:
        release_graphs()  # a live CUDA graph keeps NCCL from shutting down
        # A wrapped model is a reference cycle holding the process group; left for the
        # interpreter's exit, a gloo group can abort the process there (seen in about 1 in 8
        # CPU runs). Free it first, so the group is destroyed here.
        gc.collect()
        dist.destroy_process_group()


def _start_method() -> str:
    """How `launch` starts its ranks.

    [Note: forked ranks] A spawned rank starts a new interpreter and imports torch and gtp_wrap
    again, about 4 s of a two-rank CPU run's 12 (2 steps, 2 cores): forked, it starts with the
    launcher's imports and the run takes 8 s. Forking is safe where the launcher has started
    no thread and no process group of its own (gtp-train has then checked its config with a
    few tiny tensors at most; calibrate.py's CPU steps run on one thread), as a DataLoader
    forks its workers after importing torch; each rank then sets up its own group, thread
    count and logging (`_rank_entry`). Otherwise the ranks are spawned: on a machine with
    CUDA (a process forked after CUDA was initialized, which torch.cuda.is_available() may
    do, cannot use it), off Linux (macOS forks unsafely), after the launcher joined a
    process group, or while it runs other Python threads.
    """
    forkable = (
        sys.platform == "linux"
        and not torch.cuda.is_available()
        and not dist.is_initialized()
        and threading.active_count() == 1
    )
    return "fork" if forkable else "spawn"


def launch(
    fn: Callable, nproc: int, *args: Any, cpu: bool = False, oversubscribe: bool = False
) -> None:
    """Run `fn(device, *args)` on every rank: in this process under torchrun, else in `nproc`
    new processes. Ranks take one GPU each where there are GPUs, unless `cpu`; `oversubscribe`
    lets CPU ranks outnumber the cores (for counts and memory, whose figures do not depend on
    it). A rank that stops on a GTPError prints it as one line, and `launch` raises
    RankStoppedError (see [Note: a rank's own errors]), under torchrun too."""
    if under_torchrun():  # this process is the rank
        try:
            run_rank(fn, args, cpu)
        except GTPError as error:  # see [Note: a rank's own errors]
            _report_stop(int(os.environ["RANK"]), error)
            raise RankStoppedError("this rank stopped on the error it printed") from None
        return
    if not (cpu and oversubscribe):
        check_local_devices(nproc, cpu)
    start = _start_method()  # see [Note: forked ranks]
    try:
        mp.start_processes(
            _rank_entry, args=(fn, nproc, _free_port(), args, cpu), nprocs=nproc,
            start_method=start,
        )  # fmt: skip
    except mp.ProcessExitedException as error:
        if error.exit_code != _REPORTED:
            raise
        raise RankStoppedError(
            f"rank {error.error_index} stopped on the error it printed"
        ) from None
