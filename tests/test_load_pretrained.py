"""gtp_wrap.load_pretrained: safetensors streamed into a wrapped (meta-built) model, each rank
reading its rows; exact against load_state_dict on the unwrapped model; bad files refused."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from harness import caught, run_ranks
from safetensors.torch import save_file

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig

CFG = GPTConfig(vocab=66, d=32, layers=2, heads=4, ffn=48, max_seq=16)


def _llama_config():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip


def _hf_saved(root: Path) -> dict[str, torch.Tensor]:
    """A small random Llama saved by HF's save_pretrained, whole and as a sharded index."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(_llama_config())
    model.save_pretrained(root / "whole")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(rank: int, world: int, root: str) -> dict:
    from transformers import LlamaForCausalLM

    out = {}
    for kind in ("whole", "sharded"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(_llama_config())
        GTPWrap(model, {"min_shard_numel": 0}, device="cpu")
        gtp_wrap.load_pretrained(model, Path(root) / kind)
        out[kind] = gtp_wrap.full_state_dict(model)
    # The reference GPT's own export, into a meta-built wrapped GPT.
    torch.manual_seed(0)
    with torch.device("meta"):
        gpt = GPT(CFG)
    GTPWrap(gpt, {"min_shard_numel": 0}, device="cpu")
    gtp_wrap.load_pretrained(gpt, Path(root) / "gpt.safetensors")
    out["gpt"] = gtp_wrap.full_state_dict(gpt)
    return out


def test_streamed_loads_equal_load_state_dict_on_the_unwrapped_model() -> None:
    with tempfile.TemporaryDirectory() as root:
        want = _hf_saved(Path(root))
        assert len(list((Path(root) / "sharded").glob("*.safetensors"))) > 1
        torch.manual_seed(5)
        gpt = GPT(CFG)
        gtp_wrap.checkpoint.export_safetensors(Path(root) / "gpt.safetensors", gpt)
        results = run_ranks(_load, 2, root)
    for r in results:
        for kind in ("whole", "sharded"):
            assert r[kind].keys() == want.keys()
            for k, v in want.items():
                assert torch.equal(r[kind][k], v), (kind, k)
        for k, v in gpt.state_dict().items():
            assert torch.equal(r["gpt"][k], v), k


def _bad(rank: int, world: int, root: str) -> dict:
    def wrapped(cfg: GPTConfig = CFG) -> GPT:
        return GTPWrap(GPT(cfg), {"min_shard_numel": 0})  # type: ignore[return-value]

    file, load = Path(root) / "gpt.safetensors", gtp_wrap.load_pretrained
    wider = GPTConfig(**{**CFG.__dict__, "vocab": 70})
    return {
        "missing": caught(lambda: load(wrapped(), file,
                                       rename=lambda k: None if k == "norm.weight" else k)),
        "unexpected": caught(lambda: load(wrapped(), file,
                                          rename=lambda k: "x." + k if k == "norm.weight" else k)),
        "shape": caught(lambda: load(wrapped(wider), file)),
        "nothing": caught(lambda: load(wrapped(), Path(root) / "none")),
        "garbage": caught(lambda: load(wrapped(), Path(root) / "junk.safetensors")),
        # A file missing on one node only: rank 1 reads a path rank 0 has, rank 0 the file.
        "one_rank": caught(lambda: load(wrapped(), file if rank == 0 else Path(root) / "no")),
    }  # fmt: skip


def test_bad_files_are_refused_naming_the_keys() -> None:
    with tempfile.TemporaryDirectory() as root:
        tensors = {k: v.clone() for k, v in GPT(CFG).state_dict().items() if k != "head.weight"}
        save_file(tensors, str(Path(root) / "gpt.safetensors"))
        (Path(root) / "junk.safetensors").write_bytes(b"not a safetensors file")
        r, r1 = run_ranks(_bad, 2, root)
    assert r["missing"].startswith("CheckpointError") and "missing ['norm.weight']" in r["missing"]
    assert "unexpected ['x.norm.weight']" in r["unexpected"]
    assert "'embed.weight' in gpt.safetensors has shape (66, 32)" in r["shape"]
    assert r["nothing"].startswith("CheckpointError") and "does not exist" in r["nothing"]
    assert r["garbage"].startswith("CheckpointError") and "not a readable" in r["garbage"]
    # Both ranks stop at once: the one that loaded names the one that could not.
    assert "failed on rank(s) [1]" in r["one_rank"], r["one_rank"]
    assert "does not exist" in r1["one_rank"], r1["one_rank"]


@pytest.mark.parametrize("tied", [True, False])
def test_one_process_and_tied_weights(tied: bool, tmp_path: Path) -> None:
    """In one process (a group of one), and with the tied head absent from the file as
    save_pretrained writes it."""
    cfg = GPTConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    torch.manual_seed(1)
    source = GPT(cfg)
    saved = {k: v for k, v in source.state_dict().items() if not (tied and k == "head.weight")}
    save_file({k: v.contiguous() for k, v in saved.items()}, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        model = GPT(cfg)
    GTPWrap(model, {"min_shard_numel": 0}, device="cpu")
    gtp_wrap.load_pretrained(model, tmp_path / "m.safetensors")
    got = gtp_wrap.full_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    if not tied:
        del saved["head.weight"]
        save_file(saved, str(tmp_path / "m.safetensors"))
        with pytest.raises(gtp_wrap.CheckpointError, match=r"missing \['head.weight'\]"):
            gtp_wrap.load_pretrained(model, tmp_path / "m.safetensors")
