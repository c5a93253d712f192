"""Checkpoints: reshard across mesh shapes and into the unwrapped model, atomic saves, exact
continuation, safetensors export, and clear errors on bad input."""

from __future__ import annotations

import re
import shutil
import textwrap
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
    _readme_dcp("save", model, opt, f"{root}/dcp_optim")
    saved = {"params": gtp_wrap.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    for step in range(2, 4):
        _step(model, opt, step, rank, world)
    saved["continued"] = gtp_wrap.full_state_dict(model)
    probe = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7))
    ckpt.export_safetensors(f"{root}/model.safetensors", model)
    saved["probe_out"] = model(probe).detach()
    return saved


def _readme_dcp(part: str, model, optimizer, path: str) -> None:
    """The README's torch.distributed.checkpoint snippet: its `save` half, or its `load` half
    (after the comment line between them), with torch's own state dicts of model and optimizer
    (see [Note: optimizer state in torch's state dicts])."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("- torch.distributed.checkpoint: torch's own") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's torch.distributed.checkpoint item has no python block"
    save, load = textwrap.dedent(match.group(1)).split("# ... later")
    imports = "\n".join(line for line in save.splitlines() if line.startswith(("import", "from")))
    code = save if part == "save" else imports + "\n" + load.split("\n", 1)[1]
    scope = {"model": model, "optimizer": optimizer, "path": path}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code


def _load_side(rank: int, world: int, root: str, kind: str) -> dict:
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = GTPWrap(TinyGPT(vocab=VOCAB), POLICY, mesh=_mesh(kind))
    opt = _optimizer(model)
    _readme_dcp("load", model, opt, f"{root}/dcp_optim")
    torch_sd = {
        "params": gtp_wrap.full_state_dict(model),
        "optim": _full_optimizer_state(model, opt),
    }
    torch.manual_seed(123)
    model = GTPWrap(TinyGPT(vocab=VOCAB), POLICY, mesh=_mesh(kind))
    opt = _optimizer(model)
    extra = ckpt.load(root, model, opt)
    loaded = {"params": gtp_wrap.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    loaded["extra"] = extra
    loaded["torch_sd"] = torch_sd
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
        _assert_same(got["torch_sd"]["params"], ref["params"], rtol=0, atol=0)
        _assert_same(got["torch_sd"]["optim"], ref["optim"], rtol=0, atol=0)
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
    try:
        extra, loaded = ckpt.load(root, model, opt), "loaded"
    except CheckpointError as e:  # [Note: a load fails on every rank]: one rank is gone
        extra, loaded = None, str(e)
    return {
        "error": error,
        "loaded": loaded,
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
        assert r["extra"] == (None if how == "dies" else {"step": 1})
        assert r["same"]  # the load wrote this rank's part in either case
    if how == "dies":  # this rank loaded its part, and learnt that its peer never did
        assert "not every rank reached the end of the load" in results[0]["loaded"]
    else:
        assert all(r["loaded"] == "loaded" for r in survivors)
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


def _load_outcome(rank: int, world: int, root: str) -> str:
    model = GTPWrap(TinyGPT(vocab=VOCAB), POLICY)
    try:
        ckpt.load(root, model, _optimizer(model))
    except CheckpointError as error:
        return f"CheckpointError: {error}"
    return "loaded"


def test_a_file_damaged_for_one_rank_fails_the_load_on_every_rank(saved, tmp_path) -> None:
    """[Note: a load fails on every rank] At the saved world of 2, rank 0 reads none of
    rank1.safetensors: before, it loaded and trained on while rank 1 raised."""
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(ckpt.latest(root), copy)
    file = copy / "rank1.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))
    got0, got1 = run_ranks(_load_outcome, 2, str(copy))
    assert "rank1.safetensors is corrupted or truncated" in got1, got1
    assert got0.startswith("CheckpointError: loading"), got0
    assert "failed on rank(s) [1] (their CheckpointError names the file)" in got0, got0


@pytest.mark.parametrize("file", ["meta.json", "rank1.json"])
def test_a_changed_digit_in_a_json_file_is_refused(saved, tmp_path, file: str) -> None:
    """A flipped digit leaves valid JSON (a learning rate, a piece's box): its checksum
    refuses it instead of loading it silently wrong."""
    root, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(ckpt.latest(root), copy)
    text = (copy / file).read_text()
    i = next(i for i, c in enumerate(text) if c.isdigit())
    (copy / file).write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :])
    with pytest.raises(CheckpointError, match=f"{file} is corrupted"):
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


def _grouped(model: torch.nn.Module, order: str) -> torch.optim.Optimizer:
    """AdamW with its matrices decayed and its vectors not, a lower lr for the vectors; the
    groups listed `order` ("matrices first" or not), or one group ("one")."""
    params = list(model.parameters())
    matrices = {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1}
    vectors = {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 1e-3}
    if order == "one":
        return torch.optim.AdamW(params, lr=5e-3, weight_decay=0.01)
    groups = [matrices, vectors] if order == "matrices first" else [vectors, matrices]
    return torch.optim.AdamW(groups, lr=1e-2)


@pytest.mark.parametrize(
    ("order", "message"),
    [("one", "saved with 2 optimizer param group"), ("vectors first", "param group 0 holds")],
)
def test_an_optimizer_grouped_otherwise_is_refused(tmp_path, order: str, message: str) -> None:
    """Hyperparameters are restored group by group: an optimizer with another grouping would
    silently take another group's lr and weight decay, so the load refuses it, before anything
    is loaded; the same grouping loads them."""
    model = GTPWrap(_model(), POLICY)
    opt = _grouped(model, "matrices first")
    _step(model, opt, 0, 0, 1)
    ckpt.save(tmp_path, model, opt)
    fresh = GTPWrap(TinyGPT(vocab=VOCAB), POLICY)
    other = _grouped(fresh, order)
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in other.param_groups]
    with pytest.raises(CheckpointError, match=message):
        ckpt.load(tmp_path, fresh, other)
    assert [
        dict((k, v) for k, v in g.items() if k != "params") for g in other.param_groups
    ] == before
    same = _grouped(fresh, "matrices first")
    ckpt.load(tmp_path, fresh, same)
    assert [(g["lr"], g["weight_decay"]) for g in same.param_groups] == [(1e-2, 0.1), (1e-3, 0.0)]


def test_a_checkpoint_saved_without_optimizer_loads_with_one(tmp_path) -> None:
    """Weights saved alone load into a model whose optimizer then starts without state (no
    param groups to check)."""
    model = GTPWrap(_model(), POLICY)
    ckpt.save(tmp_path, model)
    fresh = GTPWrap(TinyGPT(vocab=VOCAB), POLICY)
    opt = _grouped(fresh, "matrices first")
    ckpt.load(tmp_path, fresh, opt)
    _assert_same(gtp_wrap.full_state_dict(fresh), gtp_wrap.full_state_dict(model))
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-2, 0.1), (1e-3, 0.0)]


def test_checkpoint_is_reachable_from_the_package() -> None:
    """As the README uses it: `gtp_wrap.checkpoint.save` after `import gtp_wrap` alone."""
    assert gtp_wrap.checkpoint.save is ckpt.save and gtp_wrap.CheckpointError is CheckpointError


def test_checkpoints_are_named_and_ordered_by_step(tmp_path) -> None:
    """Folders are named by step; latest, prune and load order them by step, not by when they
    were written or by name; without a step the number after the highest is taken."""
    model = GTPWrap(_model(), POLICY)
    assert ckpt.save(tmp_path, model, step=300, extra={"at": 300}).name == "step_000300"
    assert ckpt.save(tmp_path, model, None, {"at": 50}, step=50).name == "step_000050"
    assert ckpt.latest(tmp_path) == tmp_path / "step_000300"  # the highest, not the last
    assert ckpt.save(tmp_path, model, extra={"at": 301}).name == "step_000301"
    assert ckpt.save(tmp_path, model, step=1234567).name == "step_1234567"  # over six digits
    assert ckpt.latest(tmp_path) == tmp_path / "step_1234567"
    shutil.rmtree(tmp_path / "step_1234567")
    # Saving a step again (a resumed run redoing it) replaces that checkpoint.
    ckpt.save(tmp_path, model, step=300, extra={"at": "300 again"})
    assert ckpt.load(tmp_path / "step_000300", TinyGPT(vocab=VOCAB)) == {"at": "300 again"}
    # A checkpoint of the earlier naming (by serial number) counts with its number.
    shutil.copytree(tmp_path / "step_000050", tmp_path / "ckpt_000302")
    assert ckpt.latest(tmp_path) == tmp_path / "ckpt_000302"
    assert ckpt.load(tmp_path, TinyGPT(vocab=VOCAB)) == {"at": 50}
    ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000302", "step_000301"]
    assert ckpt.save(tmp_path, model).name == "step_000303"
    for bad in (-1, True, "7", 2.0):
        with pytest.raises(CheckpointError, match=r"step must be an int >= 0"):
            ckpt.save(tmp_path, model, step=bad)  # type: ignore[arg-type]


def _save_with_steps(rank: int, world: int, root: str) -> dict:
    model = GTPWrap(_model(), POLICY)
    named = ckpt.save(root, model, step=40).name
    try:
        ckpt.save(root, model, step=41 + rank)
        error = "no error"
    except CheckpointError as e:
        error = str(e)
    return {"named": named, "error": error, "folders": sorted(p.name for p in Path(root).iterdir())}


def test_ranks_passing_different_steps_is_an_error(tmp_path) -> None:
    for r in run_ranks(_save_with_steps, 2, str(tmp_path)):
        assert r["named"] == "step_000040"
        assert "ranks passed different steps [41, 42]" in r["error"], r["error"]
        assert r["folders"] == ["step_000040"]


class _FusedQKV(torch.nn.Module):
    """Owns one fused QKV weight, saved as separate Q, K, V copies (a state-dict post-hook on
    this module) and merged back on load (a load pre-hook), through torch's public hook API."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wqkv = torch.nn.Parameter(torch.randn(3 * d, d) / d**0.5)
        self.register_state_dict_post_hook(_split_qkv("wqkv"))
        self.register_load_state_dict_pre_hook(_merge_qkv("wqkv"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wqkv.t()


class _FusedLinearQKV(torch.nn.Module):
    """The same around a child nn.Linear, the hooks on the parent, through the private API."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self._register_state_dict_hook(_split_qkv("qkv.weight"))
        self._register_load_state_dict_pre_hook(_merge_qkv("qkv.weight"), with_module=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)


def _split_qkv(key: str):
    def hook(module, sd, prefix, meta) -> None:
        for name, part in zip("qkv", sd.pop(prefix + key).chunk(3)):
            sd[f"{prefix}w{name}"] = part.clone()

    return hook


def _merge_qkv(key: str):
    def hook(module, sd, prefix, *args) -> None:
        if prefix + "wq" in sd:
            sd[prefix + key] = torch.cat([sd.pop(f"{prefix}w{name}") for name in "qkv"])

    return hook


class _FusedModel(torch.nn.Module):
    def __init__(self, seed: int, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = _FusedQKV(d), _FusedLinearQKV(d)
        self.out = torch.nn.Linear(3 * d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x) + self.b(x))


# The fused weights (24 rows) and the head shard; 24 rows over 2 ranks split Q, K, V across them.
FUSED_POLICY = {"rules": [{"match": "a.wqkv"}, {"match": "Linear"}]} | POLICY
PROBE = torch.arange(24.0).reshape(3, 8) / 24


def _fused_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the real parameters (not the state dict's Q, K, V copies)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fused_side(rank: int, world: int, root: str) -> dict:
    model = GTPWrap(_FusedModel(seed=0), FUSED_POLICY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    opt.step()
    ckpt.save(root, model, opt, step=1)
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp")
    full = gtp_wrap.full_state_dict(model)
    out = {"full": full, "weights": _fused_weights(model), "probe": model(PROBE).detach()}
    out["loaded"] = {}
    for how in ("checkpoint", "dcp", "full"):
        fresh = GTPWrap(_FusedModel(seed=1), FUSED_POLICY)
        if how == "checkpoint":
            ckpt.load(root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        elif how == "dcp":
            sd = fresh.state_dict()
            dcp.load(sd, checkpoint_id=f"{root}/dcp")
            fresh.load_state_dict(sd)
        else:
            gtp_wrap.load_full_state_dict(fresh, full)
        out["loaded"][how] = {"weights": _fused_weights(fresh), "probe": fresh(PROBE).detach()}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_load_runs_the_modules_state_dict_hooks(tmp_path, world: int) -> None:
    """A module that saves its fused QKV weight as Q, K, V copies and merges them in a load
    pre-hook gets its weights back, exactly, from every load path, wrapped or not."""
    results = run_ranks(_fused_side, world, str(tmp_path))
    full = results[0]["full"]
    assert set(full) == {f"{m}.w{n}" for m in "ab" for n in "qkv"} | {"out.weight", "out.bias"}
    plain_ref = _FusedModel(seed=0)
    plain_ref.load_state_dict(full)  # the export holds the logical Q, K, V
    for r in results:
        _assert_same(r["full"], full, rtol=0, atol=0)
        assert r["loaded"].keys() == {"checkpoint", "dcp", "full"}
        for got in r["loaded"].values():
            _assert_same(got["weights"], r["weights"], rtol=0, atol=0)
            torch.testing.assert_close(got["probe"], r["probe"], rtol=0, atol=0)
        torch.testing.assert_close(r["probe"], plain_ref(PROBE), rtol=1e-6, atol=1e-6)
    plain = _FusedModel(seed=2)
    ckpt.load(tmp_path, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    _assert_same(_fused_weights(plain), _fused_weights(plain_ref), rtol=0, atol=0)
    torch.testing.assert_close(plain(PROBE), results[0]["probe"], rtol=1e-6, atol=1e-6)


class _LossyHooks(torch.nn.Module):
    """Saves its weight doubled but loads it as is: load_state_dict(state_dict()) changes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self._register_state_dict_hook(_double_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _double_weight(module, sd, prefix, meta) -> None:
    sd[prefix + "lin.weight"] = sd[prefix + "lin.weight"] * 2


def test_hooks_that_do_not_round_trip_are_named(tmp_path) -> None:
    model = GTPWrap(_LossyHooks(), POLICY)
    ckpt.save(tmp_path, model, step=3)
    with pytest.raises(CheckpointError, match=r"saved values: lin\.weight\. The model's"):
        ckpt.load(tmp_path, GTPWrap(_LossyHooks(), POLICY))


def test_saves_flush_before_publishing_and_clear_what_dead_saves_left(tmp_path) -> None:
    """Every file, then the folder, is flushed before the rename publishes it, and the parent
    after it; a dead save's temporary folder is removed, and a replace interrupted between its
    renames is undone (its checkpoint put back) or cleared (when published again)."""
    model = GTPWrap(_model(), POLICY)
    opt = _optimizer(model)
    _step(model, opt, 0, 0, 1)
    ckpt.save(tmp_path, model, opt, step=1)
    ckpt.save(tmp_path, model, opt, step=2)
    (tmp_path / ".tmp-step_000009").mkdir()
    (tmp_path / ".tmp-step_000009" / "rank0.safetensors").write_bytes(b"partial")
    shutil.copytree(tmp_path / "step_000001", tmp_path / ".old-step_000001")  # republished
    (tmp_path / "step_000002").rename(tmp_path / ".old-step_000002")  # the only copy
    events: list[str] = []
    flush, publish = ckpt._fsync, ckpt._publish

    def flushed(path: Path) -> None:
        events.append(path.name)
        flush(path)

    def published(tmp: Path, final: Path) -> None:
        events.append("rename")
        publish(tmp, final)

    with mock.patch.object(ckpt, "_fsync", flushed), mock.patch.object(ckpt, "_publish", published):
        ckpt.save(tmp_path, model, opt, step=3)
    assert events == ["rank0.safetensors", "rank0.json", "meta.json", ".tmp-step_000003",
                      "rename", tmp_path.name]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]
    fresh = GTPWrap(TinyGPT(vocab=VOCAB), POLICY)
    ckpt.load(tmp_path / "step_000002", fresh)  # the restored one loads
