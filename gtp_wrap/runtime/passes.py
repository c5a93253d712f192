"""The passes of one engine: which are open, and the chains they follow and record.

A pass is a forward with grad, a forward without grad, or a backward. Passes nest (a forward
called inside backward, from a hook or a checkpoint recompute), so they form a stack. Each
pass follows the chain its kind recorded last (runtime/chain.py); one that diverged records
anew when it ends, after the ranks agree on what it recorded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.agreement import Agreement, first_difference
from ..core.parameter import OpenPasses
from ..core.weight import ShardedWeight
from ..errors import ChainMismatchError
from .chain import Chain, PassKind, PassState

# The fix every error about ranks' orders of weights names.
SAME_ORDER = (
    "GTP gathers weights collectively, so every rank must run the same weights in the same "
    "order (make data-dependent branches agree across ranks)"
)


class Passes:
    """The pass stack and the recorded chains of one engine."""

    def __init__(
        self,
        weights: list[ShardedWeight],
        agreement: Agreement,
        group_numel: int,
        gathers: bool,
        step: Callable[[], int],
    ) -> None:
        self.stack: list[PassState] = []
        # Chains per pass kind, scope and opener (PassState.key): the scope is None for the
        # model's own passes and a name for each CUDA-graphed region, whose passes run
        # standalone at capture and never mix with ours.
        self.chains: dict[tuple[PassKind, str | None, str | None], Chain] = {}
        self.scope: str | None = None
        self._weights = weights
        self._agreement = agreement
        self._group_numel = group_numel
        # Only weights sharded over more than one rank are gathered, and recorded: groups of
        # one gather nothing, so ranks have nothing to agree on.
        self._records = gathers
        self._step = step

    def intercepting(self) -> bool:
        """Whether uses of managed parameters see full weights now. A pure query: it runs on
        every torch function that takes one, so it never changes state."""
        if torch._C._current_graph_task_id() != -1:
            return True
        stack = self.stack
        # A backward pass open outside backward was abandoned (see `abandoned`).
        return bool(stack) and (stack[-1].kind is not PassKind.BACKWARD or len(stack) > 1)

    def abandoned(self) -> bool:
        """Whether the top pass is a backward still open outside backward: its backward raised,
        so autograd skipped the end-of-backward callback. Inside backward (a forward called
        from a hook) the pass is live."""
        return (
            bool(self.stack)
            and self.stack[-1].kind is PassKind.BACKWARD
            and torch._C._current_graph_task_id() == -1
        )

    def in_backward(self) -> bool:
        return bool(self.stack) and self.stack[-1].kind is PassKind.BACKWARD

    def begin(self, kind: PassKind, opener: str | None = None) -> PassState:
        state = PassState(kind, self.scope, None, opener=opener)
        state.chain = self.chains.get(state.key)
        self.stack.append(state)
        OpenPasses.open()
        return state

    def pop(self) -> PassState:
        OpenPasses.close()
        return self.stack.pop()

    def record(self, state: PassState) -> None:
        """Keep the chain a finished pass used, if it changed, once every rank used the same.

        A pass that failed records nothing (the engine does not call this): its uses stopped
        part-way; its peers learn of the failure from the failure notice the engine posts
        (PeerFailedError at their own check), or at worst by timing out there.
        """
        if state.followed_chain() or not self._records:
            return
        purpose = _check_key("chain", state)
        which = self.describe(state)
        what = f"the check that every rank used the same weights in the same order in {which}"
        diff = first_difference(self._agreement.exchange(purpose, state.recorded, what))
        if diff is not None:
            pos, entries = diff
            names = [self._weights[e].fqn if e is not None else "<end of pass>" for e in entries]
            per_rank = ", ".join(f"rank {r}: '{n}'" for r, n in enumerate(names))
            raise ChainMismatchError(
                f"ranks used their sharded weights in different orders in {which}: use #{pos} is "
                f"{per_rank}. {SAME_ORDER}"
            )
        self.chains[state.key] = Chain.build(state.recorded, self._weights, self._group_numel)

    def describe(self, state: PassState) -> str:
        """The pass in a user's words, for errors ("the forward pass of step 2")."""
        return state.describe(self._step())

    def agree_to_diverge(self, state: PassState, index: int) -> None:
        """Before a pass leaves its chain at a use of weight `index`: every rank leaves it at the
        same use, or all raise ChainMismatchError.

        [Note: leaving the chain together] A rank whose use the chain did not expect gathers
        that weight on its own, while a peer that still follows the chain issues its next
        group's gather: the two collectives pair, with different sizes where the group held
        more weights than one, and gloo aborts the process ("Received data size doesn't match
        expected size"; NCCL mixes data or hangs) before the pass-end check could name the
        ranks. So the ranks first meet at this check, through the store, with where each left
        the chain. Where all left it alike (a branch every rank took) they go on and record
        anew; a peer that did not come waits in a collective this rank never issues, which
        the watch on both sides names as a deadlock within seconds. Passes leave their chains
        only when the model's access pattern changes, so steady steps never pay for it."""
        which = self.describe(state)
        what = f"the check that every rank left the recorded order of weights alike in {which}"
        purpose = _check_key("diverge", state)
        per_rank = self._agreement.exchange(purpose, [state.cursor, index], what)
        if first_difference(per_rank) is not None:
            uses = ", ".join(
                f"rank {r}: use #{cursor} '{self._weights[i].fqn}'"
                for r, (cursor, i) in enumerate(per_rank)
            )
            raise ChainMismatchError(
                f"ranks left the recorded order of weights differently in {which} ({uses}). "
                f"{SAME_ORDER}"
            )

    def region_weights(self, scope: str) -> set[int]:
        """The weights (indices) the passes of a graphed region's scope use."""
        kinds = (PassKind.FORWARD, PassKind.BACKWARD)
        chains = [self.chains.get((kind, scope, None)) for kind in kinds]
        return {index for chain in chains if chain is not None for index in chain.order}


def _check_key(check: str, state: PassState) -> str:
    """The agreement key of `check` for passes like `state`: its kind, scope and opener, so
    that ranks at checks of different passes never pair."""
    return f"{check}-{state.kind.value}-{state.scope}-{state.opener}"
