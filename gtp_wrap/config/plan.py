"""Rule matching: the policy applied to a module's parameters, once, at wrap time.

Each parameter's plan records why it is sharded or replicated (the deciding rule and the reason
in words), which `gtp_wrap.describe` reports after wrapping. Mistakes that would otherwise pass
silently warn with `PolicyWarning` (or raise PolicyError under `strict`): a rule that matches
nothing, a policy that shards no weight, and a shared weight whose owners' rules disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import warnings

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..errors import PolicyError, PolicyWarning, WrapError
from .policy import DEFAULT_RULES, GTPPolicy, LayerRule, TPStyle

# A parameter's owners: (its FQN through that owner, the owning module, its name there).
_Entries = list[tuple[str, nn.Module, str]]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Why one parameter is sharded or replicated: plain data, kept after wrapping."""

    fqns: tuple[str, ...]
    rule: LayerRule | None  # the rule that decided it; None: no rule matched it
    reason: str  # in words: "rule 'Linear'", "below min_shard_numel (2048 < 16384)", ...


@dataclasses.dataclass(frozen=True)
class ParameterPlan:
    """The policy's decision for one unique parameter (shared parameters appear once)."""

    fqns: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    param: nn.Parameter
    shard_dim: int | None  # None: replicated
    rule: LayerRule | None  # as in Decision
    reason: str
    keep_dtype: bool  # a running-statistics norm's parameter, not cast (GTPPolicy.norm_in_fp32)

    @property
    def expert(self) -> bool:
        """Whether it is an expert stack, placed over the expert mesh (`group="egtp"`)."""
        return self.shard_dim is not None and self.rule is not None and self.rule.group == "egtp"

    def decision(self) -> Decision:
        """The decision alone, without references to the module or the parameter."""
        return Decision(self.fqns, self.rule, self.reason)


def is_stat_norm(module: nn.Module) -> bool:
    """Whether `module` is a normalization layer with (optional) running statistics, which
    computes in fp32 under a param_dtype (see GTPPolicy.norm_in_fp32)."""
    return isinstance(module, _NormBase)


def plan_parameters(
    module: nn.Module, policy: GTPPolicy, global_numel: dict[int, int] | None = None
) -> list[ParameterPlan]:
    """Apply `policy` to every unique parameter of `module`, in registration order.
    `global_numel`: by parameter id, the element count a tensor-parallel parameter has over
    every tp rank, which `min_shard_numel` is compared with (its tp blocks may differ)."""
    global_numel = global_numel or {}
    owners: dict[int, _Entries] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_fqn, mod in module.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            owners.setdefault(id(p), []).append((fqn, mod, name))
            params[id(p)] = p

    rule_classes = [r.resolve_class() for r in policy.rules]
    used = [False] * len(policy.rules)
    plans = []
    for key, p in params.items():
        entries = owners[key]
        _refuse_sparse_gradients(entries)
        matching = [
            i
            for i, rule in enumerate(policy.rules)
            if _rule_matches(rule, rule_classes[i], p, entries)
        ]
        for i in matching:
            used[i] = True
        chosen = policy.rules[matching[0]] if matching else None
        keep_dtype = (
            policy.param_dtype is not None
            and policy.norm_in_fp32
            and any(is_stat_norm(mod) for _, mod, _ in entries)
        )
        numel = global_numel.get(key, p.numel())
        shard_dim, reason = _decide(chosen, p, entries, policy, keep_dtype, numel)
        if len(entries) > 1 and matching:
            reason += _shared_note(policy, rule_classes, p, entries, matching[0])
        plans.append(
            ParameterPlan(
                fqns=tuple(dict.fromkeys(f for f, _, _ in entries)),
                owners=tuple((m, n) for _, m, n in entries),
                param=p,
                shard_dim=shard_dim,
                rule=chosen,
                reason=reason,
                keep_dtype=keep_dtype,
            )
        )
    for rule, hit in zip(policy.rules, used):
        if rule.tp is not None:  # matched against modules (plan_tensor_parallel)
            continue
        if not hit and (rule.strict or (policy.strict and rule not in DEFAULT_RULES)):
            why = "strict rule" if rule.strict else "rule"
            raise PolicyError(
                f"{why} {rule.match!r} matched no parameter of {type(module).__name__}"
                f"{_close_matches(rule, module)}; check the class name or FQN glob, or drop "
                f"{'strict=True' if rule.strict else 'GTPPolicy.strict'}"
            )
        if not hit and rule not in DEFAULT_RULES:
            warnings.warn(
                f"rule {rule.match!r} matched no parameter of {type(module).__name__}"
                f"{_close_matches(rule, module)}; check the class name or FQN glob (strict=True "
                "makes this an error)",
                PolicyWarning,
                stacklevel=3,
            )
    _check_something_sharded(module, policy, plans)
    return plans


def _refuse_sparse_gradients(entries: _Entries) -> None:
    """An embedding with `sparse=True` gives a sparse gradient, which neither a weight's
    reduce-scatter nor the replicated weights' bucketed all-reduce can take (each failed in
    backward, inside the engine)."""
    for fqn, mod, _ in entries:
        sparse = isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse
        if sparse and mod.weight.requires_grad:
            raise WrapError(
                f"'{fqn}' belongs to an {type(mod).__name__} with sparse=True, whose sparse "
                "gradients GTP cannot reduce (sharded or replicated): build it with "
                "sparse=False (dense gradients, which AdamW and most optimizers need anyway)"
            )


def _decide(
    rule: LayerRule | None,
    param: torch.Tensor,
    entries: _Entries,
    policy: GTPPolicy,
    keep_dtype: bool,
    numel: int,
) -> tuple[int | None, str]:
    """(shard dim or None, the reason in words) for a parameter that `rule` decides; `numel`:
    its element count over every tp rank."""
    if rule is None:
        return None, "no rule"
    if rule.action == "replicate":
        return None, f"rule {rule.match!r} (replicate)"
    if rule.dim >= param.dim():
        raise PolicyError(
            f"rule {rule.match!r} shards '{entries[0][0]}' along dim {rule.dim}, but that "
            f"parameter has shape {tuple(param.shape)}; use a dim below {param.dim()}"
        )
    if keep_dtype:
        # Gathered, it would arrive in param_dtype next to fp32 running statistics.
        return None, "a running-statistics norm's, kept in fp32 (norm_in_fp32)"
    if numel == 0:
        return None, "empty"
    if rule.group == "egtp":  # an expert stack goes over the expert mesh whatever its size
        return rule.dim, f"rule {rule.match!r} (expert group)"
    if numel < policy.min_shard_numel:
        return None, f"below min_shard_numel ({numel} < {policy.min_shard_numel})"
    return rule.dim, f"rule {rule.match!r}"


def _shared_note(
    policy: GTPPolicy,
    rule_classes: list[type | None],
    param: torch.Tensor,
    entries: _Entries,
    winner: int,
) -> str:
    """For a parameter shared by several owners whose own first matching rules differ: which
    rule won and why, appended to its reason; a PolicyWarning too when the losing rule would
    have decided otherwise (another action or dim), since the user may have meant it."""
    firsts: dict[int, str] = {}
    for entry in entries:
        for i, rule in enumerate(policy.rules):
            if _rule_matches(rule, rule_classes[i], param, [entry]):
                firsts.setdefault(i, entry[0])
                break
    losers = [i for i in firsts if i != winner]
    if not losers:
        return ""
    won = policy.rules[winner]
    lost = ", ".join(f"rule {policy.rules[i].match!r} through '{firsts[i]}'" for i in losers)
    detail = (
        f"shared as {', '.join(repr(e[0]) for e in entries)}: also matched by {lost}, but rule "
        f"{won.match!r} (through '{firsts[winner]}') comes first in rule order"
    )
    if any((policy.rules[i].action, policy.rules[i].dim) != (won.action, won.dim) for i in losers):
        warnings.warn(
            f"a parameter {detail}, so it takes action {won.action!r}, dim {won.dim}; reorder "
            "the rules if the other was meant",
            PolicyWarning,
            stacklevel=4,
        )
    note = f"; {detail}"
    return note


def _check_something_sharded(
    module: nn.Module, policy: GTPPolicy, plans: list[ParameterPlan]
) -> None:
    """A policy with shard rules that shards nothing (every weight below min_shard_numel, or
    rules that miss) warns, or raises under GTPPolicy.strict; one without shard rules (GTP off,
    `rules: []`) means it."""
    if not plans or any(p.shard_dim is not None for p in plans):
        return
    if not any(rule.action == "shard" and rule.tp is None for rule in policy.rules):
        return
    candidates = [p for p in plans if p.rule is not None and p.rule.action == "shard"]
    if candidates:
        big = max(candidates, key=lambda p: p.param.numel())
        fix = (
            f"the largest weight a rule shards, '{big.fqns[0]}', has {big.param.numel()} "
            f"elements, below min_shard_numel={policy.min_shard_numel}: lower min_shard_numel "
            "(0 shards every matched weight)"
        )
    else:
        fix = "no shard rule matched a weight of two or more dims: check the rules"
    message = (
        f"the policy shards no weight of {type(module).__name__}, so every parameter stays "
        f"replicated: {fix}"
    )
    if policy.strict:
        raise PolicyError(message + ", or drop GTPPolicy.strict")
    warnings.warn(message, PolicyWarning, stacklevel=4)


def _close_matches(rule: LayerRule, module: nn.Module) -> str:
    """' (did you mean ...?)' with the model's class names or FQNs closest to `rule.match`."""
    classes = {
        c.__name__
        for m in module.modules()
        for c in type(m).__mro__
        if c not in (nn.Module, object)
    }
    prefix, _, last = rule.match.rpartition(".")
    named = last if prefix else rule.match
    if not rule.is_fqn_glob and named in classes:
        # The class is there: a class rule takes the parameters its modules hold themselves.
        own = [
            p
            for m in module.modules()
            if any(c.__name__ == named for c in type(m).__mro__)
            for p in m._parameters.values()
            if p is not None
        ]
        if not own:
            return (
                f" ({named} holds no parameters itself, its submodules do: name their class, "
                "or an FQN glob)"
            )
        return (
            " (its modules' parameters are all 1-D: a class rule shards parameters of two or "
            "more dims; name a 1-D parameter by its FQN to shard it)"
        )
    if prefix and last[:1].isupper() and not rule.is_fqn_glob:  # a dotted class path
        close = [f"{prefix}.{c}" for c in difflib.get_close_matches(last, sorted(classes))]
    else:
        params = {n for n, _ in module.named_parameters()}
        modules = {n for n, _ in module.named_modules()} - {""}
        close = difflib.get_close_matches(rule.match, sorted(classes | params | modules))
        # A module's name matches none of its parameters' FQNs: its glob does.
        close = [f"{c}.*" if c in modules and c not in classes else c for c in close]
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def _rule_matches(
    rule: LayerRule,
    rule_class: type | None,
    param: torch.Tensor,
    entries: _Entries,
) -> bool:
    if rule.tp is not None:  # a tensor-parallel style for modules, no sharding decision
        return False
    if rule.is_fqn_glob:
        return any(fnmatch.fnmatchcase(fqn, rule.match) for fqn, _, _ in entries)
    if param.dim() < 2 and rule.action == "shard":
        by_fqn = any(fqn == rule.match for fqn, _, _ in entries)
        return by_fqn
    for fqn, mod, _ in entries:
        if fqn == rule.match:
            return True
        if rule_class is not None:
            if isinstance(mod, rule_class):
                return True
        elif is_of_class_named(mod, rule.match):
            return True
    return False


def plan_tensor_parallel(module: nn.Module, policy: GTPPolicy) -> dict[str, TPStyle]:
    """The tensor-parallel style of each module the policy's `tp` rules match, by module FQN
    (the first matching rule decides, as for parameters). A `tp` rule that matches no module
    is a PolicyError: a plan naming a module that does not exist would leave it unsplit."""
    plan: dict[str, TPStyle] = {}
    for rule in policy.rules:
        if rule.tp is None:
            continue
        rule_class = rule.resolve_class()
        hits = [
            fqn
            for fqn, mod in module.named_modules()
            if fqn and _module_matches(rule, rule_class, fqn, mod)
        ]
        if not hits:
            raise PolicyError(
                f"tensor-parallel rule {rule.match!r} (tp: {rule.tp}) matched no module of "
                f"{type(module).__name__}{_close_matches(rule, module)}; a tp rule matches a "
                "module FQN, a glob over module FQNs, or a class name"
            )
        for fqn in hits:
            plan.setdefault(fqn, rule.tp)
    return plan


def blocks_on_gathered_weights(module: nn.Module, policy: GTPPolicy) -> list[nn.Module]:
    """The modules `policy.gather_per_block` names (class names, FQNs, globs); a PolicyWarning
    when it names some and none matches."""
    names = policy.gather_per_block
    found = [
        mod
        for fqn, mod in module.named_modules()
        if fqn and any(module_matches(n, fqn, mod) for n in names)
    ]
    if names and not found:
        warnings.warn(
            f"gather_per_block {list(names)} matched no module of {type(module).__name__}; "
            "check the class names or FQN globs",
            PolicyWarning,
            stacklevel=3,
        )
    return found


def module_matches(name: str, fqn: str, mod: nn.Module) -> bool:
    """Whether a policy's module name (a class name, a module FQN or a glob over them) names
    the module `mod` registered at `fqn`."""
    return _module_matches(LayerRule(match=name), None, fqn, mod)


def _module_matches(rule: LayerRule, rule_class: type | None, fqn: str, mod: nn.Module) -> bool:
    if rule.is_fqn_glob:
        return fnmatch.fnmatchcase(fqn, rule.match)
    if fqn == rule.match:
        return True
    return isinstance(mod, rule_class) if rule_class else is_of_class_named(mod, rule.match)


def is_of_class_named(module: nn.Module, name: str) -> bool:
    """Whether `module` is an instance of a class called `name` (its own or a base class)."""
    return any(c.__name__ == name for c in type(module).__mro__)
