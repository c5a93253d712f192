"""Owners: the modules whose own call opens a pass when none is open.

The root's forward opens the model's passes. A submodule called on its own (`model.embed(idx)`
in generation code) must open one too, so its weights are gathered rather than silently used
as local shards: every module that holds managed weights (an owner) gets a forward pre-hook and
an always-called forward hook that open and close a pass around its call when none is open. A
block that runs on its gathered weights (runtime/blocks.py) becomes the owner of everything
inside it, whose own hooks go (see [Note: blocks on gathered weights]): a module inside such a
block, called on its own, opens no pass, and a sharded weight it computes with outside passes
is refused (core/parameter.py), not read as this rank's rows. The block itself carries no hooks
either: its forward (`GatheredBlock`) opens the pass through `call_owned`, which spares each
block call torch's hooked module-call path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import WrapError
from .blocks import refuse_tracing
from .passes import Passes

_graph_task_id = torch._C._current_graph_task_id


class PassOpener(Protocol):
    """What an owner's call asks of the engine."""

    passes: Passes

    def close_abandoned_backward(self) -> None: ...

    def open_forward(
        self, module: nn.Module, args: Any, kwargs: dict, opener: str | None = None
    ) -> Any: ...

    def close_forward(self, module: nn.Module, args: Any, output: Any) -> None: ...

    def end_forward(self, error: BaseException | None, output: Any = None) -> None: ...


class Owners:
    """The owners of one wrapped model: hooked modules, and blocks that open their own pass."""

    def __init__(self, root: nn.Module, owners: list[nn.Module], engine: PassOpener) -> None:
        self._engine = engine
        self._opened: list[bool] = []  # per hooked call in progress: whether it opened a pass
        self._names = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        self._hooks: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}
        # The root's forward opens the model's passes, whatever else is open.
        root.register_forward_pre_hook(self._open_root, with_kwargs=True)
        self._root_close = root.register_forward_hook(engine.close_forward, always_call=True)
        for module in owners:
            if module is not root and id(module) not in self._hooks:
                self._hook(module)

    def name(self, module: nn.Module) -> str:
        """The module's name in the wrapped model (its first, for a module under several)."""
        return self._names[id(module)]

    def take_block(self, block: nn.Module) -> None:
        """Make `block` the one owner of the weights inside it: it and everything inside it
        lose their hooks, and its forward opens its pass through `call_owned`."""
        for module in block.modules():
            for handle in self._hooks.pop(id(module), ()):
                handle.remove()

    def _hook(self, module: nn.Module) -> None:
        self._hooks[id(module)] = (
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post, always_call=True),
        )

    def call_owned(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """`forward(*args, **kwargs)`, the forward of the owner `module`, in a pass of its own
        when none is open (what the hooks do for a hooked owner)."""
        if not self._opens(module):
            return forward(*args, **kwargs)
        engine = self._engine
        try:  # the pass is closed whatever raises, its own opening too (an input cast's OOM)
            converted = engine.open_forward(module, args, kwargs, opener=self.name(module))
            if converted is not None:
                args, kwargs = converted
            out = forward(*args, **kwargs)
        except BaseException as error:
            engine.end_forward(error)
            raise
        engine.end_forward(None, out)
        return out

    def _opens(self, module: nn.Module) -> bool:
        """Whether a call of `module` opens a pass now: none is open, and autograd is not
        running (inside backward, a checkpoint's recompute, uses are intercepted already)."""
        if torch.compiler.is_compiling():
            refuse_tracing(f"the pass that '{self.name(module)}' of a wrapped model opens")
        engine = self._engine
        engine.close_abandoned_backward()
        return not engine.passes.stack and _graph_task_id() == -1

    def _open_root(self, module: nn.Module, args: Any, kwargs: dict) -> Any:
        _span_hooks(module, self._root_close)
        return self._engine.open_forward(module, args, kwargs)

    def _pre(self, module: nn.Module, args: Any, kwargs: dict) -> Any:
        opened = self._opens(module)
        if opened:
            _span_hooks(module, self._hooks[id(module)][1])
        self._opened.append(opened)
        if not opened:
            return None
        return self._engine.open_forward(module, args, kwargs, opener=self.name(module))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._opened and self._opened.pop():
            self._engine.close_forward(module, args, output)


def _span_hooks(module: nn.Module, close: RemovableHandle) -> None:
    """[Note: a pass spans its module's forward hooks] A pass opens in its module's forward
    pre-hook and closes in its forward hook, both registered at wrap. A forward hook the user
    registers later would run after ours, once the pass closed, where a sharded weight holds
    this rank's rows: reading one there under no_grad (a statistic that scales the output)
    would silently use them. So the closing hook is moved back to the end whenever one follows
    it (two dict reads per pass). Pre-hooks keep their order: one registered before wrapping
    (a library's input conversion) runs before the pass opens, as it always did."""
    hooks = module._forward_hooks
    if next(reversed(hooks), None) != close.id:
        if close.id not in hooks:
            raise WrapError(
                "the forward hook GTPWrap registered to close each pass was removed (the "
                "module's _forward_hooks cleared?): wrap the model again"
            )
        hooks[close.id] = hooks.pop(close.id)
