"""Gradients of replicated parameters: all-reduced over every data rank in coalesced buckets.

Buckets launch their all-reduces in one fixed order, each as soon as its parameters and every
bucket before it have accumulated their grads in this backward, so they overlap the rest of
backward; buckets still waiting when backward ends launch then, in the same order. They run on
a process group of their own (see [Note: replicated all-reduces on a group of their own],
mesh.py), so a rank that launches one later than its peers (a parameter its data left unused)
does not reorder the other collectives. Each bucket carries one extra element per parameter
counting the ranks that had a grad, so a parameter no rank used keeps `.grad = None` exactly
like in unsharded training.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..comm.comm import Comm, Pending
from ..mesh import MeshAxis

_BUCKET_BYTES = 25 << 20


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.flat = self.flags = torch.empty(0)
        self.views: list[torch.Tensor] = []
        if params[0].requires_grad:  # frozen ones get their buffer if they are ever unfrozen
            self.allocate()
        self.ready: set[int] = set()
        self.locally_missing = False  # reading the flags costs a host sync: only when needed
        self.pending: Pending | None = None

    def trains(self) -> bool:
        """Whether any of its parameters requires grad now (the same on every rank)."""
        return any(p.requires_grad for p in self.params)

    def allocate(self) -> None:
        """A zeroed buffer for the grads, with one flag per parameter after them, and each
        parameter's view of it, made once: a launch and a finish are then one copy each for
        the whole bucket, not a slice, a view and a copy per parameter."""
        total, p0 = sum(self.sizes), self.params[0]
        self.flat = torch.zeros(total + len(self.params), dtype=p0.dtype, device=p0.device)
        self.flags = self.flat[total:]
        parts = self.flat[:total].split(self.sizes)
        self.views = [part.view_as(p) for part, p in zip(parts, self.params)]


class ReplicatedGrads:
    """Bucketed, overlapped all-reduce of the replicated parameters' grads."""

    def __init__(
        self, params: list[nn.Parameter], names: list[str], comm: Comm, axis: MeshAxis
    ) -> None:
        self.comm = comm
        self.axis = axis  # every data rank
        self.sync = True  # off under no_sync
        self._name_of = {id(p): name for p, name in zip(params, names)}
        self._warned: set[int] = set()
        self.buckets: list[_Bucket] = []
        # Grads become ready roughly in reverse registration order, so buckets follow it.
        # [Note: frozen replicated parameters] Parameters frozen now may be unfrozen later
        # (fine-tuning schedules); they get buckets of their own, which launch only when
        # backward ends and only while one of their parameters requires grad, so the others'
        # buckets still launch early.
        groups: dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
        for p in reversed(params):
            if p.is_floating_point() or p.is_complex():
                groups.setdefault((p.dtype, p.device, p.requires_grad), []).append(p)
        # Trainable groups first: the buckets launch in order, and a frozen one waits for the
        # end of backward.
        for _, group in sorted(groups.items(), key=lambda item: not item[0][2]):
            current: list[nn.Parameter] = []
            nbytes = 0
            for p in group:
                current.append(p)
                nbytes += p.numel() * p.element_size()
                if nbytes >= _BUCKET_BYTES:
                    self.buckets.append(_Bucket(current))
                    current, nbytes = [], 0
            if current:
                self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # the first bucket this backward has not launched

    def register(self, ensure_backward: Callable[[], None]) -> None:
        """Launch each bucket's all-reduce once all its grads are in; parameters frozen now
        are hooked by `hook_unfrozen` once they require grad."""

        def on_grad(p: torch.Tensor) -> None:
            if not self.sync:
                return
            ensure_backward()
            if len(p._post_accumulate_grad_hooks or ()) > 1 and id(p) not in self._warned:
                self._warn_user_hook(p)
            bucket = self._bucket_of[id(p)]
            bucket.ready.add(id(p))
            if len(bucket.ready) == len(bucket.params):
                self._launch_in_order()

        self._on_grad = on_grad
        self._unhooked = [p for b in self.buckets for p in b.params]
        self.hook_unfrozen()

    def hook_unfrozen(self) -> None:
        """Hook the parameters that require grad and are not hooked yet (called as each
        forward of the model starts): without a hook, a backward in which nothing else of the
        engine takes part would never all-reduce them."""
        if not any(p.requires_grad for p in self._unhooked):
            return
        for p in self._unhooked:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._unhooked = [p for p in self._unhooked if not p.requires_grad]

    def _warn_user_hook(self, p: torch.Tensor) -> None:
        self._warned.add(id(p))
        warnings.warn(
            f"a post-accumulate-grad hook on the replicated parameter '{self._name_of[id(p)]}' "
            "runs with this rank's own gradient, before the all-reduce across ranks (as with "
            "DDP); the reduced gradient is in .grad only when backward returns. To step it "
            "inside backward with the reduced gradient, shard it (a LayerRule with action "
            "'shard'): a sharded parameter's hooks run once its reduced gradient has landed",
            stacklevel=2,
        )

    def _launch_in_order(self) -> None:
        """Launch the buckets whose grads are all in, from the first not launched yet, up to
        the first still waiting; buckets of frozen parameters are passed (every rank froze the
        same ones)."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.trains():
                if len(bucket.ready) < len(bucket.params):
                    return
                self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.flat.numel() == 0:
            bucket.allocate()
        grads = [p.grad for p in bucket.params]
        bucket.locally_missing = any(g is None for g in grads)
        # Flags are filled by kernels, not assigned from Python numbers: an assignment is a
        # host-to-device copy, which a CUDA graph cannot capture.
        bucket.flags.fill_(1)
        if bucket.locally_missing:
            for i, (view, grad) in enumerate(zip(bucket.views, grads)):
                if grad is None:
                    view.zero_()
                    bucket.flags[i].fill_(0)
                else:
                    view.copy_(grad)
        else:
            torch._foreach_copy_(bucket.views, grads)  # type: ignore[arg-type]
        bucket.pending = self.comm.all_reduce(
            bucket.flat,
            self.axis,
            f"all-reduce of replicated grads ({len(bucket.params)} parameters)",
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        outer, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = outer  # nested: still off until the outermost exits

    def in_flight(self) -> list[Pending]:
        return [b.pending for b in self.buckets if b.pending is not None]

    def finish(self) -> None:
        """Launch the buckets still waiting, in order, then land every reduced grad in
        `.grad`."""
        for bucket in self.buckets[self._next :]:
            if bucket.trains():
                self._launch(bucket)
        self._next = 0
        for bucket in self.buckets:
            if bucket.pending is None:  # every parameter frozen: nothing to reduce
                continue
            self.comm.wait(bucket.pending)
            if not bucket.locally_missing:
                grads = [p.grad for p in bucket.params]
                torch._foreach_copy_(grads, bucket.views)  # type: ignore[arg-type]
            else:
                for p, reduced, flag in zip(bucket.params, bucket.views, bucket.flags.tolist()):
                    if flag > 0:
                        if p.grad is None:
                            p.grad = reduced.clone()
                        else:
                            p.grad.copy_(reduced)
            bucket.ready.clear()
            bucket.pending = None

    def abandon(self) -> None:
        """Forget a backward that raised: drop its launched all-reduces and its marks of which
        grads were ready, so the next backward launches every bucket afresh."""
        for bucket in self.buckets:
            if bucket.pending is not None:
                self.comm.abandon(bucket.pending)
                # A dropped all-reduce may still write its result: give it the old buffer.
                bucket.allocate()
            bucket.pending = None
            bucket.ready.clear()
        self._next = 0
