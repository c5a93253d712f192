"""The overlap of one step's passes: each chain group's gather, compute and gradient reduction
on three lanes (host, compute stream, communication stream), as the engine issues them.

A pass's head gather blocks. When group `g` starts (its gather landed, its launches issued if
eager, group `g - 1` done), its first use issues the gathers of the groups up to `g + depth`
(the prefetch chain), which queue on the one communication stream.
So a gather is hidden only if the compute before it outlasts it. In backward, a group's
reduction is issued when its compute ends and queues behind the gathers already issued. While a
collective runs, compute runs `contention_compute` times slower (NCCL's kernels take SMs and
HBM from the GEMMs beside them); a collective issued during a pass takes `contention_comm`
times longer. With a synchronous host (CPU ranks) the host's time is the compute lane's own.

The result splits the step into compute, waits for communication (plus the slowdown compute
suffers beside it) and waits for the host, which add up to the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Stage:
    """One chain group of a pass: its gather (0: nothing to gather), its compute, the host time
    to launch its uses, the reductions of its gradients (backward; 0 in forward), and
    communication its compute waits for in line (experts' all-to-alls, never hidden)."""

    gather_s: float
    compute_s: float
    host_s: float = 0.0
    reduce_s: float = 0.0
    inline_s: float = 0.0
    reach: int = -1  # the last stage whose gather it issues beyond `depth` (the next block's)


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Where the lanes stand: when the host, the compute stream and the communication stream
    are next free. A step starts with all at 0."""

    host: float = 0.0
    compute: float = 0.0
    comm: float = 0.0


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated stretch of a step: `end` when the compute stream finishes its last stage and
    the communication stream its last collective; `compute` the compute's own time;
    `comm_wait` idle waiting for gathers, in-line collectives and the tail of the reductions,
    `contention` the slowdown beside collectives, `host_wait` idle waiting for launches (with
    a synchronous host, the launches' own time), `comm_busy` the time collectives ran, on the
    communication stream and in line."""

    lanes: Lanes
    compute: float
    comm_wait: float
    contention: float
    host_wait: float
    comm_busy: float

    @property
    def end(self) -> float:
        return max(self.lanes.compute, self.lanes.comm)


def _slowed(start: float, work: float, busy: Sequence[tuple[float, float]], factor: float) -> float:
    """When `work` seconds of compute started at `start` end, running `factor` times slower
    while a collective in `busy` (sorted, disjoint intervals) runs."""
    t, left = start, work
    for b0, b1 in busy:
        if b1 <= t:
            continue
        if b0 > t:  # full speed until the collective starts
            run = min(left, b0 - t)
            t, left = t + run, left - run
            if left <= 0:
                return t
        overlap = b1 - t  # slowed while it runs
        done = overlap / factor
        if done >= left:
            return t + left * factor
        t, left = b1, left - done
    return t + left


def simulate(
    passes: Sequence[Sequence[Stage]],
    depth: int,
    contention_compute: float = 1.0,
    contention_comm: float = 1.0,
    async_host: bool = True,
    lanes: Lanes = Lanes(),
) -> Timeline:
    """Run `passes` (forward, backward, ...) one after the other from `lanes`."""
    host, compute, comm = lanes.host, lanes.compute, lanes.comm
    busy: list[tuple[float, float]] = []
    own = comm_wait = slow = host_wait = comm_busy = 0.0

    def issue(at: float, seconds: float) -> float:
        nonlocal comm, comm_busy
        if seconds <= 0:  # nothing to gather: ready at once
            return 0.0
        start = max(comm, at)
        comm = start + seconds * contention_comm
        busy.append((start, comm))
        comm_busy += comm - start
        return comm

    for stages in passes:
        landed: list[float] = []
        for g, stage in enumerate(stages):
            if len(landed) == g:  # the chain head (or no prefetch): issued when the host gets here
                landed.append(issue(max(host, compute), stage.gather_s))
            work = stage.compute_s + (0.0 if async_host else stage.host_s)
            if not async_host:  # the rank's own thread runs its launches: host time
                host_wait += stage.host_s
            start = max(compute, landed[g], host if async_host else compute)
            if start > compute:
                if landed[g] >= start:
                    comm_wait += start - compute
                else:
                    host_wait += start - compute
            # The group's first use issues the gathers up to `depth` groups ahead (and, if it
            # prefetches at all, to the end of the next block); they queue behind the
            # collectives already issued.
            ahead = max(g + depth, stage.reach) if depth else g
            while len(landed) < min(len(stages), ahead + 1):
                landed.append(issue(start, stages[len(landed)].gather_s))
            end = _slowed(start, work, busy, contention_compute)
            own += stage.compute_s
            slow += end - start - work
            end += stage.inline_s
            comm_wait += stage.inline_s
            comm_busy += stage.inline_s  # in line on the compute stream: all of it exposed
            if async_host:
                host += stage.host_s
                if host > end:  # the device ran dry before the group's last launch
                    host_wait += host - end
                    end = host
            else:
                host = end
            compute = end
            if stage.reduce_s:
                issue(compute, stage.reduce_s)
    tail = max(0.0, comm - compute)
    comm_wait += tail
    return Timeline(
        Lanes(host, max(compute, comm), max(compute, comm)),
        own,
        comm_wait,
        slow,
        host_wait,
        comm_busy,
    )
