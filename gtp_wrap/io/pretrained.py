"""Hugging Face `save_pretrained` of a wrapped model: transformers models and peft adapters.

A wrapped model's `state_dict()` holds DTensors, which safetensors cannot serialize (it reads
their storage), so `model.save_pretrained(dir)` fails. `save_pretrained` here gathers the full
state dict on every rank and has rank 0 hand it to the model's own `save_pretrained`, which
writes the config, the weights in Hugging Face's layout and, for a peft model, only the adapter.

The way back: `load_pretrained` streams a safetensors file (one, or Hugging Face's sharded
index) into a wrapped model, each rank reading only its own rows of each weight, so a model
built on the meta device never exists whole anywhere. (The ordinary way, on every rank before
wrapping, `AutoModelForCausalLM.from_pretrained(dir)` then `GTPWrap`, builds it whole first.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import CheckpointError
from ..runtime.engine import engine_of, is_wrapped
from .checkpoint import agree_loaded, is_checkpoint
from .state_dict import full_state_dict

# Arguments filled in here: the state dict gathered from the shards, and rank 0 as the writer.
_OURS = ("state_dict", "is_main_process")


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """`model.save_pretrained(save_directory, **kwargs)` for a wrapped transformers or peft model.

    A collective: every rank calls it. Every rank gathers the full state dict, rank 0 writes it
    with the model's own `save_pretrained` (a peft model keeps only its adapter's entries), and
    no rank returns before the files are written. `kwargs` go to `save_pretrained` as they are
    (`max_shard_size`, `safe_serialization`, `selected_adapters`...). Raises CheckpointError on
    every rank if writing failed on rank 0.
    """
    given = [k for k in _OURS if k in kwargs]
    if given:
        raise TypeError(
            f"gtp_wrap.save_pretrained sets {', '.join(given)} itself (the full state dict "
            "gathered from the shards, written by rank 0); leave them out"
        )
    write = getattr(model, "save_pretrained", None)
    if not callable(write):
        raise CheckpointError(
            f"{type(model).__name__} has no save_pretrained (it is not a transformers or peft "
            "model); write its weights with gtp_wrap.checkpoint.export_safetensors(file, model)"
        )
    engine = engine_of(model)
    full = full_state_dict(model)
    cause: Exception | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write(save_directory, state_dict=full, is_main_process=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then re-raised
            cause = e
    status = engine.agreement.exchange(
        "pretrained-written", [int(cause is not None)], "the end of save_pretrained"
    )
    if status[0][0]:
        here = f": {type(cause).__name__}: {cause}" if cause is not None else "; see its error"
        raise CheckpointError(
            f"save_pretrained of {type(model).__name__} to {save_directory} failed on rank 0{here}"
        ) from cause


_INDEX = "model.safetensors.index.json"


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    rename: Callable[[str], str | None] | None = None,
) -> None:
    """Load safetensors weights into a model, each rank reading only its part of each tensor.

    `path`: a `.safetensors` file, a Hugging Face sharded index (`model.safetensors.index.json`),
    or a directory holding either (what `save_pretrained` and `export_safetensors` write).
    `rename(file_key)` gives the model FQN a file's tensor goes to (None: skip it); by default
    the names are the same. A wrapped model's sharded weights read only this rank's rows (a
    slice of the file), replicated ones whole, so no rank holds more than one whole weight;
    works on a model built on the meta device and wrapped. An unwrapped model loads whole.
    Keys of the model missing from the file (a tied weight counts as present when its twin
    is), keys of the file the model does not have, and shape mismatches raise CheckpointError
    naming them, before anything is written; for a wrapped model on every rank, also where
    only some ranks failed (a file missing on one node: see [Note: a load fails on every
    rank], io/checkpoint.py).
    """
    engine = engine_of(model) if is_wrapped(model) else None
    try:
        _load_pretrained(model, path, rename)
    except Exception:  # any error, so that every rank reaches the agreement once per load
        agree_loaded(engine, path, loaded=False, key="pretrained")
        raise
    agree_loaded(engine, path, loaded=True, key="pretrained")


def _load_pretrained(
    model: nn.Module, path: str | os.PathLike, rename: Callable[[str], str | None] | None
) -> None:
    """`load_pretrained`, on this rank alone."""
    targets = model.state_dict(keep_vars=True)
    with torch._C.DisableTorchFunctionSubclass():
        held = {_where(t) for t in [*model.parameters(), *model.buffers()]}
        on_meta = [k for k, v in targets.items() if _local(v).is_meta]
        copies = [k for k, v in targets.items() if _where(v) not in held]
    if on_meta:
        raise CheckpointError(
            f"the model's {on_meta[:4]} are on the meta device: wrap it first (GTPWrap "
            "allocates each rank's part), or build it on a device"
        )
    if copies:
        raise CheckpointError(
            f"the state dict's {copies[:4]} are not the model's own tensors (a module's state "
            "dict hook converts them): load them with model.load_state_dict instead"
        )
    files = _files_by_key(Path(path))
    to_model: dict[str, str] = {}
    for key in files:
        name = rename(key) if rename is not None else key
        if name is not None:
            to_model[name] = key
    unexpected = sorted(k for k in to_model if k not in targets)
    loaded = {_where(targets[k]) for k in to_model if k in targets}
    missing = sorted(k for k, v in targets.items() if k not in to_model
                     and _where(v) not in loaded)  # fmt: skip
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; map the names with rename=..."
        )
    handles: dict[Path, Any] = {}
    try:
        pending = []
        for name, key in to_model.items():
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            piece = handles[file].get_slice(key)
            target = targets[name]
            if tuple(piece.get_shape()) != tuple(target.shape):
                raise CheckpointError(
                    f"'{key}' in {file.name} has shape {tuple(piece.get_shape())}, but the "
                    f"model's '{name}' is {tuple(target.shape)}"
                )
            pending.append((target, piece))
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            for target, piece in pending:
                local = _local(target)
                part = piece[_box(target)] if isinstance(target, DTensor) else piece[:]
                local.copy_(part.reshape(local.shape))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def _where(value: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What a state dict entry's elements are, to tell a tied weight's twin keys apart from
    different weights."""
    with torch._C.DisableTorchFunctionSubclass():
        local = _local(value)
        return local.untyped_storage().data_ptr(), int(local.storage_offset()), tuple(local.shape)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _box(value: DTensor) -> tuple[slice, ...]:
    """This rank's block of a DTensor's logical tensor, as slices."""
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _files_by_key(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: one safetensors file, or a sharded index's weight map."""
    if path.is_dir():
        if is_checkpoint(path):
            raise CheckpointError(
                f"{path} is a gtp_wrap checkpoint (what checkpoint.save writes), not safetensors "
                "weights: load it with gtp_wrap.checkpoint.load(path, model), or write its "
                "weights as one file with gtp_wrap.checkpoint.export_safetensors(file, model)"
            )
        index, single = path / _INDEX, path / "model.safetensors"
        path = index if index.exists() else single
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist: give a .safetensors file, a {_INDEX}, or a directory "
            "holding one"
        )
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path} is not a safetensors index (no weight_map)") from e
        return {key: path.parent / name for key, name in weight_map.items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: path for key in f.keys()}  # noqa: SIM118 - not a mapping
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
