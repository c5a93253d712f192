"""Owners: which rank orthogonalizes each Muon matrix, and the two all-to-alls that bring its
update there and its orthogonalized update back.

[Note: one owner per matrix] Newton–Schulz needs a whole matrix, and each rank holds a box of it
(its rows over gtp, its tp block, its experts over ep; the whole of a replicated one). Every
matrix gets one owner in the world, chosen by longest-processing-time first on its NS cost, so
the work is balanced and done once per step. Each distinct box is sent by the lowest rank
holding it (replicas over dp or edp hold the same box: one copy travels), and the owner sends
each rank back its box of the result, replicas included. All matrices travel in one
all_to_all_single each way, packed in bf16: NS starts by rounding to bf16, so the owner computes
exactly what a single process would. Owners are spread over the whole world, dp replicas
included, rather than per GTP group: the replicas would otherwise repeat each other's NS, and
the exchange is one collective either way.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .newton_schulz import cost


@dataclasses.dataclass(frozen=True)
class Box:
    """A block of a logical tensor: where it starts and its shape."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def encode(self) -> list[int]:
        return [len(self.shape), *self.offset, *self.shape]

    @classmethod
    def decode(cls, values: list[int], at: int) -> tuple[Box, int]:
        """The box encoded at `values[at:]`, and where the next one starts."""
        ndim = values[at]
        offset = tuple(values[at + 1 : at + 1 + ndim])
        shape = tuple(values[at + 1 + ndim : at + 1 + 2 * ndim])
        return cls(offset, shape), at + 1 + 2 * ndim


def assign_owners(shapes: list[torch.Size], world: int) -> list[int]:
    """Each matrix's owner rank: the costliest first, each to the least loaded rank (the
    lowest of those tied), so every rank computes the same assignment."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += cost(shapes[i])
    return owners


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one matrix's pieces go: its owner, the ranks sending its distinct boxes (rank
    order), and every rank's box (the result goes back to each)."""

    owner: int
    senders: tuple[tuple[int, Box], ...]
    boxes: tuple[Box, ...]  # by rank


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One step's packing, for the matrices that have gradients (indices into the routes, in
    order): what this rank sends to and receives from each rank, both ways."""

    send_in: tuple[tuple[int, ...], ...]  # per rank: matrices it owns whose box this rank sends
    recv_in: tuple[tuple[tuple[int, Box], ...], ...]  # per rank: (matrix I own, its box)
    send_out: tuple[tuple[tuple[int, Box], ...], ...]  # per rank: (matrix I own, its box)
    recv_out: tuple[tuple[int, ...], ...]  # per rank: matrices it owns, my box of each

    def sizes(self, boxes: tuple[Box, ...]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Split sizes (elements) of the in-exchange (send, receive) and the out-exchange."""
        return (
            [sum(boxes[i].numel for i in to) for to in self.send_in],
            [sum(box.numel for _, box in of) for of in self.recv_in],
            [sum(box.numel for _, box in to) for to in self.send_out],
            [sum(boxes[i].numel for i in of) for of in self.recv_out],
        )


class OwnerPlan:
    """The routes of every Muon matrix of one optimizer, from every rank's boxes; and the
    exchange of each set of matrices with gradients, made once per set."""

    def __init__(self, shapes: list[torch.Size], boxes_by_rank: list[list[Box]], rank: int) -> None:
        self.world, self.rank = len(boxes_by_rank), rank
        self.owners = assign_owners(shapes, self.world)
        self.routes = []
        for i, shape in enumerate(shapes):
            boxes = tuple(per_rank[i] for per_rank in boxes_by_rank)
            first: dict[Box, int] = {}
            for r, box in enumerate(boxes):
                first.setdefault(box, r)
            if sum(box.numel for box in first) != math.prod(shape):
                found = sorted(first, key=lambda b: b.offset)
                raise RuntimeError(
                    f"Muon matrix #{i} of shape {tuple(shape)}: the ranks' boxes {found} do "
                    "not tile it, so no owner could assemble it (the engine's shards should "
                    "always tile a weight: a gtp_wrap bug, please report it)"
                )
            senders = tuple(sorted(((r, box) for box, r in first.items()), key=lambda s: s[0]))
            self.routes.append(Route(self.owners[i], senders, boxes))
        self.mine = tuple(route.boxes[rank] for route in self.routes)
        self._exchanges: dict[tuple[int, ...], Exchange] = {}

    def exchange(self, active: tuple[int, ...]) -> Exchange:
        """The packing for the matrices `active` (every rank has gradients for the same)."""
        found = self._exchanges.get(active)
        if found is not None:
            return found
        me, world = self.rank, self.world
        send_in: list[list[int]] = [[] for _ in range(world)]
        recv_in: list[list[tuple[int, Box]]] = [[] for _ in range(world)]
        send_out: list[list[tuple[int, Box]]] = [[] for _ in range(world)]
        recv_out: list[list[int]] = [[] for _ in range(world)]
        for i in active:
            route = self.routes[i]
            for sender, box in route.senders:
                if sender == me:
                    send_in[route.owner].append(i)
                if route.owner == me:
                    recv_in[sender].append((i, box))
            if route.owner == me:
                for r, box in enumerate(route.boxes):
                    send_out[r].append((i, box))
            recv_out[route.owner].append(i)
        exchange = Exchange(*(tuple(tuple(x) for x in lists)  # type: ignore[arg-type]
                              for lists in (send_in, recv_in, send_out, recv_out)))  # fmt: skip
        self._exchanges[active] = exchange
        return exchange

    def load(self, shapes: list[torch.Size]) -> list[int]:
        """Each rank's NS cost per step with every matrix active (for the balance figure)."""
        load = [0] * self.world
        for owner, shape in zip(self.owners, shapes):
            load[owner] += cost(shape)
        return load
