"""Hugging Face models: `gtp_wrap.save_pretrained` of a wrapped transformers model and of a
wrapped peft LoRA model loads back with `from_pretrained` into the unwrapped model."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from harness import run_ranks
from models import tiny_llama_config
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import gtp_wrap
from gtp_wrap import CheckpointError, GTPWrap

POLICY = {"min_shard_numel": 64, "collective_timeout_s": 30}  # shards even the LoRA matrices


def _config() -> LlamaConfig:
    return tiny_llama_config()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _lora(base: torch.nn.Module) -> PeftModel:
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, lora)


def _train_and_save(rank: int, world: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """One training step of each kind of model, wrapped, then save_pretrained."""
    out = {}
    for kind in ("llama", "peft"):
        model = _lora(_llama()) if kind == "peft" else _llama()
        model = GTPWrap(model, POLICY)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        gtp_wrap.save_pretrained(model, f"{root}/{kind}")
        out[kind] = gtp_wrap.full_state_dict(model)
    return out


def test_save_pretrained_loads_with_from_pretrained(tmp_path) -> None:
    ranks = run_ranks(_train_and_save, 2, str(tmp_path))
    for kind in ("llama", "peft"):
        full = ranks[0][kind]
        torch.testing.assert_close(ranks[1][kind], full, rtol=0, atol=0)
        if kind == "peft":
            loaded = PeftModel.from_pretrained(_llama(), tmp_path / kind)
            trained = [k for k in full if "lora_B" in k]  # zero before the step
            assert len(trained) == 4 and all(full[k].abs().sum() > 0 for k in trained)
            # Only the adapter was written: the base comes from the base model.
            assert not (tmp_path / kind / "model.safetensors").exists()
        else:
            loaded = LlamaForCausalLM.from_pretrained(tmp_path / kind)
            assert (tmp_path / kind / "model.safetensors").exists()
        got = {k: v.detach() for k, v in loaded.state_dict().items()}
        torch.testing.assert_close(got, full, rtol=0, atol=0, msg=lambda m, k=kind: f"{k}: {m}")


def test_save_pretrained_refuses_what_it_cannot_do(tmp_path) -> None:
    wrapped = GTPWrap(_llama(), POLICY)
    with pytest.raises(TypeError, match="sets state_dict itself"):
        gtp_wrap.save_pretrained(wrapped, tmp_path, state_dict={})
    with pytest.raises(CheckpointError, match="no save_pretrained.*export_safetensors"):
        gtp_wrap.save_pretrained(GTPWrap(torch.nn.Linear(4, 4), {"min_shard_numel": 0}), tmp_path)
    # A failure inside the model's save_pretrained is a CheckpointError naming its cause.
    disk_full = mock.patch.object(wrapped, "save_pretrained", side_effect=OSError("disk full"))
    with disk_full, pytest.raises(CheckpointError, match="failed on rank 0: OSError: disk full"):
        gtp_wrap.save_pretrained(wrapped, tmp_path)
