"""Host waits that learn why they are stuck, from what every rank posts in the store.

[Note: stalls explained within seconds] A collective pairs only with the same collective on
every peer. When ranks diverge (one rank evaluates while the others train, a layer skipped on
one rank) or a peer fails and lives on (its exception caught, a notebook), a plain wait would
last the full `collective_timeout_s` and then blame no one. So a host wait that has not
finished after `PROBE_AFTER_S` posts what this rank is blocked on in the rendezvous store: a
collective (its group, its number on that group, what it moves) or an agreement check. It then
reads its peers' posts every `POLL_S` until it finishes, and raises as soon as a post proves
that it never will:
- a peer posted a failure (an exception left one of its passes): PeerFailedError, naming the
  rank, its exception and the pass;
- a peer issued this collective's number on its group as a different collective (by its post's
  list of its latest collectives), or waits for the same number as something else:
  ChainMismatchError naming both;
- a peer waits at an agreement check, which needs this rank there, without having issued the
  collective this rank waits for (or the other way round), or two ranks wait at different
  checks: a deadlock, ChainMismatchError naming both.
A verdict needs the same post on two polls, so a post its rank is just clearing never counts.
Peers waiting for the same collective, or not blocked at all (computing, or in a collective of
the user's own), are waited for, up to the timeout. Nothing is posted or read while waits
finish within PROBE_AFTER_S: the hot path pays nothing.

On NCCL a collective's wait does not block the host (it orders a stream), so only agreement
checks are watched there; NCCL's watchdog ends a collective that never completes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

from ..errors import ChainMismatchError, GTPError, PeerFailedError

PROBE_AFTER_S = 1.0  # a wait this long starts posting and reading posts
POLL_S = 0.2
RECENT = 32  # collectives a post lists
# The agreement check of a rank's first pass after a failed one (comm/agreement.py), which its
# peers reach with failures of their own still posted.
RESUME_CHECK = "resume-after-failure"


@dataclasses.dataclass(frozen=True)
class Blocked:
    """What one rank waits for. `where` is the group a collective runs over (its role and
    member ranks) or a check's key; `number` the collective's number on that group or the
    check's number; `issued` how many collectives this rank issued per group, and checks it
    passed, so far; `recent` its latest collectives as [where, first number, works,
    description]."""

    kind: Literal["collective", "check"]
    where: str
    number: int
    what: str
    issued: dict[str, int]
    recent: list[list[Any]]

    def issued_as(self, where: str, number: int) -> str | None:
        """What this rank issued as collective `number` of group `where`, if it lists it."""
        for group, first, works, what in self.recent:
            if group == where and first <= number < first + works:
                return what
        return None


class Watch:
    """The posts of one engine's ranks, keyed by its tag so that engines never mix."""

    def __init__(self, tag: str, timeout_s: float) -> None:
        self.tag = tag
        self.timeout = timeout_s
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.checks = 0  # agreement checks this rank passed (comm/agreement.py counts them)
        # Works issued per group `where`, and the latest collectives as (where, first number,
        # works, what, context, step): `record` keeps them as comm/comm.py issues.
        self.issued: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[str, int, int, str, str, int]] = collections.deque(
            maxlen=RECENT
        )
        self._failure: dict[str, str] | None = None
        self._posts = 0
        if self.distributed:
            self._post(None)

    def record(self, where: str, works: int, what: str, context: str, step: int) -> int:
        """Number `works` Works just issued on the group `where`; the first one's number."""
        number = self.issued[where] + 1
        self.issued[where] += works
        self.recent.append((where, number, works, what, context, step))
        return number

    def blocked(
        self, kind: Literal["collective", "check"], where: str, number: int, what: str
    ) -> Blocked:
        """This rank's post while it waits for `what`."""
        recent = [
            [group, first, works, text.format(context=context, step=step)]
            for group, first, works, text, context, step in self.recent
        ]
        issued = {**self.issued, "checks": self.checks}
        return Blocked(kind, where, number, what, issued, recent)

    def _store(self) -> dist.Store:
        return dist.distributed_c10d._get_default_store()

    def _key(self, rank: int) -> str:
        return f"gtp_wrap/{self.tag}/watch/{rank}"

    def _post(self, blocked: Blocked | None) -> None:
        self._posts += 1
        post: dict[str, Any] = {"n": self._posts, "failed": self._failure}
        if blocked is not None:
            post["blocked"] = dataclasses.asdict(blocked)
        self._store().set(self._key(self.rank), json.dumps(post))

    def failed(self, error: BaseException, where: str) -> None:
        """Tell the peers that `error` ended this rank's pass (`where`: "in the forward pass of
        step 3"), so a peer blocked on one of its collectives raises at once instead of timing
        out."""
        if not self.distributed:
            return
        self._set_failure(error, where)
        with contextlib.suppress(RuntimeError):  # the store went with a dead peer
            self._post(None)

    def _set_failure(self, error: BaseException, where: str) -> None:
        """Record the first failure since this rank's last completed pass: what followed it
        (a carried-on forward that no longer pairs) is its consequence, not its cause."""
        if self._failure is None:
            self._failure = {"error": f"{type(error).__name__}: {error}"[:500], "where": where}

    @property
    def failure(self) -> dict[str, str] | None:
        """This rank's first failure since its last completed pass ("error", "where"), if any."""
        return self._failure

    def recovered(self) -> None:
        """A pass of this rank completed after a failure (the failure was caught, and the
        peers ran that pass with it): the failure no longer explains a peer's wait."""
        if self._failure is not None:
            self._failure = None
            self._post(None)

    def _raise(self, error: GTPError) -> None:
        """Raise `error`, posted first as this rank's failure: a peer whose connection to this
        rank breaks when it exits then names the cause."""
        self._set_failure(error, "while waiting for its peers")
        raise error

    def peer_failure(self) -> PeerFailedError | None:
        """A failure a peer posted, if any: what a broken connection to it means."""
        if not self.distributed:
            return None
        for rank, post in self._read().items():
            if post.get("failed"):
                return _peer_failed(rank, post["failed"], "")
        return None

    def wait(
        self,
        finished: Callable[[float], bool],
        blocked: Callable[[], Blocked],
        timed_out: Callable[[float], GTPError],
    ) -> None:
        """Wait until `finished(seconds)` (a wait of at most that long) says done; after
        PROBE_AFTER_S post `blocked()` and raise what the peers' posts prove (see the Note).
        `timed_out(seconds)` is the error once `timeout` has passed."""
        began = time.monotonic()
        if finished(min(PROBE_AFTER_S, self.timeout)):
            return
        if not self.distributed:
            if finished(max(self.timeout - PROBE_AFTER_S, 0.0)):
                return
            raise timed_out(self.timeout)
        mine = blocked()
        self._post(mine)
        seen: dict[int, int] = {}  # rank -> the number of its post that proved a verdict last poll
        try:
            while True:
                for rank, post in self._read().items():
                    verdict = _verdict(self.rank, mine, rank, post)
                    if verdict is None:
                        seen.pop(rank, None)
                    elif seen.get(rank) == post["n"]:
                        self._raise(verdict)
                    else:
                        seen[rank] = post["n"]
                left = self.timeout - (time.monotonic() - began)
                if left <= 0:
                    self._raise(timed_out(self.timeout))
                if finished(min(POLL_S, left)):
                    return
        finally:
            with contextlib.suppress(RuntimeError):  # the store went with a dead peer
                self._post(None)

    def _read(self) -> dict[int, dict[str, Any]]:
        """The peers' posts; none where the store went with a dead peer (the wait then ends
        in the broken connection to it)."""
        store = self._store()
        peers = [rank for rank in range(self.world) if rank != self.rank]
        keys = [self._key(rank) for rank in peers]
        try:
            if store.check(keys):  # one round trip once every peer has posted (at its wrap)
                return {r: json.loads(raw) for r, raw in zip(peers, store.multi_get(keys))}
            return {r: json.loads(store.get(k)) for r, k in zip(peers, keys) if store.check([k])}
        except RuntimeError:
            return {}


def store_wait(store: dist.Store, keys: list[str]) -> Callable[[float], bool]:
    """A `finished` for Watch.wait: whether every key is set, within the given seconds."""

    def finished(seconds: float) -> bool:
        deadline, pause = time.monotonic() + seconds, 0.001
        while not store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return True

    return finished


def work_wait(work: dist.Work) -> Callable[[float], bool]:
    """A `finished` for Watch.wait over a gloo Work; a failed collective raises.

    Gloo's own timed waits cannot be trusted to return: a reduce-scatter's ignores its timeout,
    and an all-gather's does when the collective is already under way. So a Work not completed
    yet is waited for on a helper thread, and that wait's result with timeouts.
    """
    waited: concurrent.futures.Future[Any] | None = None

    def finished(seconds: float) -> bool:
        nonlocal waited
        if waited is None:
            if work.is_completed():
                work.wait()
                return True
            waited = _WAITER.submit(work.wait)
        try:
            waited.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            return False
        return True

    return finished


class _Waiter:
    """Daemon threads that run blocking waits. A wait for a collective that never completes
    keeps its thread until the process exits, so a busy pool grows a thread instead of
    queueing behind it, and no thread holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._jobs = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="gtp_wrap-wait", daemon=True).start()
        self._jobs.put((fn, future))
        return future

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)
            # An idle thread must not keep the Work (and so its buffers) referenced: a gather
            # buffer stays in use until its Work is dropped (runtime/buffers.py).
            del fn, future
            with self._lock:
                self._idle += 1


_WAITER = _Waiter()


def _peer_failed(rank: int, failure: dict[str, str], waiting: str) -> PeerFailedError:
    tail = f"; this rank was waiting for {waiting}" if waiting else ""
    return PeerFailedError(
        f"rank {rank} failed {failure['where']} with {failure['error']}{tail}. Fix the "
        f"error on rank {rank}; its peers cannot go on without it"
    )


def _verdict(me: int, mine: Blocked, rank: int, post: dict[str, Any]) -> GTPError | None:
    """What the peer `rank`'s post proves about this rank's wait `mine` (None: nothing)."""
    if post.get("failed") and not (mine.kind == "check" and mine.where == RESUME_CHECK):
        return _peer_failed(rank, post["failed"], mine.what)  # at RESUME_CHECK: on its way
    if post.get("blocked") is None:
        return None
    theirs = Blocked(**post["blocked"])
    theirs_then = mine.kind == "collective" and theirs.issued_as(mine.where, mine.number)
    if theirs_then and theirs_then != mine.what:
        return ChainMismatchError(
            f"rank {me} waits for {mine.what}, which rank {rank} issued as {theirs_then} "
            f"(collective #{mine.number} of the process group of ranks "
            f"{mine.where.partition(':')[2]}): the ranks' collectives no "
            f"longer pair. {_ADVICE}"
        )
    if mine.kind == "collective" and theirs.kind == "collective":
        same_slot = (mine.where, mine.number) == (theirs.where, theirs.number)
        if not same_slot or mine.what == theirs.what:
            return None
        why = "their collectives no longer pair"
    elif mine.kind == "check" and theirs.kind == "check":
        if (mine.where, mine.number) == (theirs.where, theirs.number):
            return None
        if theirs.issued.get("checks", 0) >= mine.number or mine.issued["checks"] >= theirs.number:
            return None  # one post is older than a check both passed
        why = "each waits at a different check for the other"
    else:
        check, collective = (mine, theirs) if mine.kind == "check" else (theirs, mine)
        in_check = rank if check is theirs else me
        if in_check not in members(collective.where):
            return None
        if check.issued.get(collective.where, 0) >= collective.number:
            return None  # the rank at the check issued that collective before it
        if collective.issued.get("checks", 0) >= check.number:
            return None  # the post at the check is older than the check
        why = (
            f"rank {in_check} waits at a check that needs every rank, before issuing the "
            "collective the other waits for"
        )
    return ChainMismatchError(
        f"rank {me} waits for {mine.what}, while rank {rank} waits for {theirs.what}: {why}. "
        f"{_ADVICE}"
    )


_ADVICE = (
    "GTP gathers weights collectively, so every rank must run the same passes over the same "
    "weights in the same order (run evaluation and data-dependent branches on every rank)"
)


def members(where: str) -> set[int]:
    """The ranks of a collective's group, from its `where` ("gtp:0,1")."""
    ranks = where.partition(":")[2]
    return {int(r) for r in ranks.split(",")} if ranks else set()


def group_key(group: dist.ProcessGroup | None) -> str:
    """A process group's `where` ("pg0:0,1": its name and member ranks), the same on every
    member. Roles that share a process group (a whole-world gtp group is the default group)
    share it, since their collectives pair in one sequence."""
    pg = group if group is not None else dist.group.WORLD
    assert isinstance(pg, dist.ProcessGroup)  # only distributed engines number collectives
    ranks = dist.get_process_group_ranks(pg)
    return f"pg{pg.group_name}:{','.join(map(str, ranks))}"
