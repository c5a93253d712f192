"""Checkpoints: reshard across mesh shapes and into the unwrapped model, atomic saves, exact
continuation, safetensors export, and clear errors on bad input."""

from __future__ import annotations

import shutil
from pathlib import Path
from unittest import mock

import gtp_wrap.checkpoint as ckpt
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from harness import cached_ranks, mesh_2d, run_ranks
from models import TinyGPT
from torch.distributed.tensor import DTensor

import gtp_wrap
from gtp_wrap import CheckpointError, GTPWrap

VOCAB = 47  # uneven rows over 2, 3 and 4 ranks
POLICY = {"min_shard_numel": 0, "collective_timeout_s": 10}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [p for n, p in model.named_parameters() if "blocks.0" in n], "lr": 5e-3},
        {"params": [p for n, p in model.named_parameters() if "blocks.0" not in n]},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


def _step(model, opt, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = (torch.randint(0, VOCAB, (8, 8), generator=g) for _ in range(2))
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _full_optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, state in ckpt.optimizer_state_dict(model, opt).items():
        for k, v in state.items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            out[f"{fqn}/{k}"] = full.detach().cpu().clone()
    return out


def _mesh(kind: str):
    return mesh_2d(2, 2) if kind == "2x2" else None


def _save_side(rank: int, world: int, root: str) -> dict:
    model = GTPWrap(_model(), POLICY)
    opt = _optimizer(model)
    for step in range(2):
        _step(model, opt, step, rank, world)
    ckpt.save(root, model, opt, extra={"step": 2, "data_position": 16})
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp")
    saved = {"params": gtp_wrap.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    for step in range(2, 4):
        _step(model, opt, step, rank, world)
    saved["continued"] = gtp_wrap.full_state_dict(model)
    probe = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    ckpt.export_safetensors(f"{root}/model.safetensors", model)
    saved["probe_out"] = model(probe).detach()
    return saved


def _load_side(rank: int, world: int, root: str, kind: str) -> dict:
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = GTPWrap(TinyGPT(vocab=VOCAB), POLICY, mesh=_mesh(kind))
    opt = _optimizer(model)
    extra = ckpt.load(root, model, opt)
    loaded = {"params": gtp_wrap.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    loaded["extra"] = extra
    loaded["lrs"] = [g["lr"] for g in opt.param_groups]
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=f"{root}/dcp")
    loaded["dcp"] = gtp_wrap.full_state_dict(model)
    for step in range(2, 4):
        _step(model, opt, step, rank, world)
    loaded["continued"] = gtp_wrap.full_state_dict(model)
    return loaded


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_ranks(_save_side, 2, str(root))[0]


def _assert_same(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def _loaded(root: str, world: int, kind: str) -> list[dict]:
    return cached_ranks(_load_side, world, root, kind)


@pytest.mark.parametrize(("world", "kind"), [(1, "1"), (4, "4"), (4, "2x2")])
def test_reshard_to_other_meshes(saved, world: int, kind: str) -> None:
    root, ref = saved
    for got in _loaded(str(root), world, kind):
        _assert_same(got["params"], ref["params"], rtol=0, atol=0)
        _assert_same(got["optim"], ref["optim"], rtol=0, atol=0)
        _assert_same(got["dcp"], ref["params"], rtol=0, atol=0)
        assert got["extra"] == {"step": 2, "data_position": 16}
        assert got["lrs"] == [5e-3, 1e-2]
        # The next steps equal the uninterrupted run's (up to summation order across ranks).
        _assert_same(got["continued"], ref["continued"], rtol=1e-5, atol=1e-6)


def test_load_into_unwrapped_model(saved) -> None:
    root, ref = saved
    torch.manual_seed(5)
    model = TinyGPT(vocab=VOCAB)
    opt = _optimizer(model)
    extra = ckpt.load(root, model, opt)
    assert extra["step"] == 2
    _assert_same(
        {k: v.detach() for k, v in model.state_dict().items()}, ref["params"], rtol=0, atol=0
    )
    _assert_same(_full_optimizer_state(model, opt), ref["optim"], rtol=0, atol=0)
    for step in range(2, 4):
        _step(model, opt, step, 0, 1)
    _assert_same(
        {k: v.detach() for k, v in model.state_dict().items()},
        ref["continued"],
        rtol=1e-5,
        atol=1e-6,
    )


def test_safetensors_export_loads_into_plain_model(saved) -> None:
    root, ref = saved
    plain = TinyGPT(vocab=VOCAB)
    plain.load_state_dict(safetensors.torch.load_file(root / "model.safetensors"))
    probe = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(plain(probe), ref["probe_out"], rtol=0, atol=0)


def _failing_save(rank: int, world: int, root: str, how: str) -> dict:
    model = GTPWrap(_model(), POLICY | {"collective_timeout_s": 3})
    opt = _optimizer(model)
    _step(model, opt, 0, rank, world)
    first = ckpt.save(root, model, opt, extra={"step": 1})
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}  # local shards
    _step(model, opt, 1, rank, world)
    error = "no error"
    if rank == 1 and how == "dies":
        return {"error": error}  # rank 1 never reaches the save
    try:
        if how == "bad_extra":  # a tensor in extra: not JSON, on every rank
            ckpt.save(root, model, opt, extra={"step": torch.tensor(2)})
        elif rank == 1:
            with mock.patch.object(ckpt, "save_file", side_effect=OSError("disk full")):
                ckpt.save(root, model, opt, extra={"step": 2})
        else:
            ckpt.save(root, model, opt, extra={"step": 2})
    except CheckpointError as e:
        error = str(e)
    extra = ckpt.load(root, model, opt)
    return {
        "error": error,
        "extra": extra,
        "first": str(first),
        "latest": str(ckpt.latest(root)),
        "same": all(torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters()),
    }


@pytest.mark.parametrize("how", ["raises", "dies", "bad_extra"])
def test_failed_save_leaves_previous_checkpoint(tmp_path, how: str) -> None:
    results = run_ranks(_failing_save, 2, str(tmp_path), how, timeout=120)
    survivors = results[:1] if how == "dies" else results
    for r in survivors:
        assert "the previous checkpoints" in r["error"] and "intact" in r["error"], r["error"]
        assert r["latest"] == r["first"]
        assert r["extra"] == {"step": 1}
        assert r["same"]
    if how == "raises":
        assert "rank(s) [1]" in results[0]["error"]
    if how == "bad_extra":
        assert all("JSON-serializable" in r["error"] for r in results)


def test_checkpoint_of_another_model_lists_keys(saved) -> None:
    root, _ = saved
    other = TinyGPT(vocab=VOCAB + 1, layers=3)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(root, other)
    text = str(err.value)
    assert "missing keys" in text and "model/blocks.2.qkv.weight" in text
    assert "mis-shaped keys" in text and f"model/wte.weight: checkpoint [{VOCAB}, 32]" in text
    with pytest.raises(CheckpointError, match="unexpected keys"):
        ckpt.load(root, TinyGPT(vocab=VOCAB, layers=1))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_checkpoint_is_refused(saved, tmp_path, damage: str) -> None:
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(ckpt.latest(root), copy)
    file = copy / "rank1.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
        file.write_bytes(bytes(data))
    elif damage == "truncate":
        file.write_bytes(bytes(data[: len(data) // 2]))
    else:
        file.unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors"):
        ckpt.load(copy, TinyGPT(vocab=VOCAB))


def test_no_checkpoint_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.load(tmp_path, TinyGPT(vocab=VOCAB))
    assert not dist.is_initialized()


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _resume_with_stateless_params(rank: int, world: int, root: str) -> dict:
    """Checkpoints saved before the first step and after a step that left a branch unused."""
    model = GTPWrap(_WithUnused(), POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.save(f"{root}/before", model, opt)
    model(torch.randn(2, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(f"{root}/after", model, opt)
    out = {"saved": _full_optimizer_state(model, opt)}
    for which in ("before", "after"):
        fresh = GTPWrap(_WithUnused(), POLICY)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        ckpt.load(f"{root}/{which}", fresh, fresh_opt)
        out[which] = _full_optimizer_state(fresh, fresh_opt)
    return out


def test_resume_with_parameters_that_have_no_optimizer_state(tmp_path) -> None:
    """A parameter without optimizer state when saved (never had a gradient) resumes without
    state, instead of the load refusing the checkpoint for missing keys."""
    for got in run_ranks(_resume_with_stateless_params, 2, str(tmp_path)):
        assert got["before"] == {}
        assert not any(k.startswith("unused.") for k in got["after"])
        assert {k.split("/")[0] for k in got["after"]} == {"used.weight", "used.bias"}
        _assert_same(got["after"], got["saved"], rtol=0, atol=0)


def test_single_process_save_and_load_with_optimizer(tmp_path) -> None:
    """Without torch.distributed: one process's shards are the whole weights."""
    assert not dist.is_initialized()
    model = GTPWrap(_model(), POLICY)
    opt = _optimizer(model)
    _step(model, opt, 0, 0, 1)
    ckpt.save(tmp_path, model, opt, extra={"step": 1})
    fresh = GTPWrap(TinyGPT(vocab=VOCAB), POLICY)
    fresh_opt = _optimizer(fresh)
    assert ckpt.load(tmp_path, fresh, fresh_opt) == {"step": 1}
    _assert_same(_full_optimizer_state(fresh, fresh_opt), _full_optimizer_state(model, opt))
    _assert_same(gtp_wrap.full_state_dict(fresh), gtp_wrap.full_state_dict(model))


def test_checkpoint_is_reachable_from_the_package() -> None:
    """As the README uses it: `gtp_wrap.checkpoint.save` after `import gtp_wrap` alone."""
    assert gtp_wrap.checkpoint.save is ckpt.save and gtp_wrap.CheckpointError is CheckpointError
