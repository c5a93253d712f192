"""The mesh of a plan, `(dp, gtp, tp)` for dense weights and `(edp, ep, egtp)` for experts over
the same GPUs, and where each group's members sit: how many of them share a node (an NVLink
domain), which decides the links a collective crosses.

Ranks are laid out as `gtp_wrap.make_mesh` lays them: the last dim innermost (consecutive
ranks), and consecutive ranks fill a node before the next. `expert_layout="ep_inner"` models
the other order of the expert mesh, `(edp, egtp, ep)`, which keeps an EP group's all-to-alls
inside fewer nodes at the price of spreading each expert's GTP group.
"""

from __future__ import annotations

import dataclasses

AXES = ("dp", "gtp", "tp", "ep", "egtp")


class MeshError(ValueError):
    """A mesh that does not fit the model or the GPU count."""


@dataclasses.dataclass(frozen=True)
class Group:
    """One collective group: `size` members, `per_node` of them on each node they span."""

    size: int
    per_node: int

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.per_node


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Data-parallel replicas `dp` of GTP groups of `gtp` ranks, each of them `tp` ranks of
    tensor parallelism; experts partitioned over `ep` and sharded over `egtp` (the expert data
    axis, `edp`, is what remains of the world)."""

    dp: int = 1
    gtp: int = 1
    tp: int = 1
    ep: int = 1
    egtp: int = 1
    expert_layout: str = "egtp_inner"

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"mesh {axis}={getattr(self, axis)}: every axis must be >= 1")
        if self.expert_layout not in ("egtp_inner", "ep_inner"):
            raise MeshError(
                f"expert_layout {self.expert_layout!r}: use egtp_inner (make_mesh's) or ep_inner"
            )
        if self.world % (self.ep * self.egtp):
            raise MeshError(
                f"mesh {self.label()}: ep*egtp={self.ep * self.egtp} must divide the world of "
                f"dp*gtp*tp={self.world} GPUs; change ep or egtp"
            )

    @classmethod
    def parse(cls, text: str, expert_layout: str = "egtp_inner") -> Mesh:
        """`"dp=8,gtp=8"` (axes left out are 1)."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in AXES or not value.isdigit():
                raise MeshError(
                    f"mesh item {item!r}: write AXIS=N with AXIS one of {', '.join(AXES)}, "
                    "e.g. --mesh dp=8,gtp=8"
                )
            if key in sizes:
                raise MeshError(f"mesh {text!r} gives {key} twice: give each axis once")
            sizes[key] = int(value)
        return cls(**sizes, expert_layout=expert_layout)

    @property
    def world(self) -> int:
        return self.dp * self.gtp * self.tp

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.egtp)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different batches (a TP group reads one)."""
        return self.dp * self.gtp

    def group(self, axis: str, gpus_per_node: int) -> Group:
        """Where the members of one `axis` group sit, `gpus_per_node` GPUs a node."""
        size, stride = {
            "tp": (self.tp, 1),
            "gtp": (self.gtp, self.tp),
            "dp": (self.dp, self.gtp * self.tp),
            "egtp": (self.egtp, 1 if self.expert_layout == "egtp_inner" else self.ep),
            "ep": (self.ep, self.egtp if self.expert_layout == "egtp_inner" else 1),
            "edp": (self.edp, self.ep * self.egtp),
            "data": (self.dp * self.gtp, self.tp),  # every data-parallel rank (replicated params)
        }[axis]
        per_node = max(1, min(size, gpus_per_node // stride))
        return Group(size, per_node)

    def label(self) -> str:
        text = ",".join(f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1)
        return text + (" (ep inner)" if self.expert_layout == "ep_inner" and self.ep > 1 else "")
