"""Parameters added to a wrapped model after GTPWrap are refused where they are registered.

[Note: parameters added after wrapping] The engine manages the parameters a model had when it
was wrapped: each is sharded, or replicated with its gradient averaged across ranks. A parameter
registered later (a LoRA adapter injected by `get_peft_model`, a new head, `register_parameter`)
is a plain parameter that no engine knows: its gradient is never averaged, so each rank trains
its own copy, silently. torch calls its global registration hooks for every module and
parameter registered anywhere in the process; the modules inside wrapped models are known from
a weak set filled at wrap, so the check is a set lookup per registration, and nothing per step.
A module moved within the model (an adapter's wrapper around the layer it replaces) passes if
every parameter it brings is one the engine already manages.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..errors import WrapError

_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the modules of wrapped models
# Their parameters by id (tensors compare elementwise, so no WeakSet of them).
_PARAMS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_installed = False


def refuse_additions(root: nn.Module) -> None:
    """Refuse, from now on, parameters registered inside the wrapped model `root` that it did
    not have when it was wrapped."""
    global _installed
    _known(root)
    if not _installed:
        register_module_module_registration_hook(_on_module)
        register_module_parameter_registration_hook(_on_parameter)
        _installed = True


# Each module's name in its wrapped model, for errors.
_NAMES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _known(module: nn.Module, prefix: str = "") -> None:
    for name, m in module.named_modules(prefix=prefix):
        _MODULES.add(m)
        _NAMES.setdefault(m, name)
    _PARAMS.update((id(p), p) for p in module.parameters())


def _fqn(parent: nn.Module, name: str) -> str:
    outer = _NAMES.get(parent, "")
    return f"{outer}.{name}" if outer else name


def _on_module(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    if module is None or parent not in _MODULES:
        return
    where = _fqn(parent, name)
    for fqn, p in module.named_parameters():
        if _PARAMS.get(id(p)) is not p:
            _refuse(f"'{where}.{fqn}' (of the {type(module).__name__} set as '{where}')")
    _known(module, where)


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is not None and module in _MODULES and _PARAMS.get(id(param)) is not param:
        _refuse(f"'{_fqn(module, name)}' (registered on a {type(module).__name__})")


def _refuse(what: str) -> None:
    raise WrapError(
        f"the parameter {what} was added to a model after GTPWrap, or replaced one it had "
        "(as load_state_dict(assign=True) does); GTPWrap manages only the parameters the model "
        "had when it was wrapped, so its gradient would not be averaged across ranks and each "
        "rank would train its own copy. Load without assign=True (the values are copied in), "
        "add it before wrapping (for LoRA: get_peft_model, then GTPWrap), or build the model "
        "again with it"
    )
