"""Reusable gather buffers: the memory full weights live in while they are used.

[Note: buffer freeness] A buffer is free only when no tensor reads it anymore. Views of a gathered
weight escape in ways no hook sees (`w = self.weight.t()` kept for later, several same-shape weights
read before any is used, a checkpoint frame holding recomputed weights), and handing such a buffer
to the next gather would overwrite a weight still being read. So freeness is not guessed from the
access pattern: it is read off the storage's reference count, which counts every live view. Picks
are deterministic (first free buffer of the right size, in creation order). Between eager steps the
engine releases the free buffers (see [Note: buffers between steps]); a captured step keeps them, so
from its capture on the same weights land in the same buffers at the same addresses.
"""

from __future__ import annotations

import enum
import time

import torch

from ..core.weight import ShardedWeight

_SETTLE_S = 1.0


class BufferState(enum.Enum):
    FREE = "free"  # no view alive, no gather in flight: can be handed to the next gather
    GATHERING = "gathering"  # a gather into it is in flight and not yet consumed
    IN_USE = "in_use"  # views of the gathered weight are alive (in autograd or user code)


class GatherBuffer:
    """One flat buffer of `numel` elements; its state is derived, never stored twice."""

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, rank: int, world: int
    ) -> None:
        # A pool outlives any inference_mode block: a buffer made inside one (an eval forward)
        # must stay writable by the training steps after it.
        with torch.inference_mode(False):
            self.tensor = torch.empty(numel, dtype=dtype, device=device)
            # This rank's part, where its shard is cast before an in-place gather: made once,
            # so it counts in the baseline below, not as a view in use.
            self.own = self.tensor.narrow(0, rank * (numel // world), numel // world)
        self._storage = self.tensor.untyped_storage()
        self._baseline = self._use_count()
        self.gathering = False
        self.owner: ShardedWeight | None = None  # the weight last gathered into it
        self.data_ptr = self._storage.data_ptr()
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        self._host = device.type == "cpu"  # see settle

    def _use_count(self) -> int:
        return torch._C._storage_Use_Count(self._storage._cdata)

    @property
    def state(self) -> BufferState:
        if self.gathering:
            return BufferState.GATHERING
        if self._use_count() > self._baseline:
            return BufferState.IN_USE
        return BufferState.FREE

    def settle(self) -> None:
        """Wait until the collective library has dropped its own references to the buffer.

        A gloo worker thread releases the output of a finished collective a moment after
        `wait()` returns; without this, the buffer would look in use at the next pick and the
        pool would grow by chance instead of by need.
        """
        if not self._host:
            return
        deadline = time.monotonic() + _SETTLE_S
        while self._use_count() > self._baseline and time.monotonic() < deadline:
            time.sleep(0)


class GatherBufferPool:
    """Gather buffers keyed by (numel, dtype, rank, world), the last two of the group they
    gather over; grows only when every matching buffer is busy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by_key: dict[tuple[int, torch.dtype, int, int], list[GatherBuffer]] = {}
        self._by_ptr: dict[int, GatherBuffer] = {}
        self.total_bytes = 0  # memory held by gather buffers

    def reserve(self, numel: int, dtype: torch.dtype, rank: int, world: int) -> GatherBuffer:
        """A free buffer for a gather about to be issued over a group of `world` ranks, this
        one `rank`, marked GATHERING (new if none is)."""
        buffers = self._by_key.setdefault((numel, dtype, rank, world), [])
        for buf in buffers:
            # The gathering ones (a group's earlier weights of the same shape) are passed
            # over on their flag, without a call of the state property each.
            if not buf.gathering and buf.state is BufferState.FREE:
                break
        else:
            buf = GatherBuffer(numel, dtype, self.device, rank, world)
            buffers.append(buf)
            self._by_ptr[buf.data_ptr] = buf
            self.total_bytes += buf.nbytes
        buf.gathering = True
        return buf

    def hand_out(self, buf: GatherBuffer) -> None:
        """The gather into `buf` is complete; from now on its views decide when it is free."""
        buf.gathering = False
        buf.settle()

    def forget(self, buf: GatherBuffer) -> None:
        """Drop `buf` from the pool for good, if it is this pool's: a gather into it may complete
        late, or never (its pass failed), and would write into whatever it was handed to next."""
        if self._by_ptr.get(buf.data_ptr) is not buf:
            return  # another pool's
        for buffers in self._by_key.values():
            if buf in buffers:
                buffers.remove(buf)
        del self._by_ptr[buf.data_ptr]
        self.total_bytes -= buf.nbytes

    def release_free(self) -> None:
        """Drop the free buffers: the allocator has the memory until the next reserve."""
        for key, buffers in self._by_key.items():
            self._by_key[key] = [b for b in buffers if b.state is not BufferState.FREE]
        self._by_ptr = {b.data_ptr: b for bs in self._by_key.values() for b in bs}
        self.total_bytes = sum(b.nbytes for b in self._by_ptr.values())

    def lookup(self, t: torch.Tensor) -> GatherBuffer | None:
        """The buffer `t` is a view of, if any; raises for a tensor without storage. The
        address comes first: it is what tells most tensors (a pass's activations, each saved
        once) apart from the buffers, at one storage read each."""
        buf = self._by_ptr.get(t.untyped_storage().data_ptr())
        return buf if buf is not None and t.device == self.device else None
