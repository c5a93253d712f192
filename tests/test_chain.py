"""Chains cut and prefetched around blocks on gathered weights (runtime/chain.py, [Note: a
block's weights in one group]), on stand-in weights: which positions form a group, and how far
the prefetch reaches after a pass's first use."""

from __future__ import annotations

import types

from gtp_wrap.runtime.chain import Chain, PassKind, PassState

DENSE, EXPERT = object(), object()  # two mesh axes


def _weight(block: tuple[str, int] | None, axis: object = DENSE) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        geometry=types.SimpleNamespace(gathered_numel=100), axis=axis, unit=None, block=block
    )


def _issued_after_first_use(chain: Chain, depth: int) -> int:
    """Positions issued once the pass's first use is made, as Gatherer.gather issues them."""
    state = PassState(PassKind.FORWARD, None, chain)
    state.inflight.extend(chain.rest_of_group(0))  # the chain head, issued as it blocks
    state.inflight.popleft()
    state.cursor = 1
    while (group := state.next_to_prefetch(depth)) is not None:
        state.inflight.extend(group)
    return state.issued


def test_a_block_call_is_one_group_and_a_second_call_another() -> None:
    # embed, block a (2 weights) called twice, block b, head; group_numel 0: one use a group
    weights = [_weight(None), _weight(("a", 0)), _weight(("a", 1)), _weight(("b", 0)),
               _weight(("b", 1)), _weight(None)]  # fmt: skip
    order = [0, 1, 2, 1, 2, 3, 4, 5]
    chain = Chain.build(order, weights, 0)  # type: ignore[arg-type]
    assert chain.group_of == (0, 1, 1, 2, 2, 3, 3, 4)
    # the prefetch reaches to the end of the next block call: from the embedding, a's first
    # call; from a's first call, its second; then b; after b, nothing
    assert chain.reach == (1, 2, 2, 3, 3, -1, -1, -1)
    plain = [_weight(None) for _ in weights]
    assert Chain.build(order, plain, 0).group_of == tuple(range(8))  # type: ignore[arg-type]


def test_a_blocks_expert_stacks_are_prefetched_with_its_dense_weights() -> None:
    # two MoE blocks: attention (dense), expert stacks (another axis), a dense weight after
    def block(name: str) -> list[types.SimpleNamespace]:
        return [_weight((name, 0)), _weight((name, 1), EXPERT), _weight((name, 2))]

    weights = [_weight(None), *block("l0"), *block("l1")]
    chain = Chain.build(list(range(7)), weights, 0)  # type: ignore[arg-type]
    assert chain.group_of == (0, 1, 2, 3, 4, 5, 6)  # cut where the axis changes
    # the embedding's use issues all of l0 (depth 1 alone would issue its first group)
    assert _issued_after_first_use(chain, depth=1) == 4
    assert _issued_after_first_use(chain, depth=0) == 1  # no prefetch asked: none
    no_blocks = [_weight(None, w.axis) for w in weights]
    assert _issued_after_first_use(Chain.build(list(range(7)), no_blocks, 0), depth=1) == 2  # type: ignore[arg-type]
