"""Hugging Face `save_pretrained` of a wrapped model: transformers models and peft adapters.

A wrapped model's `state_dict()` holds DTensors, which safetensors cannot serialize (it reads
their storage), so `model.save_pretrained(dir)` fails. `save_pretrained` here gathers the full
state dict on every rank and has rank 0 hand it to the model's own `save_pretrained`, which
writes the config, the weights in Hugging Face's layout and, for a peft model, only the adapter.

The way back is the ordinary one, on every rank, before wrapping:
`AutoModelForCausalLM.from_pretrained(dir)` (or `PeftModel.from_pretrained(base, dir)`), then
`GTPWrap`. A model already wrapped takes the weights with
`gtp_wrap.load_full_state_dict(model, safetensors.torch.load_file(f"{dir}/model.safetensors"))`.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..runtime.engine import engine_of
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
