"""The one way tests start ranks, catch per-case errors, cache results and build meshes.

`run_ranks(fn, world)` runs `fn(rank, world, *args)` on `world` new processes joined in one
gloo group (NCCL with `backend="nccl"`, one GPU per rank; torch's fake group with
`backend="fake"`, collectives that move nothing), rendezvousing through a FileStore in
a temp dir so parallel tests never fight over ports, and returns each rank's return value. A
rank that raises fails the test with its traceback; ranks still running at the deadline are
killed and the test fails instead of hanging. `cached_ranks` is the same, run once per
arguments for all the tests that read one spawn's results.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import importlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gtp_wrap.core.weight import ShardedWeight
from gtp_wrap.graphs import release_graphs
from gtp_wrap.mesh import DP_GTP


def _entry(
    rank: int, fn: Callable, world: int, store_dir: str, args: tuple, backend: str, timeout: float
) -> None:
    # A rank still running just before the deadline prints where every thread is stuck.
    faulthandler.dump_traceback_later(max(timeout - 10, 1))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if backend == "fake":  # torch's fake group: every collective returns at once, no data
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers it
        store = dist.FileStore(f"{store_dir}/store", world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(
            backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world
        )
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(store_dir, f"result{rank}.pt"))
        if getattr(fn, "leaves_group_broken", False):
            # A gloo group whose collective timed out or failed can abort in teardown
            # (std::terminate on a worker thread still inside it): the result is saved, so leave.
            os._exit(0)
    finally:
        release_graphs()  # a live CUDA graph keeps NCCL from shutting down
        # A wrapped model is a reference cycle (its engine and parameters) holding the process
        # group; freed only at interpreter exit, a gloo group can abort there (about 1 in 8
        # runs with several collectives in flight per step). Free it while torch is intact.
        gc.collect()
        dist.destroy_process_group()


# [Note: ranks from a fork server] Every rank is a new process with none of the test process's
# state (as with "spawn"), but forked from one server process per test process that has
# imported torch, gtp_wrap and this module once: a spawned rank spent about 2 s of CPU
# importing them, a large share of the suite's time on CI's two cores. The server imports
# nothing that starts threads or touches CUDA, so forking from it is safe. Ranks inherit the
# server's environment, fixed when the first test started ranks: a variable a test sets for its
# ranks goes in their arguments, not in os.environ.
mp.set_forkserver_preload(["torch", "torch.distributed", "gtp_wrap", "harness"])


def run_ranks(
    fn: Callable, world: int, *args: Any, timeout: float = 240.0, backend: str = "gloo"
) -> list[Any]:
    """Each rank's `fn(rank, world, *args)`, from `world` new processes (see [Note: ranks from
    a fork server])."""
    with tempfile.TemporaryDirectory() as store_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world, store_dir, args, backend, timeout),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f}s")
        return [
            torch.load(os.path.join(store_dir, f"result{r}.pt"), weights_only=True)
            for r in range(world)
        ]


@functools.cache
def cached_ranks(
    fn: Callable, world: int, *args: Any, timeout: float = 240.0, backend: str = "gloo"
) -> list[Any]:
    """`run_ranks`, spawned once per arguments: for many tests reading one spawn's results
    (each rank computes every case and returns them keyed by case)."""
    return run_ranks(fn, world, *args, timeout=timeout, backend=backend)


def caught(fn: Callable[[], Any]) -> str:
    """'ErrorName: message' of what `fn()` raised, or 'no error': a per-case error capture, so
    that one spawn can check many error cases."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller asserts on the name and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def mesh_2d(dp: int, gtp: int, device_type: str = "cpu") -> DeviceMesh:
    """A ("dp", "gtp") mesh over the whole world."""
    return init_device_mesh(device_type, (dp, gtp), mesh_dim_names=DP_GTP)


def local_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `full` if `param` is a sharded weight's shard, else `full`: the
    reference a shard's gradient or value is compared with."""
    weight = getattr(param, "gtp_weight", None)
    if type(weight) is ShardedWeight:
        return weight.geometry.local_rows_of(full)
    return full


def slot_bytes(param: torch.Tensor) -> int:
    """Bytes of a sharded weight's slot (its rows plus padding) in the flat storage."""
    weight = param.gtp_weight  # type: ignore[attr-defined]
    return weight.geometry.slot_numel * param.element_size()


def is_sharded(param: torch.Tensor) -> bool:
    return type(getattr(param, "gtp_weight", None)) is ShardedWeight


def optimizer_full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every per-element optimizer state tensor as a full tensor, by FQN and name."""
    from torch.distributed.tensor import DTensor

    from gtp_wrap.io import checkpoint

    out = {}
    for fqn, state in checkpoint.optimizer_state_dict(model, opt).items():
        for k, v in state.items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if isinstance(v, torch.Tensor) and v.dim():
                out[f"{fqn}/{k}"] = v.detach().cpu().clone()
    return out


def expert_gathers_per_pass(model: torch.nn.Module) -> dict[str, list[int]]:
    """By pass kind, the distinct numbers of times each expert stack appears in its chain (one
    gather per stack per pass: [1])."""
    from gtp_wrap.api import engine_of

    engine = engine_of(model)
    name = {w.index: w.fqn for w in engine.weights}
    stacks = {w.fqn for w in engine.weights if ".experts." in w.fqn}
    return {
        str(key[0]): sorted({sum(name[i] == s for i in chain.order) for s in stacks})
        for key, chain in engine.passes.chains.items()
    }
