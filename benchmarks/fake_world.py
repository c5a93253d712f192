"""A faked world of N ranks on one device, for the benchmarks that measure the host side of an
N-GPU step with one GPU (step_phases.py, host_overhead.py, calibrate.py).

[Note: a faked world] The ranks join torch's "fake" process-group backend: every collective
returns at once and moves nothing, so the engine's whole path for N ranks runs (gathers issued
and waited for, saved weights rematerialized, gradients reduce-scattered) without a second GPU.
A faked collective takes no device time and its buffers hold whatever they held (losses mean
nothing); what a real step spends moving bytes is left out: at 125M, batch 1, on NVLink, about 1
ms of gathers and 1.5 ms of fp32 reduce-scatters a step at 300 GB/s, beside a host-bound step of
20-30 ms. The engine's host path is the real one: the same calls, the same waits (on NCCL a wait
is a stream wait, as here a no-op), the same buffers and saved-tensor hooks. The process group's
own host work per collective is not: NCCL's kernel launch, its events and the bookkeeping of its
watchdog are missing, so a faked world reads the host time of N ranks low by that much per
collective (a group's weights share one). Rank 0 measures, on the GPU where there is one; the
peers hide the GPU and run on CPU whatever the engine asks of them (the agreement checks at wrap
and when a chain is recorded go through the store), then wait until rank 0 is done.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gtp_wrap.app.launch import _free_port


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run `fn(rank, device, *args)` on `world` spawned ranks of a faked world: rank 0 on the
    GPU (CPU where there is none), the others on CPU. `fn` is a module-level function (it is
    pickled into the ranks)."""
    mp.start_processes(_rank, args=(world, _free_port(), fn, args), nprocs=world,
                       start_method="spawn")  # fmt: skip


def _rank(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    if rank:  # the peers leave the GPU to rank 0's measurement
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(hours=2))  # fmt: skip
    dist.init_process_group("fake", rank=rank, world_size=world, store=store)
    torch.set_flush_denormal(True)  # faked buffers may hold denormals, slow on CPU
    try:
        cuda = rank == 0 and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)
        fn(rank, torch.device("cuda", 0) if cuda else torch.device("cpu"), *args)
        if rank == 0:
            store.set("fake_world/done", "1")
            # Rank 0 holds the store: it leaves once every peer has read that it is done.
            store.wait([f"fake_world/left/{peer}" for peer in range(1, world)])
        else:
            store.wait(["fake_world/done"])
            store.set(f"fake_world/left/{rank}", "1")
    finally:
        gc.collect()  # a wrapped model holds the group (see gtp_wrap.app.launch)
        dist.destroy_process_group()
