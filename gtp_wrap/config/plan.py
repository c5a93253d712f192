"""Rule matching: the policy applied to a module's parameters, once, at wrap time."""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from ..errors import PolicyError
from .policy import GTPPolicy, LayerRule


@dataclasses.dataclass(frozen=True)
class ParameterPlan:
    """The policy's decision for one unique parameter (shared parameters appear once)."""

    fqns: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    param: nn.Parameter
    shard_dim: int | None  # None: replicated


def plan_parameters(module: nn.Module, policy: GTPPolicy) -> list[ParameterPlan]:
    """Apply `policy` to every unique parameter of `module`, in registration order."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
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
        fqns = tuple(dict.fromkeys(f for f, _, _ in entries))
        chosen = None
        for i, rule in enumerate(policy.rules):
            if _rule_matches(rule, rule_classes[i], p, entries):
                chosen, used[i] = rule, True
                break
        shard_dim = None
        if chosen is not None and chosen.action == "shard":
            if chosen.dim >= p.dim():
                raise PolicyError(
                    f"rule {chosen.match!r} shards '{fqns[0]}' along dim {chosen.dim}, but that "
                    f"parameter has shape {tuple(p.shape)}; use a dim below {p.dim()}"
                )
            if p.numel() >= policy.min_shard_numel and p.numel() > 0:
                shard_dim = chosen.dim
        plans.append(
            ParameterPlan(
                fqns=fqns,
                owners=tuple((m, n) for _, m, n in entries),
                param=p,
                shard_dim=shard_dim,
            )
        )
    for rule, hit in zip(policy.rules, used):
        if rule.strict and not hit:
            raise PolicyError(
                f"strict rule {rule.match!r} matched no parameter of {type(module).__name__}; "
                "check the class name or FQN glob, or drop strict=True"
            )
    return plans


def _rule_matches(
    rule: LayerRule,
    rule_class: type | None,
    param: torch.Tensor,
    entries: list[tuple[str, nn.Module, str]],
) -> bool:
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
        elif any(c.__name__ == rule.match for c in type(mod).__mro__):
            return True
    return False
