"""Parity: GTP training equals unsharded training on the concatenation of all ranks' batches.

Every case trains a few AdamW steps on a global batch of 8 samples split evenly over the data
ranks, and compares parameters, losses, eval outputs and grad norms with a single-process
reference trained on the whole batch. All cases of one mesh run in one spawn (cached), so the
suite spawns each mesh once.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist
from harness import cached_ranks, mesh_2d
from parity_cases import (
    CASES,
    MESHES,
    model_of,
    train_case,
)

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of


def _mesh(kind: str):
    if kind == "2x2":
        return mesh_2d(2, 2)
    return None


def _all_cases(rank: int, world: int, mesh_kind: str) -> dict:
    mesh = _mesh(mesh_kind)
    results = {}
    for name, case in CASES.items():
        try:
            model = GTPWrap(model_of(case), case.policy, mesh=mesh)
            res = train_case(case, model, rank, world, wrapped=True)
            losses = torch.tensor(res["losses"])
            dist.all_reduce(losses)
            res["losses"] = (losses / world).tolist()
            res["params"] = gtp_wrap.full_state_dict(model)
            res["stats"] = {k: v for k, v in gtp_wrap.stats(model).items() if isinstance(v, int)}
            results[name] = res
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def _results(mesh_kind: str) -> list[dict]:
    return cached_ranks(_all_cases, MESHES[mesh_kind], mesh_kind, timeout=400)


@functools.cache
def _reference(name: str, data_ranks: int) -> dict:
    case = CASES[name]
    model = model_of(case)
    summed = case.policy.get("loss_reduction") == "sum"
    res = train_case(case, model, 0, 1, wrapped=False, loss_scale=data_ranks if summed else 1.0)
    res["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("name", list(CASES))
def test_parity(mesh_kind: str, name: str) -> None:
    ref = _reference(name, MESHES[mesh_kind])
    for rank, per_case in enumerate(_results(mesh_kind)):
        got = per_case[name]
        assert "error" not in got, f"rank {rank} failed:\n{got.get('error')}"
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert got["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
        for a, b in zip(got["evals"], ref["evals"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-6)
        if MESHES[mesh_kind] > 1 and mesh_kind != "1":
            assert got["stats"]["gathers"] > 0, "nothing was sharded"


def _dp_order(rank: int, world: int) -> list[str]:
    """The order in which a dp x gtp backward issues and waits its collectives, one weight per
    group: 'rs' a reduce-scatter issued, 'ar' a dp all-reduce issued, 'land' one waited."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(3)))
    GTPWrap(model, {"min_shard_numel": 0, "group_numel": 0}, mesh=mesh_2d(2, 2))
    comm = engine_of(model).comm
    events: list[str] = []
    averaging: set[int] = set()
    reduce_scatter, all_reduce, wait = comm.reduce_scatter, comm.all_reduce, comm.wait

    def spy_rs(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("rs")
        return reduce_scatter(*args, **kwargs)

    def spy_ar(t, axis, *args, **kwargs):  # type: ignore[no-untyped-def]
        pending = all_reduce(t, axis, *args, **kwargs)
        if axis.name == "dp":
            events.append("ar")
            averaging.add(id(pending))
        return pending

    def spy_wait(pending, *args, **kwargs):  # type: ignore[no-untyped-def]
        if id(pending) in averaging:
            events.append("land")
        return wait(pending, *args, **kwargs)

    comm.reduce_scatter, comm.all_reduce, comm.wait = spy_rs, spy_ar, spy_wait
    model(torch.randn(2, 8)).sum().backward()
    return events


def test_dp_all_reduce_runs_under_the_next_groups_reduce_scatter() -> None:
    """A group's dp all-reduce is issued when its reduce-scatter completes and waited for only
    when the next group is finalized (or backward ends), not at once."""
    for events in cached_ranks(_dp_order, 4):
        assert events == ["rs", "rs", "ar", "rs", "ar", "land", "ar", "land", "land"], events
