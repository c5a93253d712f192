"""What the engine's per-pass parts (gathers, gradient reduction) are built from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..comm.comm import Comm
from ..core.weight import ShardedWeight
from .passes import Passes
from .stats import Stats


@dataclasses.dataclass(frozen=True)
class Shared:
    """The engine's state every per-pass part reads: made once by the engine."""

    weights: list[ShardedWeight]
    comm: Comm
    passes: Passes
    stats: Stats
    ensure_backward: Callable[[], None]  # opens the backward pass unless one is open
    device: torch.device


class Part:
    """A part of the engine that works inside passes. It keeps `Shared`'s fields as its own
    attributes, read on every use, rather than one hop away."""

    def __init__(self, shared: Shared) -> None:
        self.weights = shared.weights
        self.comm = shared.comm
        self.passes = shared.passes
        self.stats = shared.stats
        self.ensure_backward = shared.ensure_backward
        self.device = shared.device
