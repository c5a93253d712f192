"""Prefetch chains: the recorded order in which a pass gathers its weights.

A pass (a forward with grad, a forward without grad, a backward) replays the chain its kind
recorded last time. The chain is cut into groups of consecutive uses (see `Chain`); a group's
gathers are issued together as one collective. While the uses match the chain, each use finds
its weight already gathered, and the first use of a group issues the next group; only the chain
head blocks. A use that does not match marks the pass diverged: the gathers in flight are
drained (every rank issued the same ones, because they followed the same chain) and the pass
gathers synchronously and records anew.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from ..comm.comm import Pending
from ..core.weight import ShardedWeight
from .buffers import GatherBuffer


class PassKind(enum.Enum):
    FORWARD = "forward"
    FORWARD_NO_GRAD = "forward_no_grad"
    BACKWARD = "backward"

    @property
    def label(self) -> str:
        """The pass in a user's words, for messages."""
        return _LABELS[self]


_LABELS = {
    PassKind.FORWARD: "forward pass",
    PassKind.FORWARD_NO_GRAD: "evaluation forward pass (no grad)",
    PassKind.BACKWARD: "backward pass",
}


@dataclasses.dataclass
class Gather:
    """A gather issued into a buffer."""

    weight: ShardedWeight
    buffer: GatherBuffer
    pending: Pending


@dataclasses.dataclass(frozen=True)
class Chain:
    """A recorded order of uses (weight indices), cut into groups gathered as one collective.

    [Note: grouped gathers] On NVLink a collective of a few MB is latency-bound: one transformer
    layer's seven weights take 0.37 ms gathered one by one and 0.25 ms as one grouped launch, which
    moves them as fast as one flat buffer of the same bytes would, and costs one launch of host time
    instead of seven (2xH200, `benchmarks/collectives.py`). So consecutive uses are grouped until
    their full weights reach `group_numel` elements; each weight keeps its own buffer.
    """

    order: tuple[int, ...]
    group_of: tuple[int, ...]  # per position: the index of its group
    group_stop: tuple[int, ...]  # per group: the position after its last use
    # Per position: the last group the prefetch may issue while that use is the latest, beyond
    # `prefetch_depth` groups: the end of the next block call (-1: none ahead). See [Note: a
    # block's weights in one group].
    reach: tuple[int, ...]

    @classmethod
    def build(cls, order: list[int], weights: list[ShardedWeight], group_numel: int) -> Chain:
        """Cut `order` (indices into `weights`) greedily: a group closes once its weights reach
        `group_numel` elements (0: one use per group), but not between the expert stacks of
        one layer (one collective for them all), nor inside a block on gathered weights; and
        before a weight sharded over another group (an expert stack after dense weights), which
        needs a collective of its own.

        [Note: a block's weights in one group] A block on gathered weights (runtime/blocks.py)
        takes all of its weights before it computes, one after the other, and the first use of
        a group issues the next `prefetch_depth` groups. Cut inside a block by size, its later
        groups would be issued only as the block starts, and waited for at once, with no
        compute to hide them; so a block's weights stay in one group (or in as few as their
        axes allow), and the next block's gathers are in flight while a block computes, as
        FSDP2 prefetches the next module's. The cost: a group of at least a block, gathered
        ahead while the current block's are held (a block held them all anyway). A block whose
        weights lie on two axes (dense weights, then expert stacks over egtp) is still cut
        where the axis changes, so the prefetch also reaches, whatever `prefetch_depth` says,
        to the end of the next block call (`reach`): its expert stacks are in flight with its
        dense weights. A weight that two blocks share carries the last one's place, so the
        other may be cut beside it (performance only: the cut is the same on every rank). The
        cost model (`gtp-plan --method gtp_blocks`) put the cut by size at 83.1 ms per graphed
        1.36B step on 8 H200s with prefetch_depth 1 (63.8 per use), and this cut at 62.9;
        eager at batch 1 on 2, 99.1 against 95.2 ms; the seed's 280B MoE at GTP16, EP8, EGTP2
        (graphed), 3087 ms with one group ahead against 2672 with the next block's. These are
        predictions: no run on two or more GPUs has measured this cut yet."""
        group_of: list[int] = []
        group_stop: list[int] = []
        size = 0
        for position, index in enumerate(order):
            group_of.append(len(group_stop))
            w = weights[index]
            size += w.geometry.gathered_numel
            nxt = weights[order[position + 1]] if position + 1 < len(order) else None
            inside = nxt is not None and (
                (w.unit is not None and nxt.unit == w.unit) or _same_block_call(w, nxt)
            )
            if nxt is None or nxt.axis is not w.axis or (size >= group_numel and not inside):
                group_stop.append(position + 1)
                size = 0
        return cls(
            tuple(order), tuple(group_of), tuple(group_stop), _reach(order, weights, group_of)
        )

    def rest_of_group(self, position: int) -> range:
        """The positions from `position` to the end of its group."""
        return range(position, self.group_stop[self.group_of[position]])


def _reach(order: list[int], weights: list[ShardedWeight], group_of: list[int]) -> tuple[int, ...]:
    """Per position, the group holding the last use of the first block call that starts after
    the position's own call (or after it, for a use outside blocks); -1 where none follows."""
    ends: list[tuple[int, int]] = []  # (first position, last position) of each block call
    for position, index in enumerate(order):
        w = weights[index]
        prev = weights[order[position - 1]] if position else None
        if w.block is not None and (prev is None or not _same_block_call(prev, w)):
            ends.append((position, position))
        elif w.block is not None:
            ends[-1] = (ends[-1][0], position)
    reach = []
    call = 0  # the first call that starts after the current position's own
    for position in range(len(order)):
        while call < len(ends) and ends[call][0] <= position:
            call += 1
        reach.append(group_of[ends[call][1]] if call < len(ends) else -1)
    return tuple(reach)


def _same_block_call(w: ShardedWeight, nxt: ShardedWeight) -> bool:
    """Whether `nxt` follows `w` within one call of a block on gathered weights: a later
    weight of the same block (a block called again starts over at its first)."""
    return (
        w.block is not None
        and nxt.block is not None
        and (nxt.block[0] == w.block[0] and nxt.block[1] > w.block[1])
    )


@dataclasses.dataclass
class PassState:
    """The progress of one pass along its chain."""

    kind: PassKind
    scope: str | None  # None: the model's own pass; a name: a graphed region's
    chain: Chain | None
    # A forward opened by a submodule called on its own (`model.embed(idx)`): its name, so
    # each such call keeps a chain of its own. None: the root's forward, or a backward.
    opener: str | None = None
    cursor: int = 0  # the chain position of the next use
    diverged: bool = False
    recorded: list[int] = dataclasses.field(default_factory=list)
    inflight: collections.deque[Gather] = dataclasses.field(default_factory=collections.deque)
    exit_hooks: object | None = None  # the saved-tensor hooks context this pass entered

    @property
    def key(self) -> tuple[PassKind, str | None, str | None]:
        """Which recorded chain this pass follows."""
        return self.kind, self.scope, self.opener

    def describe(self, step: int) -> str:
        """This pass in a user's words: "the forward pass of 'embed' in step 3"."""
        of = f" of '{self.opener}'" if self.opener else ""
        region = f" in graphed region '{self.scope}'" if self.scope else ""
        return f"the {self.kind.label}{of}{region} of step {step}"

    def expects(self, index: int) -> bool:
        """Whether the next use in the recorded chain is the weight `index`."""
        return (
            self.chain is not None
            and not self.diverged
            and self.cursor < len(self.chain.order)
            and self.chain.order[self.cursor] == index
        )

    @property
    def issued(self) -> int:
        """Chain positions whose gathers have been issued: those used, plus those in flight
        (consumed in chain order while the pass follows its chain)."""
        return self.cursor + len(self.inflight)

    def next_to_prefetch(self, depth: int) -> range | None:
        """The next group to issue, if fewer than `depth` groups are in flight beyond the group
        of the use just made, or, prefetching at all, it ends no later than the next block call
        (`Chain.reach`)."""
        chain = self.chain
        issued = self.issued
        if chain is None or self.diverged or issued >= len(chain.order):
            return None
        latest = self.cursor - 1
        limit = chain.group_of[latest] + depth
        if depth:
            limit = max(limit, chain.reach[latest])
        if chain.group_of[issued] > limit:
            return None
        return chain.rest_of_group(issued)

    def followed_chain(self) -> bool:
        """Whether the pass used exactly the recorded chain (so nothing needs recording)."""
        return self.chain is not None and not self.diverged and self.cursor == len(self.chain.order)
