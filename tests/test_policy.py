"""Rule matching: class names, dotted class paths, FQN globs, first match wins, size threshold,
the forms a policy takes, and the warnings for rules or wraps that do nothing."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from models import ConvNet, TinyGPT
from omegaconf import OmegaConf
from torch import nn

from gtp_wrap import GTPPolicy, GTPWrap, LayerRule, PolicyError, PolicyWarning
from gtp_wrap.config.plan import plan_parameters
from gtp_wrap.config.policy import resolve_policy
from gtp_wrap.core.parameter import GTPParameter

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


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


def test_a_list_of_rules_is_a_policy() -> None:
    rules = (LayerRule("Linear"), LayerRule("Embedding", dim=1))
    expected = GTPPolicy(rules=rules)
    assert resolve_policy(list(rules)) == resolve_policy(rules) == expected
    assert resolve_policy([{"match": "Linear"}, {"match": "Embedding", "dim": 1}]) == expected
    assert resolve_policy(OmegaConf.create([{"match": "Linear"}])) == GTPPolicy(rules=rules[:1])
    model = GTPWrap(nn.Sequential(nn.Linear(128, 128)), [LayerRule("Linear")])
    assert isinstance(model[0].weight, GTPParameter)


@pytest.mark.parametrize("bad", [5, LayerRule("Linear"), {"rules": LayerRule("Linear")}])
def test_a_policy_of_another_type_names_the_right_call(bad) -> None:
    with pytest.raises(PolicyError, match=r"GTPPolicy\(rules=\[LayerRule\('Linear'\)\]\)"):
        GTPWrap(nn.Linear(4, 4), bad)


def test_one_default_min_shard_numel() -> None:
    default = resolve_policy(CONFIG_DIR / "policy" / "default.yaml")
    assert GTPPolicy().min_shard_numel == default.min_shard_numel == 1 << 14
    assert GTPPolicy() == default  # the YAML spells out the defaults
    # The README's first snippet shards a 128 x 128 weight.
    readme = GTPPolicy(rules=[LayerRule("Linear"), LayerRule("Embedding")])
    assert _sharded(nn.Sequential(nn.Linear(128, 128)), readme)["0.weight"] == 0


def test_a_policy_file_starts_from_a_built_in_policy(tmp_path) -> None:
    """A YAML of one's own, outside configs/, whose defaults list names a built-in policy (as
    the README's `mine.yaml` does for gtp-train) takes it through the Python API too; one beside
    it of the same name comes first."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("defaults: [bf16, _self_]\nprefetch_depth: 2\n")
    bf16 = resolve_policy(CONFIG_DIR / "policy" / "bf16.yaml")
    assert resolve_policy(str(mine)) == dataclasses.replace(bf16, prefetch_depth=2)
    (tmp_path / "bf16.yaml").write_text("prefetch_depth: 3\n")
    assert resolve_policy(str(mine)) == GTPPolicy(prefetch_depth=2)


def test_a_rule_matching_nothing_warns_with_close_matches() -> None:
    model = ConvNet()
    with pytest.warns(PolicyWarning, match=r"rule 'Linaer' matched no.*did you mean 'Linear'"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("Linaer"), LayerRule("Conv2d"))))
    with pytest.warns(PolicyWarning, match=r"'torch.nn.Conv3d'.*did you mean 'torch.nn.Conv2d'"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("torch.nn.Conv3d"), LayerRule("Linear"))))
    with pytest.warns(PolicyWarning, match=r"'hed.weight'.*did you mean 'head.weight'"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("hed.weight"), LayerRule("Conv2d"))))
    # A module's FQN matches none of its parameters: the hint is its glob.
    with pytest.warns(PolicyWarning, match=r"rule 'head' matched no.*did you mean 'head\.\*'"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("head"), LayerRule("Conv2d"))))
    # The class is there, its parameters 1-D: the hint says why, not a near name.
    norms = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    with pytest.warns(PolicyWarning, match=r"'BatchNorm1d' matched no.*all 1-D.*by its FQN"):
        plan_parameters(norms, GTPPolicy(rules=(LayerRule("BatchNorm1d"), LayerRule("Linear"))))
    holder = nn.Sequential(nn.Sequential(nn.Linear(8, 8)))  # holds no parameter itself
    with pytest.warns(PolicyWarning, match=r"Sequential holds no parameters itself"):
        plan_parameters(holder, GTPPolicy(rules=(LayerRule("Sequential"), LayerRule("Linear"))))
    with pytest.raises(PolicyError, match="strict rule 'Linaer'.*drop strict=True"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("Linaer", strict=True),)))
    with pytest.raises(PolicyError, match=r"rule 'Linaer'.*drop GTPPolicy.strict"):
        plan_parameters(model, GTPPolicy(rules=(LayerRule("Linaer"),), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The default rules fit any model: no Embedding or MultiheadAttention here is no mistake.
        plan_parameters(model, GTPPolicy(min_shard_numel=0, strict=True))


def test_a_wrap_that_shards_nothing_warns() -> None:
    small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    with pytest.warns(PolicyWarning, match=r"shards no weight.*'0.weight', has 64 elements, below"):
        GTPWrap(small)
    with pytest.raises(PolicyError, match="shards no weight.*lower min_shard_numel"):
        plan_parameters(small, GTPPolicy(strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_parameters(small, GTPPolicy(rules=()))  # GTP off, as asked


def test_a_shared_weight_matched_by_two_rules_says_which_won() -> None:
    # Default rules: Embedding (through wte) and Linear (through head) shard it alike: no
    # warning, the reason records it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plans = plan_parameters(TinyGPT(), GTPPolicy(min_shard_numel=0))
    tied = next(p for p in plans if p.fqns == ("wte.weight", "head.weight"))
    assert tied.rule == LayerRule("Linear") and tied.shard_dim == 0
    assert tied.reason == (
        "rule 'Linear'; shared as 'wte.weight', 'head.weight': also matched by rule 'Embedding' "
        "through 'wte.weight', but rule 'Linear' (through 'head.weight') comes first in rule order"
    )
    # Rules that disagree (dim 1 against dim 0): the first in order wins, with a warning.
    policy = GTPPolicy(
        rules=(LayerRule("Embedding", dim=1), LayerRule("Linear")), min_shard_numel=0
    )
    with pytest.warns(
        PolicyWarning, match=r"rule 'Embedding' \(through 'wte.weight'\) comes first"
    ):
        plans = plan_parameters(TinyGPT(), policy)
    assert next(p for p in plans if "wte.weight" in p.fqns).shard_dim == 1
