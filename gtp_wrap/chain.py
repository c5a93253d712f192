"""Prefetch chains: the recorded order in which a pass gathers its weights.

A pass (a forward with grad, a forward without grad, a backward) replays the chain its kind
recorded last time. While the uses match the chain, each use finds its weight already gathered
and issues the gather of the next; only the chain head blocks. A use that does not match marks
the pass diverged: the gathers in flight are drained (every rank issued the same ones, because
they followed the same chain) and the pass gathers synchronously and records anew.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from .buffers import GatherBuffer
from .comm import Pending
from .storage import ShardLayout


class PassKind(enum.Enum):
    FORWARD = "forward"
    FORWARD_NO_GRAD = "forward_no_grad"
    BACKWARD = "backward"


@dataclasses.dataclass
class Gather:
    """A gather issued into a buffer; `position` is its place in the chain (None off-chain)."""

    layout: ShardLayout
    buffer: GatherBuffer
    pending: Pending
    position: int | None


@dataclasses.dataclass
class PassState:
    """The progress of one pass along its chain."""

    kind: PassKind
    scope: str | None  # None: the model's own pass; a name: a graphed region's
    chain: tuple[int, ...] | None
    cursor: int = 0
    diverged: bool = False
    recorded: list[int] = dataclasses.field(default_factory=list)
    inflight: collections.deque[Gather] = dataclasses.field(default_factory=collections.deque)
    exit_hooks: object | None = None  # the saved-tensor hooks context this pass entered

    def expects(self, index: int) -> bool:
        """Whether the next use in the recorded chain is the weight `index`."""
        return (
            self.chain is not None
            and not self.diverged
            and self.cursor < len(self.chain)
            and self.chain[self.cursor] == index
        )

    def next_to_prefetch(self, depth: int) -> int | None:
        """The chain position to prefetch next, if fewer than `depth` gathers are in flight."""
        if self.chain is None or self.diverged or len(self.inflight) >= depth:
            return None
        position = self.cursor + len(self.inflight)
        return position if position < len(self.chain) else None

    def followed_chain(self) -> bool:
        """Whether the pass used exactly the recorded chain (so nothing needs recording)."""
        return self.chain is not None and not self.diverged and self.cursor == len(self.chain)


def first_difference(chains: list[list[int]]) -> tuple[int, list[int | None]] | None:
    """The first position where the ranks' chains differ and each rank's entry there."""
    longest = max(len(c) for c in chains)
    for pos in range(longest):
        entries = [c[pos] if pos < len(c) else None for c in chains]
        if len(set(entries)) > 1:
            return pos, entries
    return None
