"""What graphed steps and regions share: capture with every rank's outcome agreed, refusal of
host synchronizations, and the host bookkeeping a replay must redo.

[Note: why GTP's step can be captured] Everything the engine decides on the host (which buffer
a gather lands in, the chain, when a reduce-scatter is finalized, whether a shard needs
re-casting) is the same from the second step on, and the gather buffers stay put once
graph_step holds them (eager steps release them, see [Note: buffers between steps]), so the
capture records exactly the kernels and collectives of a warm-up step, at the same addresses.
The collectives run on NCCL's internal stream, which forks from the capture stream with an
event and is joined back by `Work.wait()`, so it is captured with them; nothing may still be in
flight when capture ends, which the engine guarantees because every pass drains its gathers and
every backward finalizes its last reduce-scatter. What the host did once at capture and does
not repeat on replay is redone by `Replay`: `.grad` attributes re-pointed at the graph's
gradients, the once-per-step cast marked stale for the next eager pass, counters advanced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import GraphCaptureError, GTPError
from ..runtime.engine import GTPEngine

_live_graphs: weakref.WeakSet[torch.cuda.CUDAGraph] = weakref.WeakSet()
# How torch and CUDA word a failure to capture (sync debug mode, capture-time checks).
_CAPTURE_FAILURES = ("synchroniz", "captur", "not permitted", "pinned")
_HOST_SYNC_HINT = (
    "a CUDA graph cannot contain host synchronizations (.item(), .tolist(), .cpu(), printing "
    "a CUDA tensor, nonzero / boolean-mask indexing and other data-dependent shapes) or "
    "optimizers built without capturable=True. Move that work out of the captured function, "
    "or capture only the parts that are static with gtp_wrap.graph_region"
)


def require_cuda(engine: GTPEngine, what: str) -> None:
    if engine.device.type != "cuda" or not torch.cuda.is_available():
        raise GraphCaptureError(
            f"{what} needs a CUDA device, but the model is on '{engine.device}'. CUDA graphs "
            "do not exist on CPU: call the step function directly there"
        )


class _LastOp(TorchDispatchMode):
    """Remembers the last operator dispatched, to name the one a failed capture stopped at."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "unknown operation"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.name = str(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refusing_host_syncs(what: str) -> Iterator[None]:
    """Run the body with host synchronizations raising GraphCaptureError, naming the operator.

    [Note: refuse syncs before capture] The last warm-up step runs under this too, so a step that
    cannot be captured fails eagerly, before any capture: a capture abandoned half-way can leave
    NCCL unable to shut down cleanly.
    """
    op = _LastOp()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with op:
            yield
    except RuntimeError as e:
        if isinstance(e, GTPError) or not any(m in str(e) for m in _CAPTURE_FAILURES):
            raise  # not about capture: the user's own error, a chain mismatch, out of memory
        raise GraphCaptureError(
            f"{what} cannot be captured in a CUDA graph: it stopped at '{op.name}'. "
            f"{_HOST_SYNC_HINT}. Cause: {e}"
        ) from e
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture(
    engine: GTPEngine,
    graph: torch.cuda.CUDAGraph,
    fn: Callable[[], Any],
    what: str,
    pool: Any = None,
) -> Any:
    """Capture `fn()` into `graph`; turn a failure into a GraphCaptureError on every rank.

    Every rank reports its outcome through the store before any replay: a rank whose capture
    failed must not leave its peers replaying collectives it will never join.
    """
    error: Exception | None = None
    out = None
    try:
        # Entering the capture synchronizes the device on purpose: refuse syncs inside only.
        with torch.cuda.graph(graph, pool=pool), refusing_host_syncs(what):
            out = fn()
    except Exception as e:
        error = e
        graph.reset()
    outcomes = engine.agreement.exchange(
        f"capture-{what}", [int(error is None)], f"the end of the CUDA-graph capture of {what}"
    )
    if isinstance(error, GTPError):
        raise error
    if error is not None:
        raise GraphCaptureError(f"capturing {what} failed: {error}") from error
    failed = [r for r, (ok,) in enumerate(outcomes) if not ok]
    if failed:
        graph.reset()
        raise GraphCaptureError(
            f"capturing {what} failed on rank(s) {failed} (see their error); no rank replays it"
        )
    _live_graphs.add(graph)
    return out


def release_graphs() -> None:
    """Free every CUDA graph gtp_wrap captured in this process; call it before
    `dist.destroy_process_group()`.

    [Note: release graphs first] A captured NCCL collective holds on to its communicator, and NCCL
    waits for every graph using a communicator to be destroyed before destroying it, so shutting
    down with a graph still alive (a graphed step or region kept by a reference cycle, say) hangs.
    The released graphs cannot be replayed anymore.
    """
    for graph in list(_live_graphs):
        graph.reset()
    _live_graphs.clear()


def describe(leaves: Sequence[Any]) -> list[Any]:
    """What must stay the same between replays: each tensor's shape, dtype, device and
    requires_grad; other values themselves."""
    return [
        (tuple(x.shape), x.dtype, str(x.device), "requires_grad" if x.requires_grad else "")
        if isinstance(x, torch.Tensor)
        else x
        for x in leaves
    ]


@contextlib.contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Eager warm-up runs on a side stream, as CUDA-graph capture expects of the first runs."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def check_live(graph: torch.cuda.CUDAGraph, what: str) -> None:
    if graph not in _live_graphs:
        raise GraphCaptureError(
            f"{what} was released by gtp_wrap.release_graphs() and cannot be replayed; "
            "make a new one"
        )


class Replay:
    """What the host must redo after each replay of captured GTP passes: what those passes did
    on the host once, at capture (counters, `.grad` attributes, the step number)."""

    def __init__(self, engine: GTPEngine, may_change_shards: bool) -> None:
        self.engine = engine
        self.may_change_shards = may_change_shards
        self._before = dataclasses.replace(
            engine.stats, blocking_by_pass=dict(engine.stats.blocking_by_pass)
        )
        self._step = engine.step
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.delta: dict[str, int] = {}
        self.blocking: dict[str, int] = {}
        self.steps = 0

    def captured(self, grads: dict[nn.Parameter, torch.Tensor]) -> Replay:
        """Record what the capture changed; `grads` are re-pointed at after every replay."""
        before, after = self._before, self.engine.stats
        self.grads = grads
        self.delta = {
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(after)
            if isinstance(getattr(after, f.name), int) and f.name != "peak_gathered_bytes"
        }
        self.blocking = {
            k: v - before.blocking_by_pass.get(k, 0) for k, v in after.blocking_by_pass.items()
        }
        self.steps = self.engine.step - self._step
        return self

    def after_replay(self) -> None:
        for p, g in self.grads.items():
            p.grad = g
        s = self.engine.stats
        for name, d in self.delta.items():
            setattr(s, name, getattr(s, name) + d)
        for k, d in self.blocking.items():
            s.blocking_by_pass[k] = s.blocking_by_pass.get(k, 0) + d
        self.engine.step += self.steps
        if self.may_change_shards:
            # A captured optimizer step changes the shards without moving their version
            # counters: the next eager pass must re-cast.
            self.engine.invalidate_casts()


def outside_passes(engine: GTPEngine, what: str) -> None:
    if engine.in_pass():
        raise GraphCaptureError(
            f"{what} was called inside a forward or backward of the wrapped model; call it "
            "between steps"
        )
