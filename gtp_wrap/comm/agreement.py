"""Cross-rank agreement: every rank's values for one check, through the rendezvous store.

[Note: agreement through the store] Agreement checks run exactly when ranks may have diverged
(wrapping, a recorded chain, a capture, a checkpoint). A collective issued for the check could
pair with a peer's stray gather and hang or mix data; the rendezvous store is a separate
channel, so a missing peer ends in an error (comm/watch.py says which), never a mix-up.
"""

from __future__ import annotations

import zlib

import torch.distributed as dist

from ..errors import ChainMismatchError, CollectiveTimeoutError, GTPError
from .watch import RESUME_CHECK, Blocked, Watch, members, store_wait


class Agreement:
    """The exchanges of one engine, keyed by its tag so that engines never pair."""

    def __init__(self, world_size: int, watch: Watch) -> None:
        self.world_size = world_size
        self.watch = watch
        self.count = 0  # exchanges made so far
        # The previous exchange's purpose and number, whose key to delete next. The key keeps
        # the check's purpose so that ranks at different checks never pair; so it cannot be
        # derived from the counter alone.
        self._previous = ""

    def exchange(self, purpose: str, values: list[int], what: str = "") -> list[list[int]]:
        """Every world rank's `values` for the check `purpose` (a key: no spaces). `what` says
        in a user's words what the check is, for errors ("the check that ...")."""
        if self.world_size == 1:
            return [values]
        self.count += 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"gtp_wrap/{self.watch.tag}/{purpose}/{self.count}"
        store.set(f"{prefix}/{dist.get_rank()}", ",".join(map(str, values)))
        keys = [f"{prefix}/{r}" for r in range(dist.get_world_size())]
        what = what or f"the '{purpose}' check"

        def blocked() -> Blocked:
            return self.watch.blocked("check", purpose, self.count, what)

        def timed_out(seconds: float) -> CollectiveTimeoutError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            return CollectiveTimeoutError(
                f"rank(s) {missing} did not reach {what} within {seconds:g}s: they are stuck, "
                "gone, or running other passes than this rank"
            )

        self.watch.wait(store_wait(store, keys), blocked, timed_out)
        self.watch.checks = self.count
        out = []
        for key in keys:
            raw = store.get(key).decode()
            out.append([int(v) for v in raw.split(",")] if raw else [])
        # Every rank set this exchange's key after reading all of the previous one's, so no
        # one reads this rank's previous key anymore: the store keeps two exchanges, not all.
        if self.count > 1:
            store.delete_key(f"gtp_wrap/{self.watch.tag}/{self._previous}/{dist.get_rank()}")
        self._previous = f"{purpose}/{self.count}"
        return out


def agree_to_resume(agreement: Agreement) -> None:
    """Before this rank's first pass after a failed one (its watch holds the failure): go on
    only where every rank failed alike, else raise naming the failure.

    [Note: a pass after a failure] A rank whose pass raised, caught the error and runs another
    pass ("skip the bad batch") would issue that pass's collectives while its peers still wait
    in the failed one, or have left it with a PeerFailedError, having issued collectives this
    rank never did. Its next collective would pair with one of theirs of another size: gloo
    aborts the process, NCCL mixes data or hangs. So that pass first meets its peers at an
    agreement check, through the store (see [Note: agreement through the store]), with the
    collectives each rank issued per group. Where every rank raised at the same point (the
    same bad input on every rank) the counts agree and training goes on; where peers stayed
    in the failed pass, or issued more, the ranks can never pair again, and this rank raises
    instead of issuing a collective."""
    failure = agreement.watch.failure
    assert failure is not None  # called only after a failure
    # Per group: its key, this rank's count and the group's ranks, so that every rank reads a
    # member that never issued on a group as 0 and all reach the same verdict.
    values: list[int] = []
    for where, count in sorted(agreement.watch.issued.items()):
        ranks = sorted(members(where))
        values += [stable_hash(where), count, len(ranks), *ranks]
    why = ""
    try:
        per_rank = agreement.exchange(
            RESUME_CHECK, values, "the check that ranks resume together after a failure"
        )
    except GTPError as error:
        why = f"its peers did not come on with it ({error})"
    else:
        if _counts_differ(per_rank):
            why = "its peers issued collectives in it that this rank did not"
    if why:
        raise ChainMismatchError(
            f"this rank's pass failed {failure['where']} with {failure['error']}, and {why}: "
            "the ranks' collectives can no longer pair, so no further pass can run. End every "
            "rank and start again (gtp-train resume=true continues from the last checkpoint); "
            "an error caught and gone on from works only where every rank raised it alike"
        )
    agreement.watch.recovered()  # every rank failed alike: no peer's wait is explained by it


def _counts_differ(per_rank: list[list[int]]) -> bool:
    """Whether two members of a group issued different numbers of collectives on it, from
    `agree_to_resume`'s values (a member that lists no count for a group issued none)."""
    counts: list[dict[int, int]] = [{} for _ in per_rank]
    groups: dict[int, list[int]] = {}
    for rank, values in enumerate(per_rank):
        at = 0
        while at < len(values):
            key, count, size = values[at : at + 3]
            counts[rank][key] = count
            groups[key] = values[at + 3 : at + 3 + size]
            at += 3 + size
    return any(len({counts[r].get(key, 0) for r in ranks}) > 1 for key, ranks in groups.items())


def stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's hash() is salted per process)."""
    return zlib.crc32(text.encode())


def first_difference(per_rank: list[list[int]]) -> tuple[int, list[int | None]] | None:
    """The first position where the ranks' values differ, and each rank's entry there."""
    longest = max(len(c) for c in per_rank)
    for pos in range(longest):
        entries = [c[pos] if pos < len(c) else None for c in per_rank]
        if len(set(entries)) > 1:
            return pos, entries
    return None
