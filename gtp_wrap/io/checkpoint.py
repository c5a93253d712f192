"""Sharded, reshardable, atomic checkpoints of a model and its optimizer.

Layout of one checkpoint directory `ckpt_NNNNNN/`:
- `rank{r}.safetensors`: the pieces rank r owns: its rows of every sharded tensor (weights and
  their optimizer state) if it is the first replica along dp, and every replicated tensor if it
  is rank 0; plus its RNG states.
- `rank{r}.json`: for each piece, the logical shape, the shard dim and the row range it holds;
  and the file's CRC-32.
- `meta.json`: world size, optimizer hyperparameters, the caller's `extra`. Written last.

[Note: no pickle, atomic publish] Everything is safetensors or JSON, so loading never unpickles
(torch.distributed.checkpoint pickles its metadata). A checkpoint is written into
`.tmp-ckpt_NNNNNN/` and renamed only after every rank reported its file written; a rank that fails
leaves the previous checkpoints as they were. Pieces are row ranges along one dim, so loading at
another world size or mesh reads just the overlapping rows of each piece (safetensors slices without
reading whole files).
"""

from __future__ import annotations

import json
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
from torch.distributed.tensor import DTensor, Shard

from ..errors import CheckpointError, GTPError
from ..geometry import row_block
from ..runtime.engine import engine_of, is_wrapped
from .state_dict import full_state_dict, to_dtensor

_NAME = re.compile(r"^ckpt_(\d{6})$")
_FORMAT = 1


# ---- state dicts keyed by FQN ---------------------------------------------------------------


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state keyed by parameter FQN; the state of sharded
    parameters as DTensors of the logical shape, so it reshards with the model."""
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    engine = engine_of(model) if is_wrapped(model) else None
    layout_of = {id(w.param): w.geometry for w in engine.weights} if engine else {}
    out: dict[str, Any] = {}
    for p, state in optimizer.state.items():
        entry = {}
        for k, v in state.items():
            lay = layout_of.get(id(p))
            if (
                engine
                and engine.mesh.device_mesh is not None  # one process: the shard is the whole
                and lay is not None
                and isinstance(v, torch.Tensor)
                and v.shape == p.shape
            ):
                v = to_dtensor(engine, lay, v)
            entry[k] = v
        out[fqn_of[id(p)]] = entry
    return out


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
    """(key, local tensor, description, whether this rank writes it) for every tensor."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for key, v in tensors.items():
        if isinstance(v, DTensor):
            coord = v.device_mesh.get_coordinate() or [0] * v.device_mesh.ndim
            dim, start, end, writes = None, 0, v.shape[0] if v.dim() else 0, True
            for mesh_dim, placement in enumerate(v.placements):
                if isinstance(placement, Shard):
                    dim = placement.dim
                    parts = v.device_mesh.size(mesh_dim)
                    start, end = row_block(v.shape[dim], parts, coord[mesh_dim])
                elif coord[mesh_dim] != 0:
                    writes = False  # another replica along this dim writes it
            desc = {"shape": list(v.shape), "dtype": str(v.dtype), "dim": dim}
            if dim is not None:
                desc |= {"start": start, "end": end}
            yield key, v.to_local(), desc, writes
        else:
            desc = {"shape": list(v.shape), "dtype": str(v.dtype), "dim": None}
            yield key, v, desc, rank == 0


# ---- save -----------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a new checkpoint under `path` (a directory of checkpoints); every rank calls it.

    `extra` is any JSON-serializable dict (step counters, data position, scheduler state); RNG
    states are saved per rank. Returns the new checkpoint's directory. If any rank fails, the
    new checkpoint is not published and the previous ones stay loadable.
    """
    engine = engine_of(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    names = (p.name.removeprefix(".tmp-") for p in root.iterdir())
    serials = [int(m.group(1)) for n in names if (m := _NAME.match(n))]
    name = f"ckpt_{max(serials, default=0) + 1:06d}"
    # Every rank derives the same name: agree on it before writing anything.
    agreed = _exchange(engine, "checkpoint-name", [int(name[5:])], root)
    name = f"ckpt_{max(v[0] for v in agreed):06d}"
    tmp, final = root / f".tmp-{name}", root / name
    tmp.mkdir(exist_ok=True)
    try:
        # Every rank makes the metadata (rank 0 writes it), so bad `extra` fails on all of
        # them at once, through the agreement below, instead of on rank 0 after it.
        meta = {
            "format": _FORMAT,
            "world": world,
            "param_groups": _param_groups(optimizer),
            "extra": extra or {},
        }
        try:
            meta_text = json.dumps(meta)
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
        (tmp / f"rank{rank}.json").write_text(json.dumps({"crc32": crc, "pieces": index}))
        cause: Exception | None = None
    except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
        cause = e
    status = _exchange(engine, "checkpoint-written", [int(cause is not None)], root)
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
        tmp.rename(final)
    engine.agreement.exchange("checkpoint-published", [1])
    return final


def _exchange(engine: Any, purpose: str, values: list[int], root: Path) -> list[list[int]]:
    try:
        return engine.agreement.exchange(purpose, values)
    except GTPError as e:
        raise CheckpointError(
            f"saving a checkpoint in {root} failed: not every rank reached '{purpose}' ({e}). "
            f"The new checkpoint was not published; the previous checkpoints are intact"
        ) from e


def _param_groups(optimizer: torch.optim.Optimizer | None) -> list[dict]:
    if optimizer is None:
        return []
    groups = []
    for g in optimizer.param_groups:
        entry = {}
        for k, v in g.items():
            if k == "params":
                continue
            v = v.item() if isinstance(v, torch.Tensor) else v
            if isinstance(v, (int, float, bool, str, type(None), list, tuple)):
                entry[k] = v
        groups.append(entry)
    return groups


# ---- load -----------------------------------------------------------------------------------


def latest(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `path`, or None."""
    root = Path(path)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "meta.json").is_file()]
    return max(done, key=lambda p: p.name, default=None)


def prune(path: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `path` (rank 0 does it)."""
    if keep <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return
    done = sorted(p for p in Path(path).iterdir() if _NAME.match(p.name))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into a model (wrapped at any mesh shape, or unwrapped) and optimizer.

    `path` is a checkpoint directory or a directory of them (the newest complete one is taken).
    Returns the `extra` dict given to `save`. Raises CheckpointError naming missing, unexpected
    or mis-shaped keys, and files that are missing, truncated or corrupted.
    """
    ckpt = Path(path)
    if not (ckpt / "meta.json").is_file():
        found = latest(ckpt)
        if found is None:
            raise CheckpointError(f"no complete checkpoint in {ckpt}")
        ckpt = found
    meta = _read_json(ckpt / "meta.json")
    pieces: dict[str, list[dict]] = {}
    for r in range(meta["world"]):
        info = _read_json(ckpt / f"rank{r}.json")
        for key, desc in info["pieces"].items():
            pieces.setdefault(key, []).append(desc | {"file": f"rank{r}", "crc32": info["crc32"]})

    targets = _flat_tensors(model, optimizer, for_load=True)
    if optimizer is None:  # a model-only load ignores the optimizer state
        pieces = {k: v for k, v in pieces.items() if not k.startswith("optim/")}
    else:
        _drop_unsaved_state(model, optimizer, targets, pieces)
    _check_keys(ckpt, targets, pieces)
    reader = _Reader(ckpt)
    with torch.no_grad():
        for key, local, desc, _ in _pieces(targets):
            local.copy_(reader.assemble(key, pieces[key], desc))
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                if isinstance(group.get(k), torch.Tensor):
                    group[k].fill_(v)
                else:
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == meta["world"]:
        rng = reader.read_all(f"rank{rank}", ["rng/cpu", "rng/cuda"])
        torch.set_rng_state(rng["rng/cpu"])
        if "rng/cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["rng/cuda"])
    return meta["extra"]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupted ({e})") from e


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

    def read_all(self, name: str, keys: list[str]) -> dict[str, torch.Tensor]:
        with self._open(name) as f:
            available = set(f.keys())
            return {k: f.get_tensor(k) for k in keys if k in available}

    def read(self, piece: dict, key: str, index: tuple | None = None) -> torch.Tensor:
        with self._open(piece["file"], piece["crc32"]) as f:
            return f.get_tensor(key) if index is None else f.get_slice(key)[index]

    def assemble(self, key: str, pieces: list[dict], want: dict) -> torch.Tensor:
        """This rank's part of `key` as `want` describes it (a row range, or everything)."""
        saved_dim = pieces[0]["dim"]
        if saved_dim is None:
            return _narrow(self.read(pieces[0], key), want)
        if want["dim"] == saved_dim:  # same split dim: read only the overlapping rows
            start, end = want["start"], want["end"]
            shape = list(want["shape"])
            shape[saved_dim] = end - start
            out = torch.empty(shape, dtype=_dtype(want["dtype"]))
            for p in pieces:
                lo, hi = max(start, p["start"]), min(end, p["end"])
                if lo < hi:
                    index = (slice(None),) * saved_dim + (slice(lo - p["start"], hi - p["start"]),)
                    out.narrow(saved_dim, lo - start, hi - lo).copy_(self.read(p, key, index))
            return out
        full = torch.empty(want["shape"], dtype=_dtype(want["dtype"]))
        for p in pieces:
            full.narrow(saved_dim, p["start"], p["end"] - p["start"]).copy_(self.read(p, key))
        return _narrow(full, want)


def _narrow(full: torch.Tensor, want: dict) -> torch.Tensor:
    if want["dim"] is None:
        return full
    return full.narrow(want["dim"], want["start"], want["end"] - want["start"])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def export_safetensors(path: str | os.PathLike, model: nn.Module) -> None:
    """Write the full, unsharded model to one safetensors file (rank 0 writes; all ranks call).

    `model.load_state_dict(safetensors.torch.load_file(path))` loads it into the unwrapped model.
    """
    full = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
