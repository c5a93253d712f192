"""Blocks run on their gathered weights: compiled by `torch.compile`, or eagerly.

[Note: blocks on gathered weights] Dynamo cannot trace a GTPParameter's interception: its
`__torch_function__` runs the engine (the pass stack, the chains, collectives), host state that
a graph cannot hold. So a compiled block does what FSDP2 does for compiled code: its weights are
gathered before the compiled forward runs, one use each along the chain, wired so that their
gradients reach the reducer, and put in the module slots where the parameters sit; the compiled
code sees plain tensors, and the parameters go back when it returns. Everything the block saves
for backward passes through the forward pass's saved-tensor hooks like any other saved tensor, so
a saved weight is rematerialized in backward, never kept alive (see runtime/gather.py).

The same without compiling (`gather_per_block`) saves host time in eager mode: the ops inside the
block no longer pass through the interception one by one, and the block's weights are one
autograd node.

One compiled function per block class serves every block of that class. For that the modules
inside a block carry no hooks of ours: Dynamo guards on module hook ids, so hooked submodules
would compile once per block and exhaust its cache (8 blocks). The block itself is the owner
that opens a pass when it is called on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import torch
from torch import nn
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ..core.parameter import GTPParameter
from ..core.weight import CastWeight, ShardedWeight
from ..errors import WrapError
from .gather import BlockMembers


class BlockRuntime(Protocol):
    """What a block on gathered weights asks of its engine."""

    def begin_block(self, members: BlockMembers) -> tuple[list[torch.Tensor], Any]:
        """The weights one use of each member sees, as in an intercepted use, for the time of
        the block's forward; and what `end_block` takes to close it."""
        ...

    def end_block(self, outer: Any) -> None: ...


class BlockOwner(Protocol):
    """How a block's call opens a pass when none is open (runtime/owners.py)."""

    def call_owned(
        self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict
    ) -> Any: ...


class GatheredBlock:
    """The forward of one block: in a pass of its own when called outside one, gather its
    weights, swap them in, run its forward (compiled or not), swap the parameters back."""

    __slots__ = ("name", "block", "forward", "members", "slots", "runtime", "owner")

    def __init__(
        self,
        name: str,
        block: nn.Module,
        forward: Callable,
        runtime: BlockRuntime,
        owner: BlockOwner,
    ) -> None:
        self.name = name  # in the wrapped model, for errors
        self.block = block
        self.forward = forward  # the block class's forward (compiled or not): takes the block
        self.runtime = runtime
        self.owner = owner
        params: list[GTPParameter] = []  # each managed parameter once (tied ones too)
        # Every slot that holds one of them: (the module's parameter dict, name, which).
        self.slots: list[tuple[dict[str, Any], str, int]] = []
        index: dict[int, int] = {}
        for module in block.modules():
            for name, p in module._parameters.items():
                if type(p) is GTPParameter:
                    if id(p) not in index:
                        index[id(p)] = len(params)
                        params.append(p)
                    self.slots.append((module._parameters, name, index[id(p)]))
        self.members = BlockMembers.of(params)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.call_owned(self.block, self._gathered, args, kwargs)

    def _gathered(self, *args: Any, **kwargs: Any) -> Any:
        weights, outer = self.runtime.begin_block(self.members)
        try:
            for slot, name, which in self.slots:
                slot[name] = weights[which]
            versions = [w._version for w in weights]
            try:
                out = self.forward(self.block, *args, **kwargs)
            except Exception as error:
                if type(error).__name__ != "InternalTorchDynamoError":
                    raise
                # Dynamo fails inside when it meets a managed parameter: one the block reads
                # from a module outside it, so it was not swapped in.
                raise WrapError(
                    f"torch.compile failed inside block '{self.name}' ({error}). Where the "
                    "block reads a sharded weight that a module outside it holds, Dynamo "
                    "cannot trace it (only the block's own weights are gathered before it "
                    "runs): compile a block that holds every weight it reads, or leave this "
                    "one eager"
                ) from error
            finally:
                for slot, name, which in self.slots:
                    slot[name] = self.members.params[which]
            for w, version, member in zip(weights, versions, self.members.weights):
                if w._version != version:
                    _refuse_write(self.name, member)
            return out
        finally:
            self.runtime.end_block(outer)


def _refuse_write(block: str, member: ShardedWeight | CastWeight) -> NoReturn:
    """[Note: writes inside a block] A block on gathered weights sees plain tensors: an
    in-place write to one (`nn.Embedding(max_norm=...)`'s renorm, a user's `weight.mul_()`
    under no_grad) changes the gathered copy, which the next gather overwrites, not the
    parameter, so training would silently differ from the unwrapped model's. Per-use
    interception refuses such a write before it happens; here the block's weights' version
    counters, read before and after its forward, catch it after (a few integer reads per call)."""
    fqn = member.fqns[0] if isinstance(member, ShardedWeight) else member.fqn
    raise WrapError(
        f"block '{block}' wrote in place to its weight '{fqn}' while "
        "running on its gathered weights: the write changes the gathered copy only. Replicate "
        "weights that a forward writes (a LayerRule with action='replicate'), or leave this "
        "block to per-use gathers (no gather_per_block or compile for it)"
    )


def refuse_tracing(where: str) -> NoReturn:
    """Raise the error for Dynamo tracing into a wrapped model's own hooks, from outside the
    trace (a raise inside it would make Dynamo fall back to eager without a word)."""
    torch.compiler.disable(_refuse)(where)
    raise AssertionError("unreachable")  # for type checkers: _refuse always raises


def _refuse(where: str) -> NoReturn:
    raise WrapError(
        f"torch.compile traced into {where}: Dynamo cannot trace GTP's sharded parameters, "
        "whose every use gathers the weight. Compile the model's blocks instead, with "
        "gtp_wrap.compile(model) (or gtp_wrap.compile(model, blocks=[...])): each block then "
        "runs compiled on its gathered weights. Compile before wrapping does not work either; "
        "wrap first, then call gtp_wrap.compile"
    )


def refuse_transforms() -> None:
    """[Note: torch.func transforms] A forward under functorch's transforms (torch.func.grad,
    vjp, jvp, jacrev, vmap with autograd) cannot run the engine: its passes save through
    saved-tensor hooks, which functorch's grad transforms refuse, and route gradients through
    autograd Functions without the `setup_context` that vmap and jvp require, so each failed
    inside the engine. Without autograd (a frozen model run under no_grad inside a transform,
    or `vmap`) neither is used, and the forward runs; the rest is refused here, before
    anything is gathered (jvp, whose dual tensors reach the gather buffers, included)."""
    kinds = {i.key() for i in retrieve_all_functorch_interpreters()}
    if not torch.is_grad_enabled() and TransformType.Jvp not in kinds:  # a frozen teacher
        return
    raise WrapError(
        "a wrapped model's forward ran under a torch.func transform (grad, vjp, jvp, jacrev, "
        "functionalize, or vmap with autograd), which the engine's gathers cannot run under. A "
        "forward under torch.no_grad() inside one (vmap, a frozen model) works; for "
        "gradients, call backward() on the batch (per-sample gradients: one backward per "
        "sample), or transform the unwrapped model"
    )
