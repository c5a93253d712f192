"""State dicts: DTensors of the logical shape, full exports that load into the plain model."""

from __future__ import annotations

import pytest
import torch
from harness import caught, run_ranks
from models import TinyGPT
from torch.distributed.tensor import DTensor

import gtp_wrap
from gtp_wrap import GTPWrap


def _roundtrip(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    plain = TinyGPT(vocab=47)  # 47 rows over 3 ranks: uneven blocks and padding
    x = torch.randint(0, 47, (2, 8))
    expected = plain(x).detach()
    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(vocab=47), {"min_shard_numel": 0})
    sd = model.state_dict()
    shapes = {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()}
    local_rows = sd["wte.weight"].to_local().shape[0]
    full = gtp_wrap.full_state_dict(model)
    torch.manual_seed(1)
    other = GTPWrap(TinyGPT(vocab=47), {"min_shard_numel": 0})
    gtp_wrap.load_full_state_dict(other, full)
    # A block registered twice (weight sharing across layers) converts once per name.
    shared = torch.nn.Linear(8, 8)
    twice = GTPWrap(torch.nn.ModuleList([shared, shared]), {"min_shard_numel": 0})
    twice_types = {k: type(v).__name__ for k, v in twice.state_dict().items()}
    # A submodule's state dict converts its weights too, and loads back into the submodule.
    block = model.blocks[0].state_dict()
    block_full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in block.items()}
    torch.manual_seed(2)
    third = GTPWrap(TinyGPT(vocab=47), {"min_shard_numel": 0})
    third.blocks[0].load_state_dict(block_full)
    block_reloaded = gtp_wrap.full_state_dict(third)
    try:
        third.load_state_dict(full, assign=True)
        assign = "loaded"
    except gtp_wrap.WrapError as e:
        assign = str(e)
    # assign=True of only replicated entries touches no shard, but the new parameter would be
    # one the engine does not know (its gradient never averaged): refused where registered.
    norm = {"blocks.0.norm1.weight": torch.full((32,), 2.0)}
    try:
        third.load_state_dict(norm, strict=False, assign=True)
        assign_replicated = "loaded"
    except RuntimeError as e:  # torch gathers load errors into a RuntimeError of its own
        assign_replicated = str(e)
    third.load_state_dict(norm, strict=False)  # copied in instead
    return {
        "shapes": shapes,
        "local_rows": local_rows,
        "full": full,
        "expected": expected,
        "reloaded": other(x).detach(),
        "block_types": {k: type(v).__name__ for k, v in block.items()},
        "block_reloaded": block_reloaded,
        "assign": assign,
        "assign_replicated": assign_replicated,
        "assigned_norm": third.blocks[0].norm1.weight.detach().clone(),
        "twice_types": twice_types,
    }


def test_state_dict_dtensors_and_full_export() -> None:
    results = run_ranks(_roundtrip, 3)
    torch.manual_seed(0)
    plain = TinyGPT(vocab=47)
    ref_shapes = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    assert [r["local_rows"] for r in results] == [16, 16, 15]
    for r in results:
        assert {k: s for k, (_, s) in r["shapes"].items()} == ref_shapes
        assert r["shapes"]["wte.weight"][0] == DTensor.__name__
        assert r["shapes"]["blocks.0.norm1.weight"][0] != DTensor.__name__
        plain.load_state_dict(r["full"])  # the unwrapped model accepts the export as is
        torch.testing.assert_close(plain(torch.zeros(1, 1, dtype=torch.long)).shape[-1], 47)
        torch.testing.assert_close(r["reloaded"], r["expected"], rtol=1e-5, atol=1e-6)
        assert r["block_types"]["qkv.weight"] == DTensor.__name__
        assert r["block_types"]["norm1.weight"] != DTensor.__name__
        for k, v in r["full"].items():
            if k.startswith("blocks.0."):
                assert torch.equal(r["block_reloaded"][k], v), k
        assert "assign=True" in r["assign"] and "without assign" in r["assign"], r["assign"]
        assert "'blocks.0.norm1.weight' (registered on a LayerNorm)" in r["assign_replicated"]
        assert "Load without assign=True" in r["assign_replicated"]
        assert torch.equal(r["assigned_norm"], torch.full((32,), 2.0))
        assert r["twice_types"] == {"0.weight": "DTensor", "0.bias": "Tensor",
                                    "1.weight": "DTensor", "1.bias": "Tensor"}  # fmt: skip
    torch.manual_seed(0)
    torch.testing.assert_close(results[0]["full"], TinyGPT(vocab=47).state_dict())


def _dcp_in_place(rank: int, world: int, root: str, shape: tuple[int, int]) -> float:
    """torch.distributed.checkpoint's in-place pattern, on a weight sharded along dim 1."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    policy = {"rules": [{"match": "Linear", "dim": 1}], "min_shard_numel": 0}
    model = GTPWrap(torch.nn.Linear(*shape, bias=False), policy)
    saved = gtp_wrap.full_state_dict(model)["weight"]
    dcp.save(model.state_dict(), checkpoint_id=root)
    with torch.no_grad():
        model.weight.zero_()
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=root)
    model.load_state_dict(sd)
    return (gtp_wrap.full_state_dict(model)["weight"] - saved).abs().max().item()


@pytest.mark.parametrize("shape", [(3, 1), (6, 8)])
def test_dcp_in_place_load_of_dim1_shards(tmp_path, shape: tuple[int, int]) -> None:
    """A (1, 3) weight's local block has other strides along its size-1 dim than its DTensor's
    local tensor: loading must not trip over that overlap."""
    assert run_ranks(_dcp_in_place, 2, str(tmp_path), shape) == [0.0, 0.0]


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    """Whether two optimizers of the same parameters hold equal state, tensor by tensor."""
    return a.state.keys() == b.state.keys() and all(
        a.state[p].keys() == b.state[p].keys()
        and all(torch.equal(a.state[p][k], b.state[p][k]) for k in a.state[p])
        for p in a.state
    )


def _optimizer_state_dicts(rank: int, world: int) -> dict:
    """An optimizer's own state_dict()/load_state_dict() and torch's get_state_dict /
    set_state_dict (sharded and full) on a wrapped model: the state as DTensors of the
    logical shape, back as this rank's rows (see [Note: optimizer state in torch's state
    dicts])."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(vocab=47), {"min_shard_numel": 0})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(step * world + rank)
        model(torch.randint(0, 47, (2, 8), generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    key = [n for n, _ in model.named_parameters()].index("wte.weight")
    entry = sd["state"][key]["exp_avg"]
    # An optimizer that never stepped loads the DTensors as they are, and converts them at its
    # first step; one that stepped converts them on load.
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(sd)
    fresh.step()  # no gradients: nothing changes but the hooks
    stepped = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped.step()
    stepped.load_state_dict(sd)
    full = StateDictOptions(full_state_dict=True)
    _, full_osd = get_state_dict(model, opt, options=full)
    from_full = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_state_dict(model, from_full, model_state_dict={}, optim_state_dict=full_osd,
                   options=StateDictOptions(full_state_dict=True, strict=False))  # fmt: skip
    return {
        "entry": (type(entry).__name__, tuple(entry.shape)),
        "full_entry": tuple(full_osd["state"]["wte.weight"]["exp_avg"].shape),
        "sd_keeps_state": all(isinstance(v["exp_avg"], torch.Tensor) for v in sd["state"].values()),
        **{
            name: _same_state(o, opt)
            for name, o in (("fresh", fresh), ("stepped", stepped), ("from_full", from_full))
        },
        "plain_after_load": all(
            type(v) is torch.Tensor
            for o in (fresh, stepped, from_full)
            for s in o.state.values()
            for v in s.values()
        ),
    }


def test_optimizer_state_dicts_hold_the_logical_state() -> None:
    for r in run_ranks(_optimizer_state_dicts, 2):
        assert r["entry"] == ("DTensor", (47, 32))
        assert r["full_entry"] == (47, 32)
        assert r["fresh"] and r["stepped"] and r["from_full"]
        assert r["plain_after_load"]


class _RowStatistics(torch.optim.Optimizer):
    """SGD that keeps a statistic per row of each weight, as factored optimizers do."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["rows"] = p.grad.square().mean(-1, keepdim=True)
                    p.sub_(p.grad, alpha=group["lr"])


def _state_not_per_element(rank: int, world: int, root: str) -> dict:
    model = GTPWrap(torch.nn.Linear(8, 6, bias=False), {"min_shard_numel": 0})
    opt = _RowStatistics(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    from gtp_wrap import checkpoint

    return {
        "state_dict": caught(opt.state_dict),
        "checkpoint": caught(lambda: checkpoint.save(root, model, opt)),
    }


def test_optimizer_state_that_is_not_per_element_is_refused_when_saved(tmp_path) -> None:
    """A factored statistic of a shard (its rows' mean square here) was saved from rank 0 for
    every rank, and loaded as rank 0's at any world size (found by a new user with Adafactor)."""
    want = (
        "WrapError: the optimizer's 'rows' state of 'weight' has shape (3, 1), not the "
        "parameter's (3, 8): state that is not per element"
    )
    for r in run_ranks(_state_not_per_element, 2, str(tmp_path)):
        assert r["state_dict"].startswith(want), r
        assert r["checkpoint"].startswith("CheckpointError: saving"), r
        assert f"(here: {want}" in r["checkpoint"], r


class _SGDWithOwnState(torch.optim.SGD):
    """SGD that keeps a state entry of its own, under a key that is not a parameter."""

    def step(self, closure=None):  # type: ignore[override]
        self.state["steps_taken"] = self.state.get("steps_taken", 0) + 1
        return super().step(closure)


def _odd_optimizer_states(rank: int, world: int, root: str) -> dict:
    """Shards of one element and of none (weights (3, 1) and (1, 8) over 2 ranks), a full state
    dict loaded before an optimizer's first step, and an optimizer's state under a key of its
    own (found in review: each failed)."""
    from gtp_wrap import checkpoint

    torch.manual_seed(0)
    model = GTPWrap(
        torch.nn.Sequential(torch.nn.Linear(1, 3, bias=False), torch.nn.Linear(3, 8, bias=False),
                            torch.nn.Linear(8, 1, bias=False)),
        {"min_shard_numel": 0},
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 1)).sum().backward()
    opt.step()
    opt.zero_grad()
    types = [type(s["exp_avg"]).__name__ for s in opt.state_dict()["state"].values()]
    checkpoint.save(root, model, opt)
    again = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(root, model, again)
    # Full tensors, as from the unwrapped model's optimizer, loaded before the first step.
    full = opt.state_dict()
    full["state"] = {
        k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in s.items()}
        for k, s in full["state"].items()
    }
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(full)
    fresh.step()  # no gradients: only the hooks
    own = _SGDWithOwnState(model.parameters(), lr=1e-2, momentum=0.9)
    model(torch.ones(2, 1)).sum().backward()
    own.step()
    return {
        "types": types,
        "reloaded": _same_state(again, opt),
        "from_full": _same_state(fresh, opt),
        "own_key": caught(lambda: own.state_dict()["state"]["steps_taken"]),
    }


def test_optimizer_states_of_small_shards_full_loads_and_own_keys(tmp_path) -> None:
    for r in run_ranks(_odd_optimizer_states, 2, str(tmp_path)):
        assert r["types"] == ["DTensor"] * 3, r
        assert r["reloaded"] and r["from_full"], r
        assert r["own_key"] == "no error", r


def _adagrad_after_a_checkpoint_load(rank: int, world: int, root: str) -> list[str]:
    """Adagrad has state from construction, so torch's get_state_dict never steps it: loaded
    through gtp_wrap.checkpoint it has the hooks all the same (found in review: its state
    came out plain, which DCP writes as rank 0's)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gtp_wrap import checkpoint

    model = GTPWrap(torch.nn.Linear(8, 6, bias=False), {"min_shard_numel": 0})
    checkpoint.save(root, model, torch.optim.Adagrad(model.parameters()))
    opt = torch.optim.Adagrad(model.parameters())
    checkpoint.load(root, model, opt)
    _, osd = get_state_dict(model, opt)
    return [type(s["sum"]).__name__ for s in osd["state"].values()]


def test_adagrad_loaded_from_a_checkpoint_gives_dtensors(tmp_path) -> None:
    assert run_ranks(_adagrad_after_a_checkpoint_load, 2, str(tmp_path)) == [["DTensor"]] * 2
