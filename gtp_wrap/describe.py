"""What a policy did to a wrapped model: one row per parameter, from its engine.

`describe(model)` reads the engine's sharded weights (their names, geometry and mesh role), the
registered replicated parameters, and the decision each parameter's plan recorded at wrap time
(config/plan.py), so nothing here re-applies the rules.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .core.weight import CastWeight
from .io.state_dict import dtensor_shape
from .runtime.engine import engine_of


@dataclasses.dataclass(frozen=True)
class ParameterRow:
    """One unique parameter of a wrapped model (a shared one once, under its first FQN).

    Attributes:
        fqn: its first name; `aliases` are its other names (tied weights).
        shape: its logical (full, unpadded) shape, over every tp rank too (an expert stack's
            over every ep rank).
        shard_dim: the dim it is sharded along, or None when replicated.
        rule: the `match` of the rule that decided it, or None when no rule matched.
        reason: the decision in words ("rule 'Linear'", "below min_shard_numel (...)", ...).
        dtype: the dtype this rank stores it in (the master's); compute_dtype: the one its uses
            compute in.
        group: the mesh role its collectives run over: "gtp" for a sharded weight (gathered,
            its gradient reduce-scattered, then averaged over dp), "egtp" for an expert stack
            (the same over egtp, then edp), "world" (or "data" beside
            tensor parallelism) for a replicated one (its gradient all-reduced over every data
            rank); group_size: that role's ranks.
        bytes_per_rank: what this rank stores of it: its local rows (padding excluded) when
            sharded, the whole parameter (its tp block) when replicated.
        tp: its placement over the mesh's tp dim ("Shard(0)", "Replicate()") when torch's
            tensor parallelism split it (GTP shards or replicates its tp block), else None.
        ep: for an expert stack partitioned over the expert mesh's ep dim, that dim's size
            (each rank keeps shape[0] / ep experts, sharded over egtp), else None.
        gathers: what each gather of a sharded weight moves: its compute dtype ("bfloat16"),
            or packed "fp8" / "nvfp4" slots; None where nothing is gathered (a replicated
            parameter, or a weight sharded over a group of one, which reads its local copy).
    """

    fqn: str
    shape: tuple[int, ...]
    shard_dim: int | None
    rule: str | None
    reason: str
    dtype: str
    compute_dtype: str
    group: str
    group_size: int
    bytes_per_rank: int
    aliases: tuple[str, ...]
    tp: str | None = None
    ep: int | None = None
    gathers: str | None = None

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None


@dataclasses.dataclass(frozen=True)
class Description:
    """The rows of `describe`, with the mesh sizes; `str()` is a readable table."""

    rows: tuple[ParameterRow, ...]
    gtp_size: int
    dp_size: int
    tp_size: int = 1

    @property
    def sharded_bytes(self) -> int:
        """Bytes this rank stores of its sharded weights."""
        return sum(r.bytes_per_rank for r in self.rows if r.sharded)

    @property
    def replicated_bytes(self) -> int:
        """Bytes this rank stores of its replicated parameters."""
        return sum(r.bytes_per_rank for r in self.rows if not r.sharded)

    def __str__(self) -> str:
        header = (
            "parameter", "shape", "placement", "compute", "gathers", "group", "bytes/rank",
            "decided by",
        )  # fmt: skip
        lines = [
            (
                r.fqn + "".join(f" = {a}" for a in r.aliases),
                "x".join(map(str, r.shape)) or "scalar",
                (f"shard({r.shard_dim})" if r.sharded else "replicate")
                + (f", tp {r.tp}" if r.tp else "")
                + (f", ep S(0) over {r.ep}" if r.ep else ""),
                r.compute_dtype,
                r.gathers or "-",
                f"{r.group}={r.group_size}",
                f"{r.bytes_per_rank:,}",
                r.reason,
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header) - 1)]
        numeric = {6}  # right-aligned columns

        def fmt(row: tuple[str, ...]) -> str:
            cells = [
                cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
                for i, cell in enumerate(row[:-1])
            ]
            return "  ".join([*cells, row[-1]])

        rule = "-" * (sum(widths) + 2 * len(widths) + len(header[-1]))
        sharded = sum(r.sharded for r in self.rows)
        footer = (
            f"gtp={self.gtp_size} dp={self.dp_size} tp={self.tp_size}; per rank: sharded {sharded} "
            f"({self.sharded_bytes:,} bytes), replicated {len(self.rows) - sharded} "
            f"({self.replicated_bytes:,} bytes)"
        )
        return "\n".join([fmt(header), rule, *map(fmt, lines), rule, footer])


def describe(model: nn.Module) -> Description:
    """What the policy did to each parameter of the wrapped `model`, in registration order:
    its FQN and aliases, logical shape, sharded (and along which dim) or replicated, the rule
    or reason that decided it, the mesh role its collectives run over, and the bytes this rank
    stores of it. `print(gtp_wrap.describe(model))` shows it as a table; a model that is not
    wrapped raises WrapError."""
    engine = engine_of(model)
    sharded = {w.fqn: w for w in engine.weights}
    rows = []
    for decision in engine.decisions:
        fqn, aliases = decision.fqns[0], decision.fqns[1:]
        rule = decision.rule.match if decision.rule is not None else None
        w = sharded.get(fqn)
        if w is not None:
            local = w.param
            row = ParameterRow(
                fqn=fqn,
                shape=tuple(dtensor_shape(w)),
                shard_dim=w.geometry.dim,
                rule=rule,
                reason=decision.reason,
                dtype=_name(local.dtype),
                compute_dtype=_name(w.meta.dtype),
                group=w.axis.name,
                group_size=w.axis.size,
                bytes_per_rank=local.numel() * local.element_size(),
                aliases=aliases,
                tp=None if w.tp is None else str(w.tp.placement),
                ep=None if w.ep is None else w.ep.size,
                gathers=w.encoding.wire if w.axis.size > 1 else None,
            )
        else:
            param = model.get_parameter(fqn)
            cast = getattr(param, "gtp_weight", None)
            compute = cast.cast.dtype if isinstance(cast, CastWeight) else param.dtype
            tp = cast.tp if isinstance(cast, CastWeight) else None
            row = ParameterRow(
                fqn=fqn,
                shape=tuple(param.shape if tp is None else tp.shape),
                shard_dim=None,
                rule=rule,
                reason=decision.reason,
                dtype=_name(param.dtype),
                compute_dtype=_name(compute),
                group=engine.mesh.data.name,
                group_size=engine.mesh.data.size,
                bytes_per_rank=param.numel() * param.element_size(),
                aliases=aliases,
                tp=None if tp is None else str(tp.placement),
            )
        rows.append(row)
    mesh = engine.mesh
    return Description(tuple(rows), mesh.gtp.size, mesh.dp.size, mesh.tp.size)


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
