"""Sharded, reshardable, atomic checkpoints of a model and its optimizer.

A directory of checkpoints holds one folder per checkpoint, named by its training step:
`step_NNNNNN/` (six digits or more). `latest` and `load` take the highest step, `prune` keeps the
highest ones. A save without a step takes the number after the highest there, so a loop that
never passes one still gets increasing folders. Folders `ckpt_NNNNNN/` (the earlier naming, by
serial number) still load and count with their number.

Layout of one checkpoint folder:
- `rank{r}.safetensors`: the pieces rank r owns: its rows of every sharded tensor (weights and
  their optimizer state) if it is the first replica along dp, and every replicated tensor if it
  is rank 0; plus its RNG states.
- `rank{r}.json`: for each piece, the logical shape and the box it holds (a range per dim;
  none for a whole tensor); and the file's CRC-32.
- `meta.json`: world size, optimizer hyperparameters, the caller's `extra`. Written last.
Each JSON file carries the CRC-32 of its own text (format 2; see `_json_text`).

[Note: no pickle, atomic publish] Everything is safetensors or JSON, so loading never unpickles
(torch.distributed.checkpoint pickles its metadata). A checkpoint is written into
`.tmp-step_NNNNNN/` and renamed only after every rank reported its file written; a rank that fails
leaves the previous checkpoints as they were. Pieces are boxes of the logical tensors (rows of a
GTP shard; rows of one column block beside tensor parallelism), so loading at another world size
or mesh reads just the overlap of each piece (safetensors slices without reading whole files).
"""

from __future__ import annotations

import json
import logging
import operator
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import CheckpointError, GTPError
from ..runtime.engine import GTPEngine, engine_of, is_wrapped
from .optimizer_state import hook_optimizer, logical_state
from .state_dict import full_state_dict

log = logging.getLogger(__name__)
_NAME = re.compile(r"^(?:step|ckpt)_(\d{6,})$")
# 2: every JSON file carries its own checksum (1: only the safetensors files have one).
_FORMAT = 2
_JSON_CRC = "json_crc32"
_FQNS = "gtp_param_fqns"  # a saved param group's parameters, by FQN


# ---- state dicts keyed by FQN ---------------------------------------------------------------


def _fqns(model: nn.Module) -> dict[int, str]:
    """Each parameter's FQN by its id (a tied parameter's first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def _group_fqns(fqn_of: dict[int, str], group: dict[str, Any]) -> list[str]:
    """A param group's parameters by FQN ("?" for one the model does not hold)."""
    return [fqn_of.get(id(p), "?") for p in group["params"]]


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state keyed by parameter FQN; the state of sharded
    parameters as DTensors of the logical shape, so it reshards with the model."""
    fqn_of = _fqns(model)
    return {fqn_of[id(p)]: logical_state(p, state) for p, state in optimizer.state.items()}


def _flat_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, for_load: bool
) -> dict[str, Any]:
    """Every tensor of a checkpoint by key; for a load, the optimizer state is created first so
    it can be filled in place."""
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        if for_load:
            _init_optimizer_state(optimizer)
        for fqn, state in optimizer_state_dict(model, optimizer).items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim/{fqn}/{k}"] = v
    return tensors


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a step with zero grads and lr 0) so a load can fill
    them in place; PyTorch's own distributed state-dict helpers do the same."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optimizer.state for p in params):
        return
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    had_grad = {id(p) for p in params if p.grad is not None}
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lr):
        g["lr"] = lr
    for p in params:
        if id(p) not in had_grad:
            p.grad = None


def _drop_unsaved_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, targets: dict, pieces: dict
) -> None:
    """Remove the optimizer state of parameters the checkpoint holds none for.

    [Note: stateless parameters] An optimizer has no state for a parameter that never had a
    gradient (an unused branch, an expert no token was routed to, any parameter before the first
    step), so neither has its checkpoint; the load created state for every parameter to fill it
    in place. Those parameters resume stateless, as they were saved.
    """
    saved = {k[len("optim/") : k.rindex("/")] for k in pieces if k.startswith("optim/")}
    param_of = dict(model.named_parameters())
    for key in [k for k in targets if k.startswith("optim/")]:
        fqn = key[len("optim/") : key.rindex("/")]
        if fqn not in saved:
            del targets[key]
            optimizer.state.pop(param_of[fqn], None)


# ---- pieces: which rows of which tensor this rank holds --------------------------------------


def _pieces(tensors: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, dict, bool]]:
    """(key, local tensor, description, whether this rank writes it) for every tensor. A
    DTensor's local block is a box of the logical tensor (a range per dim: a strided shard of a
    tensor-parallel block is one too), as DTensor itself places it; a replica along a mesh dim
    is written by that dim's first rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for key, v in tensors.items():
        desc: dict[str, Any] = {"shape": list(v.shape), "dtype": str(v.dtype), "box": None}
        if not isinstance(v, DTensor):
            yield key, v, desc, rank == 0
            continue
        mesh = v.device_mesh
        coord = mesh.get_coordinate() or [0] * mesh.ndim
        shape, offset = compute_local_shape_and_global_offset(v.shape, mesh, v.placements)
        writes = all(c == 0 for c, p in zip(coord, v.placements) if p.is_replicate())
        desc["box"] = [[o, o + n] for o, n in zip(offset, shape)]
        yield key, v.to_local(), desc, writes


# ---- save -----------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
) -> Path:
    """Write a new checkpoint under `path` (a directory of checkpoints); every rank calls it.

    The checkpoint's folder is `step_NNNNNN` for `step` (every rank passes the same); a
    checkpoint of that step already there is replaced once the new one is complete. Without
    `step`, the number is one more than the highest checkpoint's under `path`. `extra` is any
    JSON-serializable dict (data position, scheduler state); RNG states are saved per rank.
    Returns the new checkpoint's directory. If any rank fails, the new checkpoint is not
    published and the previous ones stay loadable.
    """
    engine = engine_of(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    root = Path(path)
    if step is not None:
        step = _checked_step(step)
    root.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # before the agreement below, which no rank passes without rank 0
        _remove_stale(root)
    names = (p.name.removeprefix(".tmp-") for p in root.iterdir())
    numbers = [int(m.group(1)) for n in names if (m := _NAME.match(n))]
    proposal = [step, 1] if step is not None else [max(numbers, default=0) + 1, 0]
    # Every rank derives the same name: agree on it before writing anything.
    agreed = _exchange(engine, "checkpoint-name", proposal, root, "the start of a checkpoint save")
    if any(v != agreed[0] for v in agreed) and any(given for _, given in agreed):
        steps = [n if given else None for n, given in agreed]
        raise CheckpointError(
            f"saving a checkpoint in {root}: ranks passed different steps {steps} (by rank); "
            "pass every rank the same step"
        )
    name = f"step_{max(n for n, _ in agreed):06d}"
    tmp, final = root / f".tmp-{name}", root / name
    tmp.mkdir(exist_ok=True)
    try:
        # Every rank makes the metadata (rank 0 writes it), so bad `extra` fails on all of
        # them at once, through the agreement below, instead of on rank 0 after it.
        meta = {
            "format": _FORMAT,
            "world": world,
            "param_groups": _param_groups(model, optimizer),
            "extra": extra or {},
        }
        try:
            meta_text = _json_text(meta)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra must be JSON-serializable (numbers, strings, lists, dicts; use .item() "
                f"on tensors): {e}"
            ) from e
        tensors = _flat_tensors(model, optimizer, for_load=False)
        mine: dict[str, torch.Tensor] = {}
        index: dict[str, dict] = {}
        for key, local, desc, writes in _pieces(tensors):
            if writes:
                mine[key] = local.detach().to("cpu").contiguous().clone()
                index[key] = desc
        mine["rng/cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine["rng/cuda"] = torch.cuda.get_rng_state()
        file = tmp / f"rank{rank}.safetensors"
        save_file(mine, str(file))
        crc = zlib.crc32(file.read_bytes())
        (tmp / f"rank{rank}.json").write_text(_json_text({"crc32": crc, "pieces": index}))
        for written in (file, tmp / f"rank{rank}.json"):
            _fsync(written)
        cause: Exception | None = None
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        cause = e
    status = _exchange(
        engine, "checkpoint-written", [int(cause is not None)], root, "the end of a checkpoint save"
    )
    failed = [r for r, (flag,) in enumerate(status) if flag]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        here = f" (here: {type(cause).__name__}: {cause})" if cause is not None else ""
        raise CheckpointError(
            f"saving {final} failed on rank(s) {failed}{here}; the checkpoint was not published "
            f"and the previous checkpoints in {root} are intact"
        ) from cause
    if rank == 0:
        (tmp / "meta.json").write_text(meta_text)
        _fsync(tmp / "meta.json")
        _fsync(tmp)  # the folder's entries, before the rename publishes them
        _publish(tmp, final)
        _fsync(root)  # the rename itself, before anything (a prune) relies on it
    engine.agreement.exchange("checkpoint-published", [1], "the publishing of a checkpoint")
    return final


def _checked_step(step: Any) -> int:
    """`step` as an int, or a CheckpointError if it is no training step (a bool, float, < 0)."""
    try:
        value = operator.index(step)
    except TypeError:
        value = -1
    if isinstance(step, bool) or value < 0:
        raise CheckpointError(f"step must be an int >= 0 (the training step), got {step!r}")
    return value


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk.

    [Note: durable before published] A checkpoint is published by renaming its folder, and
    older ones are pruned after that. Without a flush first, a power loss after the rename
    could leave the renamed folder holding empty or partial files (the CRC would catch them
    at load, with the previous checkpoint already pruned). So every file is flushed before
    its rank reports it written, the folder before the rename, and the parent after it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(root: Path) -> None:
    """Clear what saves that died left under `root`, before a new save starts (saves are
    collective and one at a time, so no live save owns any of it): `.tmp-*` folders are
    removed; an `.old-*` folder (a replace interrupted between its two renames) is removed if
    its checkpoint was published again, else put back, since it is the published one."""
    for stale in sorted(root.glob(".tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
        log.warning("removed %s, left by a checkpoint save that did not finish", stale)
    for old in sorted(root.glob(".old-*")):
        published = old.with_name(old.name.removeprefix(".old-"))
        if published.exists():
            shutil.rmtree(old, ignore_errors=True)
            log.warning("removed %s, left by a checkpoint replace that did not finish", old)
        else:
            old.rename(published)
            log.warning("restored %s from %s (a replace that did not finish)", published, old)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the written checkpoint into place; an older one of the same step (a resumed run
    saving that step again) is moved aside first, since a rename cannot replace a folder."""
    if not final.exists():
        tmp.rename(final)
        return
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(
    engine: Any, purpose: str, values: list[int], root: Path, what: str
) -> list[list[int]]:
    try:
        return engine.agreement.exchange(purpose, values, what)
    except GTPError as e:
        raise CheckpointError(
            f"saving a checkpoint in {root} failed: not every rank reached {what} ({e}). "
            f"The new checkpoint was not published; the previous checkpoints are intact"
        ) from e


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict]:
    """Each param group's hyperparameters, and under `_FQNS` its parameters' FQNs, which a
    load checks (see `_check_param_groups`)."""
    if optimizer is None:
        return []
    fqn_of = _fqns(model)
    groups = []
    for g in optimizer.param_groups:
        entry: dict[str, Any] = {_FQNS: _group_fqns(fqn_of, g)}
        for k, v in g.items():
            if k == "params":
                continue
            v = v.item() if isinstance(v, torch.Tensor) else v
            if isinstance(v, (int, float, bool, str, type(None), list, tuple)):
                entry[k] = v
        groups.append(entry)
    return groups


# ---- load -----------------------------------------------------------------------------------


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, lowest step first."""
    if not root.is_dir():
        return []
    done = []
    for p in root.iterdir():
        if (m := _NAME.match(p.name)) and (p / "meta.json").is_file():
            done.append((int(m.group(1)), p))
    return [p for _, p in sorted(done)]


def checkpoints(path: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `path` (a directory of them), lowest step first."""
    return _complete(Path(path))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a checkpoint `save` wrote, or a directory holding complete ones."""
    path = Path(path)
    return (path / "meta.json").is_file() or bool(_complete(path))


def latest(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step under `path`, or None."""
    done = _complete(Path(path))
    return done[-1] if done else None


def prune(path: str | os.PathLike, keep: int) -> None:
    """Delete all but the `keep` complete checkpoints of the highest steps under `path` (rank 0
    does it)."""
    if keep <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return
    for old in _complete(Path(path))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into a model (wrapped at any mesh shape, or unwrapped) and optimizer;
    for a wrapped model every rank calls it.

    `path` is a checkpoint directory or a directory of them (the complete one of the highest
    step is taken). The model's weights go through its `load_state_dict`, so hooks it registered
    to convert its state dict run as in any load. Returns the `extra` dict given to `save`.
    Raises CheckpointError naming missing, unexpected or mis-shaped keys, entries the model did
    not take as saved, and files that are missing, truncated or corrupted: for a wrapped model,
    on every rank, also where only some ranks read the damaged file (see [Note: a load fails on
    every rank]).
    """
    engine = engine_of(model) if is_wrapped(model) else None
    try:
        extra = _load(Path(path), model, optimizer)
    except Exception:  # any error, so that every rank reaches the agreement once per load
        agree_loaded(engine, path, loaded=False)
        raise
    agree_loaded(engine, path, loaded=True)
    if optimizer is not None:
        hook_optimizer(optimizer)
    return extra


def agree_loaded(
    engine: GTPEngine | None, path: str | os.PathLike, loaded: bool, key: str = "checkpoint"
) -> None:
    """[Note: a load fails on every rank] Each rank reads only the files that hold its parts,
    so a damaged file fails the ranks that read it, and the others would train on from a state
    that no longer matches theirs. The ranks exchange their outcome (through the store, like
    every check) and the ones that loaded raise too, naming the ranks that did not."""
    if engine is None:
        return
    try:
        outcome = engine.agreement.exchange(
            f"{key}-loaded", [int(loaded)], f"the end of a {key} load"
        )
    except GTPError as error:
        if not loaded:
            return  # this rank's own error says more
        raise CheckpointError(
            f"loading {path}: not every rank reached the end of the load ({error}); on a "
            "wrapped model every rank calls the load"
        ) from error
    failed = [rank for rank, (ok,) in enumerate(outcome) if not ok]
    if failed and loaded:
        raise CheckpointError(
            f"loading {path} failed on rank(s) {failed} (their CheckpointError names the file); "
            "this rank's part loaded, but the ranks' states now differ: load a readable "
            "checkpoint on every rank"
        )


def _load(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """`load`, on this rank alone."""
    if not (ckpt / "meta.json").is_file():
        if not ckpt.exists():
            raise CheckpointError(f"{ckpt} does not exist: give a directory checkpoint.save wrote")
        if ckpt.is_file():
            raise CheckpointError(
                f"{ckpt} is a file, and a checkpoint is a directory (what checkpoint.save "
                "writes); load safetensors weights with gtp_wrap.load_pretrained(model, path)"
            )
        found = latest(ckpt)
        if found is None:
            raise CheckpointError(f"no complete checkpoint in {ckpt}")
        ckpt = found
    meta = _read_json(ckpt / "meta.json")
    checked = meta.get("format", 1) >= 2
    pieces: dict[str, list[dict]] = {}
    crcs: dict[str, int] = {}
    for r in range(meta["world"]):
        info = _read_json(ckpt / f"rank{r}.json", required=checked)
        crcs[f"rank{r}"] = info["crc32"]
        for key, desc in info["pieces"].items():
            pieces.setdefault(key, []).append(desc | {"file": f"rank{r}", "crc32": info["crc32"]})

    if optimizer is not None:
        _check_param_groups(ckpt, model, optimizer, meta["param_groups"])
    targets = _flat_tensors(model, optimizer, for_load=True)
    if optimizer is None:  # a model-only load ignores the optimizer state
        pieces = {k: v for k, v in pieces.items() if not k.startswith("optim/")}
    else:
        _drop_unsaved_state(model, optimizer, targets, pieces)
    _check_keys(ckpt, targets, pieces)
    reader = _Reader(ckpt)
    model_sd: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, local, desc, _ in _pieces(targets):
            value = reader.assemble(key, pieces[key], desc)
            if key.startswith("model/"):
                model_sd[key.removeprefix("model/")] = _like(targets[key], value.to(local.device))
            else:
                local.copy_(value)
    _load_model(ckpt, model, model_sd)
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                if k == _FQNS:
                    continue
                if isinstance(group.get(k), torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == meta["world"]:
        rng = reader.read_all(f"rank{rank}", ["rng/cpu", "rng/cuda"], crcs[f"rank{rank}"])
        torch.set_rng_state(rng["rng/cpu"])
        if "rng/cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["rng/cuda"])
    return meta["extra"]


def _check_param_groups(
    ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, saved: list[dict]
) -> None:
    """Refuse an optimizer whose param groups are not the saved ones: hyperparameters are
    restored group by group, in order, so another grouping (fewer groups, or the same listed in
    another order) would silently give parameters another group's learning rate or weight
    decay. Where the checkpoint names each group's parameters, their sets are compared too."""
    groups = optimizer.param_groups
    if not saved:  # saved without an optimizer: this one starts without state, as before
        return
    if len(saved) != len(groups):
        raise CheckpointError(
            f"{ckpt} was saved with {len(saved)} optimizer param group(s), this optimizer has "
            f"{len(groups)}: build it with the groups it was saved with, in the same order"
        )
    fqn_of = _fqns(model)
    for i, (group, entry) in enumerate(zip(groups, saved)):
        if _FQNS not in entry:  # saved before groups named their parameters
            continue
        here = _group_fqns(fqn_of, group)
        if set(here) != set(entry[_FQNS]):
            moved = sorted(set(here) ^ set(entry[_FQNS]))
            raise CheckpointError(
                f"{ckpt}: optimizer param group {i} holds other parameters than it was saved "
                f"with (differing: {', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''}): "
                "build the optimizer with the groups it was saved with, in the same order"
            )


def _like(target: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part of a loaded tensor) as the kind of tensor `target` is."""
    if not isinstance(target, DTensor):
        return local
    return DTensor.from_local(
        local,
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )


def _load_model(ckpt: Path, model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """Load the model's entries through `model.load_state_dict`, then check that it holds them.

    [Note: load through the module's own path] The entries of `model.state_dict()` need not be
    the parameters: a module's state-dict hooks may save copies (a fused QKV weight as separate
    Q, K, V) and merge them back in a load pre-hook. Filling those entries in place would leave
    the weights as they were, so the loaded tensors are handed to `load_state_dict`, which runs
    the module's hooks. Reading the state dict back catches hooks that do not restore what they
    saved, for the cost of a state dict and a comparison. Each rank checks its own entries; the
    ranks then agree on the outcome (see [Note: a load fails on every rank]).
    """
    try:
        model.load_state_dict(loaded)
    except RuntimeError as e:
        raise CheckpointError(f"loading {ckpt} into {type(model).__name__} failed: {e}") from e
    differ = []
    for key, now in model.state_dict().items():
        want = loaded.get(key)
        if want is None or not _same_values(_local(now), _local(want)):
            differ.append(key)
    if differ:
        raise CheckpointError(
            f"after loading {ckpt}, entries of the model's state dict do not hold the saved "
            f"values: {', '.join(differ[:20])}. The model's state-dict hooks do not round-trip "
            "(load_state_dict(state_dict()) must restore every entry); fix the hooks of the "
            "modules named"
        )


def _local(value: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return (value.to_local() if isinstance(value, DTensor) else value).detach()


def _same_values(now: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `now` holds `want` (cast to its dtype as a load does), NaNs where it has them."""
    if now.shape != want.shape:
        return False
    want = want.to(now.device, now.dtype)
    if now.is_floating_point() or now.is_complex():
        nan = now.isnan()
        if not torch.equal(nan, want.isnan()):
            return False
        now, want = now.masked_fill(nan, 0), want.masked_fill(nan, 0)
    return torch.equal(now, want)


def _json_text(obj: dict[str, Any]) -> str:
    """`obj` as JSON, with the CRC-32 of that JSON's text added as its last key.

    [Note: checksummed JSON] A flipped byte in a checkpoint's JSON can leave it valid JSON that
    loads silently wrong: a digit of a learning rate, or of a piece's box (rows left unfilled).
    So each JSON file carries the CRC-32 of its text without the checksum, which a load checks
    by writing the parsed object out again: JSON written by `json.dumps` reads back to an object
    that `json.dumps` writes as the same text (key order, float repr and escapes round-trip).
    """
    text = json.dumps(obj)
    return json.dumps({**obj, _JSON_CRC: zlib.crc32(text.encode())})


def _read_json(path: Path, required: bool = False) -> dict:
    """A checkpoint's JSON file, its checksum checked. Only the files of a format-1 checkpoint
    have none: a file without one is refused where `required` (its checkpoint's meta.json says
    format 2 or later) or where the file says so itself (meta.json)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupted ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is corrupted (not a JSON object)")
    crc = data.pop(_JSON_CRC, None)
    fmt = data.get("format", 1)
    if crc is None and not required and isinstance(fmt, int) and fmt < 2:
        return data
    if crc is None or zlib.crc32(json.dumps(data).encode()) != crc:
        raise CheckpointError(f"{path} is corrupted (checksum mismatch); load an older checkpoint")
    return data


def _check_keys(ckpt: Path, targets: dict[str, Any], pieces: dict[str, list[dict]]) -> None:
    missing = sorted(k for k in targets if k not in pieces)
    unexpected = sorted(k for k in pieces if k not in targets and not k.startswith("rng/"))
    misshaped = sorted(
        f"{k}: checkpoint {pieces[k][0]['shape']} vs model {list(v.shape)}"
        for k, v in targets.items()
        if k in pieces and pieces[k][0]["shape"] != list(v.shape)
    )
    if missing or unexpected or misshaped:
        lines = [f"{ckpt} does not fit this model/optimizer:"]
        for label, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                lines.append(f"  {label} keys ({len(keys)}): {', '.join(keys[:20])}")
        if misshaped:
            lines.append(f"  mis-shaped keys ({len(misshaped)}): {'; '.join(misshaped[:20])}")
        raise CheckpointError("\n".join(lines))


class _Reader:
    """Reads pieces from the rank files, verifying each file's checksum once."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self._verified: set[str] = set()

    def _open(self, name: str, crc: int | None = None):
        file = self.ckpt / f"{name}.safetensors"
        if name not in self._verified and crc is not None:
            try:
                data = file.read_bytes()
            except FileNotFoundError as e:
                raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from e
            if zlib.crc32(data) != crc:
                raise CheckpointError(
                    f"{file} is corrupted or truncated (checksum mismatch); load an older "
                    "checkpoint"
                )
            self._verified.add(name)
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} cannot be read ({e})") from e

    def read_all(self, name: str, keys: list[str], crc: int) -> dict[str, torch.Tensor]:
        with self._open(name, crc) as f:
            available = set(f.keys())
            return {k: f.get_tensor(k) for k in keys if k in available}

    def read(self, piece: dict, key: str, index: tuple | None = None) -> torch.Tensor:
        with self._open(piece["file"], piece["crc32"]) as f:
            return f.get_tensor(key) if index is None else f.get_slice(key)[index]

    def assemble(self, key: str, pieces: list[dict], want: dict) -> torch.Tensor:
        """This rank's part of `key` as `want` describes it (a box, or everything), read from
        the saved pieces it overlaps, whatever mesh saved them."""
        want_box = _box(want)
        if not want_box:  # a scalar, saved whole
            return self.read(pieces[0], key)
        out = torch.empty([hi - lo for lo, hi in want_box], dtype=_dtype(want["dtype"]))
        for p in pieces:
            box = _box(p)
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want_box, box)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, box))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, want_box))
            out[dst].copy_(self.read(p, key, src))
        return out


def _box(desc: dict) -> list[tuple[int, int]]:
    """A piece's range in each dim: its "box"; the whole tensor where it has none (a replicated
    tensor), or, as checkpoints before boxes described it, one `dim` split `start:end`."""
    whole = [(0, n) for n in desc["shape"]]
    if desc.get("box") is not None:
        return [(lo, hi) for lo, hi in desc["box"]]
    if desc.get("dim") is not None:
        whole[desc["dim"]] = (desc["start"], desc["end"])
    return whole


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def export_safetensors(path: str | os.PathLike, model: nn.Module) -> None:
    """Write the full, unsharded model to one safetensors file (rank 0 writes; all ranks call).

    `model.load_state_dict(safetensors.torch.load_file(path))` loads it into the unwrapped model.
    """
    full = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
