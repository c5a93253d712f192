"""Sharding policies: which parameters are sharded, along which dim, and the engine's knobs.

A policy is plain data (frozen dataclasses) so it can be written in YAML, compared and logged.
`resolve_policy` accepts every form the public API allows; config/plan.py applies it to a
module, the only place rule matching happens.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from ..errors import PolicyError

Action = Literal["shard", "replicate"]
_ACTIONS = get_args(Action)
TPStyle = Literal["colwise", "rowwise", "sequence", "split_sequence", "gather_sequence"]
_TP_STYLES = get_args(TPStyle)
Collectives = Literal["process_group", "copy_engine"]
Group = Literal["gtp", "egtp"]
_GROUPS = get_args(Group)
_COLLECTIVES = get_args(Collectives)
_GLOB_CHARS = frozenset("*?[")
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def policy_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a policy's dtype name stands for (None stays None)."""
    return None if name is None else _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """One rule: parameters matched by `match` are sharded along `dim` or replicated.

    `match` is a class name (matched against the MRO of the module owning the parameter), a
    dotted class path (`"torch.nn.Linear"`), or a glob over parameter FQNs (`"layers.*.mlp.*"`).
    A class rule applies to the module's own parameters of two or more dims (weights, not
    biases); an FQN rule applies to every parameter it names. A rule that matches nothing
    warns (`PolicyWarning`, with close matches among the model's class names and FQNs); with
    `strict=True` it is a PolicyError instead.

    A rule with `tp` gives the modules it matches (a class name, a module FQN, or a glob over
    module FQNs) a style of torch's tensor parallelism over the mesh's "tp" dim, applied before
    GTP shards anything; it decides no GTP sharding (the rules without `tp` do). Styles:
    "colwise" (ColwiseParallel: a Linear's output features, an Embedding's dim), "rowwise"
    (RowwiseParallel: a Linear's input features, an Embedding's vocabulary), "sequence"
    (SequenceParallel: a norm on activations split over the sequence). With any "sequence"
    rule, activations between blocks stay split over the sequence (dim 1): colwise layers
    gather their input and rowwise ones reduce-scatter their output, and "split_sequence"
    (on the module whose output enters the split stream, e.g. the embedding) and
    "gather_sequence" (on the module that takes it whole again, e.g. the output head) mark its
    ends. A rule matching no module is a PolicyError.

    `group="egtp"` makes the weights it shards expert stacks (`[experts, out, in]`): they are
    sharded along `dim` over the expert mesh's "egtp" dim instead of over "gtp", partitioned
    along dim 0 over its "ep" dim, and placed there whatever their size (min_shard_numel
    does not apply). It needs GTPWrap's `expert_mesh`.
    """

    match: str
    action: Action = "shard"
    dim: int = 0
    strict: bool = False
    tp: TPStyle | None = None
    group: Group = "gtp"

    def __post_init__(self) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise PolicyError(f"LayerRule.match must be a non-empty string, got {self.match!r}")
        if self.action not in _ACTIONS:
            raise PolicyError(
                f"LayerRule(match={self.match!r}) has unknown action {self.action!r}; "
                f"use one of {_ACTIONS}"
            )
        if not isinstance(self.dim, int) or self.dim < 0:
            raise PolicyError(
                f"LayerRule(match={self.match!r}) has dim={self.dim!r}; use a dim >= 0"
            )
        if self.tp is not None and self.tp not in _TP_STYLES:
            raise PolicyError(
                f"LayerRule(match={self.match!r}) has tp={self.tp!r}; use one of {_TP_STYLES}"
            )
        if self.group not in _GROUPS:
            raise PolicyError(
                f"LayerRule(match={self.match!r}) has group={self.group!r}; use one of {_GROUPS}"
            )
        if self.group != "gtp" and (self.action != "shard" or self.tp is not None):
            raise PolicyError(
                f"LayerRule(match={self.match!r}, group={self.group!r}) must shard (action "
                "'shard', no tp): the group says where its weights are sharded"
            )
        if self.tp is not None and (self.action, self.dim) != ("shard", 0):
            raise PolicyError(
                f"LayerRule(match={self.match!r}, tp={self.tp!r}) also sets action or dim: a "
                "rule with tp only gives modules a tensor-parallel style; decide GTP's sharding "
                "of their weights with a rule without tp"
            )

    @property
    def is_fqn_glob(self) -> bool:
        return any(c in _GLOB_CHARS for c in self.match)

    def resolve_class(self) -> type | None:
        """The class a dotted path names, or None when `match` is not an importable class.

        Only a path whose last part is capitalized, like a class name, is imported, so an FQN
        such as "layers.0.weight" never triggers an import.
        """
        module_name, _, attr = self.match.rpartition(".")
        if not module_name or self.is_fqn_glob or not attr[:1].isupper():
            return None
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception:  # noqa: BLE001 - not an importable class: treat `match` as an FQN
            return None
        return obj if isinstance(obj, type) else None


# Meant for any model: one that matches nothing (no Embedding in a CNN) is not a mistake.
DEFAULT_RULES = (
    LayerRule(match="Linear", action="shard"),
    LayerRule(match="Embedding", action="shard"),
    LayerRule(match="MultiheadAttention", action="shard"),
)


@dataclasses.dataclass(frozen=True)
class GTPPolicy:
    """What to shard and how the engine runs.

    Attributes:
        rules: tried in order; the first rule matching a parameter decides it. The default
            shards the weights of Linear, Embedding and MultiheadAttention (its packed
            `in_proj_weight`; `out_proj` is a Linear). A list of rules alone is accepted
            wherever a policy is: `GTPWrap(model, [LayerRule("Linear")])`.
        min_shard_numel: parameters with fewer elements than this (16384 = 128 x 128 by
            default, as in configs/policy/default.yaml) stay replicated whatever the rules say:
            their 1/N memory saving is negligible. A weight just above it does not pay a
            collective's fixed latency (~150 us on NVLink below 1 MB) alone: consecutive
            weights along a chain are gathered as one collective, up to `group_numel`.
        prefetch_depth: how many groups of gathers along the chain are in flight ahead of the
            current use's group. A block on gathered weights is one group, and any depth but
            0 also prefetches the whole next block (see [Note: a block's weights in one group]
            in runtime/chain.py).
        group_numel: consecutive uses along a chain are gathered as one collective until their
            full weights reach this many elements, and weight gradients are reduce-scattered the
            same way; 0 issues one collective per weight (a block on gathered weights is one group
            whatever it says). Collectives of a few MB are latency-bound,
            so grouping moves the same bytes sooner and launches fewer (see [Note: grouped gathers]
            in runtime/chain.py); memory held by gathered weights grows with the group.
        pad_for_alignment: start every shard at a 128-byte boundary of the flat storage, so
            collectives read aligned memory.
        loss_reduction: "mean" averages gradients over all data-parallel ranks (like DDP);
            "sum" adds them.
        collective_timeout_s: a collective that has not completed after this long raises
            CollectiveTimeoutError naming the weight (on gloo; NCCL uses its group's timeout);
            one that fails on this rank raises CollectiveError with the cause. Peers that
            diverged or failed are named within seconds instead (see comm/watch.py).
        param_dtype: the dtype weights are gathered and computed in ("bfloat16", "float16");
            None keeps the parameters' dtype. Shards, optimizer state and `.grad` stay in the
            parameters' own dtype (fp32 masters). No autocast: gathers move and yield weights
            in param_dtype, so no use casts a full weight.
        compute_copy: where the shards are cast to param_dtype. False (default): each gather
            casts this rank's shard straight into its part of the gather buffer, as FSDP2 does, so
            no copy is held. True: keep a param_dtype copy of the shards, cast once per step, which
            holds 1/N of the model in param_dtype more memory for one cast per step instead of one
            per gather (see [Note: no compute copy] in precision/encoding.py). A weight sharded
            over a group of one, which gathers nothing, keeps its copy either way; a weight
            gathered in fp8 or nvfp4 keeps none.
        reduce_dtype: the dtype weight gradients are reduce-scattered in ("float32"); None
            uses param_dtype's gradients as they come.
        gather_dtype: "fp8" to gather float8_e4m3fn shards with a scale per 128-element block
            (quantized once per step, dequantized to param_dtype for the GEMM; 1.03 bytes per
            element); "nvfp4" to gather 4-bit E2M1 values with an E4M3 scale per 16 elements
            and an fp32 scale per shard (0.56 bytes per element, for slow links; always
            dequantized, see precision/nvfp4.py); None gathers in param_dtype. Weights sharded
            over a group of one gather nothing and read their param_dtype copy.
        fp8_matmul: with gather_dtype "fp8", run the forward GEMM of each Linear in FP8
            (torch._scaled_mm, on GPUs with FP8 tensor cores and on CPUs): weights are then
            quantized with one scale per row and fed to the GEMM without dequantization, and
            activations are quantized per row on the fly. Backward stays in param_dtype.
        collectives: what moves gathers and reduce-scatters. "process_group" (default): the
            process group's collectives (NCCL kernels on GPUs, gloo on CPUs). "copy_engine": memcpys
            over NVLink through symmetric-memory workspaces of 2 and 4 x group_numel bytes (at least
            16 MiB each; `gtp_wrap.stats` reports them as workspace_bytes), so the transfers leave
            the GEMMs they overlap their SMs (see [Note: why copy engines] in comm/copy_engine.py);
            needs the GTP group's GPUs on one host with peer access. Replicated all-reduces stay on
            the process group. Pays off with `graph_step`: eager, its host time per collective is
            higher than NCCL's. A peer that stalls past collective_timeout_s makes a barrier trap on
            the GPU (a CUDA error that ends the process) instead of raising CollectiveTimeoutError.
        norm_in_fp32: with a param_dtype, normalization layers with running statistics
            (BatchNorm*, SyncBatchNorm, InstanceNorm*; torch's `_NormBase`) keep their parameters
            and statistics in fp32 and stay replicated, as FSDP's mixed precision does by
            default: torch's batch norm takes their param_dtype input with fp32 parameters and
            statistics, normalizes in fp32 and returns param_dtype, as under autocast. False
            casts their parameters like any other and their running statistics to param_dtype,
            in place at wrap time (the statistics then accumulate and are saved in it).
            LayerNorm, GroupNorm and RMSNorm follow param_dtype either way.
        strict: a rule that matches no parameter raises PolicyError instead of a PolicyWarning
            (as `LayerRule(strict=True)` does for one rule). Rules equal to the built-in
            defaults (Linear, Embedding, MultiheadAttention: configs/policy/default.yaml lists
            them) are exempt, so the shipped policies stay usable on models that lack one of
            those classes.
        gather_per_block: modules (class names, module FQNs or globs over them) that run on
            their weights gathered once per call, as `gtp_wrap.gather_per_block` makes them:
            for code whose set of weights used depends on the data (a mixture of experts that
            runs only the experts that got tokens), which per-use gathers cannot follow
            across ranks. Names that match no module are skipped (a warning if none matches).
        check_finite: at each optimizer step over the model's parameters, check that their
            reduced gradients (sharded and replicated) are finite, and raise NonFiniteError
            naming the first weight that is not and the step, on every rank: one small
            all-reduce and one host read per step, at the step (not in the passes). Not under
            `graph_step`, whose replays run no host code. `gtp_wrap.nonfinite_grads(model)`
            makes the same check on demand (to skip a step instead).
        expert_parallel: experts modules (class names, module FQNs or globs) whose forward
            takes `(tokens sorted by expert, tokens per expert)` for all the layer's experts,
            as the reference MoE's `Experts` and torchtitan's `GroupedExperts` do. With an
            expert mesh whose "ep" dim has more than one rank, each such module keeps its ep
            rank's experts, and its calls send each token to the rank holding its expert and
            back (an all-to-all each way, parallel/experts.py). Every module owning a
            `group="egtp"` weight must be one of them then.
    """

    rules: tuple[LayerRule, ...] = DEFAULT_RULES
    min_shard_numel: int = 1 << 14
    prefetch_depth: int = 1
    group_numel: int = 1 << 24
    pad_for_alignment: bool = True
    loss_reduction: Literal["mean", "sum"] = "mean"
    collective_timeout_s: float = 300.0
    param_dtype: str | None = None
    compute_copy: bool = False
    reduce_dtype: str | None = None
    gather_dtype: str | None = None
    fp8_matmul: bool = False
    collectives: Collectives = "process_group"
    norm_in_fp32: bool = True
    strict: bool = False
    gather_per_block: tuple[str, ...] = ()
    expert_parallel: tuple[str, ...] = ()
    check_finite: bool = False

    def __post_init__(self) -> None:
        for name, kind in (
            ("min_shard_numel", int),
            ("prefetch_depth", int),
            ("group_numel", int),
            ("pad_for_alignment", bool),
            ("fp8_matmul", bool),
            ("compute_copy", bool),
            ("norm_in_fp32", bool),
            ("strict", bool),
            ("check_finite", bool),
            ("collective_timeout_s", (int, float)),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                what = "a number" if isinstance(kind, tuple) else f"a {kind.__name__}"
                quoted = (
                    " (a quoted YAML value is a string: drop the quotes)"
                    if isinstance(value, str)
                    else ""
                )
                raise PolicyError(f"GTPPolicy.{name} must be {what}, got {value!r}{quoted}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise PolicyError(f"{name}={value!r} is not a dtype; use one of {sorted(_DTYPES)}")
        if self.gather_dtype not in (None, "fp8", "float8_e4m3fn", "nvfp4"):
            raise PolicyError(
                f"gather_dtype={self.gather_dtype!r} is not supported; use 'fp8' (or its torch "
                "name 'float8_e4m3fn'), 'nvfp4' or null"
            )
        if self.collectives not in _COLLECTIVES:
            raise PolicyError(
                f"collectives={self.collectives!r} is not supported; use one of {_COLLECTIVES}"
            )
        bf16 = _DTYPES.get(self.param_dtype or "") is torch.bfloat16
        if self.fp8_matmul and (self.gather_dtype in (None, "nvfp4") or not bf16):
            raise PolicyError(
                "fp8_matmul feeds the gathered FP8 weights to the GEMM, so it needs "
                "gather_dtype: fp8 and param_dtype: bfloat16 (the GEMM's output dtype)"
            )
        if not isinstance(self.rules, (list, tuple)):
            raise PolicyError(
                f"GTPPolicy.rules must be a list of rules, got {type(self.rules).__name__}; "
                "e.g. GTPPolicy(rules=[LayerRule('Linear')])"
            )
        rules = tuple(_coerce_rule(r) for r in self.rules)
        object.__setattr__(self, "rules", rules)
        for name in ("gather_per_block", "expert_parallel"):
            names = getattr(self, name)
            if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
                raise PolicyError(
                    f"{name} must be a list of class names or module FQNs (globs), got {names!r}"
                )
            object.__setattr__(self, name, tuple(names))
        if self.min_shard_numel < 0:
            raise PolicyError(f"min_shard_numel must be >= 0, got {self.min_shard_numel}")
        if self.prefetch_depth < 0:
            raise PolicyError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.group_numel < 0:
            raise PolicyError(f"group_numel must be >= 0, got {self.group_numel}")
        if self.loss_reduction not in ("mean", "sum"):
            raise PolicyError(
                f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}"
            )
        if self.collective_timeout_s <= 0:
            raise PolicyError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")


def _coerce_rule(rule: Any) -> LayerRule:
    if isinstance(rule, LayerRule):
        return rule
    if isinstance(rule, Mapping):
        unknown = set(rule) - {f.name for f in dataclasses.fields(LayerRule)}
        if unknown:
            raise PolicyError(
                f"unknown LayerRule field(s) {sorted(unknown)}; valid: match, action, dim, strict, "
                "tp, group"
            )
        return LayerRule(**dict(rule))
    raise PolicyError(f"a rule must be a LayerRule or a mapping, got {type(rule).__name__}")


_POLICY_FORMS = (
    "give a GTPPolicy (GTPWrap(model, GTPPolicy(rules=[LayerRule('Linear')]))), a mapping of its "
    "fields ({'rules': [{'match': 'Linear'}], 'min_shard_numel': 0}), a list of rules "
    "([LayerRule('Linear')]), a YAML file path, or None for the default policy"
)


# Every form GTPWrap takes a policy in (see resolve_policy).
PolicySpec = (
    GTPPolicy
    | Mapping[str, Any]
    | Sequence[LayerRule | Mapping[str, Any]]
    | str
    | os.PathLike
    | None
)


def resolve_policy(policy: PolicySpec) -> GTPPolicy:
    """Turn any accepted form into a GTPPolicy: a policy, a mapping or DictConfig of its
    fields, a list (or tuple, or ListConfig) of rules standing for `GTPPolicy(rules=...)`, a
    YAML path, or None (the default policy). Anything else is a PolicyError naming the forms."""
    if policy is None:
        return GTPPolicy()
    if isinstance(policy, GTPPolicy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        policy = _load_yaml(os.fspath(policy))
    policy = _to_container(policy)
    if isinstance(policy, (list, tuple)):
        policy = {"rules": policy}
    if not isinstance(policy, Mapping):
        raise PolicyError(f"a policy cannot be a {type(policy).__name__}; {_POLICY_FORMS}")
    fields = {f.name for f in dataclasses.fields(GTPPolicy)}
    data = {k: v for k, v in dict(policy).items() if k != "_target_"}
    unknown = set(data) - fields
    if unknown:
        raise PolicyError(f"unknown GTPPolicy field(s) {sorted(unknown)}; valid: {sorted(fields)}")
    if "rules" in data:
        if not isinstance(data["rules"], Sequence) or isinstance(data["rules"], str):
            raise PolicyError(
                f"GTPPolicy.rules must be a list of rules, got {type(data['rules']).__name__}; "
                "e.g. GTPPolicy(rules=[LayerRule('Linear')])"
            )
        data["rules"] = tuple(_coerce_rule(_to_container(r)) for r in data["rules"])
    try:
        return GTPPolicy(**data)
    except TypeError as e:
        raise PolicyError(f"invalid GTPPolicy: {e}") from e


def _to_container(obj: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        return obj
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


def _load_yaml(path: str, including: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """A policy file's fields. A file of a Hydra config group (configs/policy/*.yaml) may start
    from others of its group through a `defaults` list, as Hydra composes it: each name is a
    file beside this one or a built-in policy, `_self_` places this file's own fields (last when
    absent)."""
    if not os.path.isfile(path):
        raise PolicyError(f"policy file {path!r} does not exist")
    if path in including:
        raise PolicyError(f"policy file {path!r} includes itself through its defaults list")
    try:
        from omegaconf import OmegaConf
    except ImportError as e:
        raise PolicyError(
            "loading a policy from YAML needs omegaconf: pip install omegaconf"
        ) from e
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict):
        raise PolicyError(f"policy file {path!r} must hold a mapping of GTPPolicy fields")
    own = {str(k): v for k, v in data.items()}
    defaults = own.pop("defaults", ["_self_"])
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise PolicyError(
            f"policy file {path!r}: its defaults list may only name other policy files beside "
            f"it and _self_, got {defaults!r}; compose anything else with Hydra"
        )
    fields: dict[str, Any] = {}
    for name in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        if name == "_self_":
            fields.update(own)
        else:
            fields.update(_load_yaml(_default_file(path, name), (*including, path)))
    return fields


def _default_file(path: str, name: str) -> str:
    """The policy file a defaults list's `name` means: the one beside `path`, else the
    built-in one (configs/policy/, shipped as gtp_wrap.configs), as gtp-train's Hydra search
    path finds it."""
    sibling = os.path.join(os.path.dirname(path), f"{name}.yaml")
    builtin = str(importlib.resources.files("gtp_wrap.configs") / "policy" / f"{name}.yaml")
    if os.path.isfile(sibling) or not os.path.isfile(builtin):
        return sibling
    return builtin
