"""Rule matching: class names, dotted class paths, FQN globs, first match wins, size threshold."""

from __future__ import annotations

import torch
from models import ConvNet, TinyGPT
from omegaconf import OmegaConf
from torch import nn

from gtp_wrap import GTPPolicy, GTPWrap, LayerRule
from gtp_wrap.config.plan import plan_parameters
from gtp_wrap.config.policy import resolve_policy
from gtp_wrap.core.parameter import GTPParameter


def _sharded(model: nn.Module, policy) -> dict[str, int | None]:
    plans = plan_parameters(model, resolve_policy(policy))
    return {p.fqns[0]: p.shard_dim for p in plans}


def test_default_policy_shards_linear_and_embedding_above_threshold() -> None:
    model = nn.Sequential(nn.Embedding(1024, 512), nn.Linear(512, 512), nn.Linear(512, 4))
    got = _sharded(model, None)
    assert got == {"0.weight": 0, "1.weight": 0, "1.bias": None, "2.weight": None, "2.bias": None}


def test_class_name_dotted_path_and_glob() -> None:
    model = ConvNet()
    assert _sharded(model, {"min_shard_numel": 0, "rules": [{"match": "Conv2d"}]}) == {
        "convs.0.weight": 0,
        "convs.0.bias": None,
        "convs.2.weight": 0,
        "convs.2.bias": None,
        "head.weight": None,
        "head.bias": None,
    }
    dotted = {"min_shard_numel": 0, "rules": [{"match": "torch.nn.Linear"}]}
    assert _sharded(model, dotted)["head.weight"] == 0
    assert _sharded(model, dotted)["convs.0.weight"] is None
    glob = {"min_shard_numel": 0, "rules": [{"match": "convs.*.weight", "dim": 1}]}
    assert _sharded(model, glob) == {
        "convs.0.weight": 1,
        "convs.0.bias": None,
        "convs.2.weight": 1,
        "convs.2.bias": None,
        "head.weight": None,
        "head.bias": None,
    }


def test_first_match_wins() -> None:
    policy = GTPPolicy(
        rules=(LayerRule("blocks.1.*", "replicate"), LayerRule("Linear")), min_shard_numel=0
    )
    got = _sharded(TinyGPT(), policy)
    assert got["blocks.0.fc.weight"] == 0
    assert got["blocks.1.fc.weight"] is None


def test_tied_parameter_is_planned_once_and_stays_shared() -> None:
    model = TinyGPT()
    plans = plan_parameters(model, GTPPolicy(min_shard_numel=0))
    tied = [p for p in plans if "wte.weight" in p.fqns]
    assert len(tied) == 1 and tied[0].fqns == ("wte.weight", "head.weight")
    GTPWrap(model, GTPPolicy(min_shard_numel=0))
    assert model.head.weight is model.wte.weight
    assert isinstance(model.wte.weight, GTPParameter)


def test_policy_from_yaml_and_dictconfig(tmp_path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("min_shard_numel: 0\nprefetch_depth: 2\nrules:\n  - {match: Linear}\n")
    from_file = resolve_policy(str(path))
    assert from_file == GTPPolicy(rules=(LayerRule("Linear"),), min_shard_numel=0, prefetch_depth=2)
    assert resolve_policy(OmegaConf.load(path)) == from_file


def test_single_process_wrap_keeps_outputs_and_names() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    x = torch.randint(0, 48, (2, 8))
    before = model(x)
    names = [n for n, _ in model.named_parameters()]
    GTPWrap(model, {"min_shard_numel": 0})
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
