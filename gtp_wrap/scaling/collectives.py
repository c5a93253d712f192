"""α-β time of one collective over one group, from the group's placement and the links.

`nbytes` is the whole buffer: an all-gather's output, a reduce-scatter's or all-reduce's input,
an all-to-all's bytes sent by one member. Each member receives `(n-1)/n` of it (twice for an
all-reduce). A group inside a node moves it over NVLink; a group spanning nodes moves the
share that leaves a node through its members' NICs, `per_node` of them in parallel
(hierarchical, as NCCL's rings over one NIC per GPU do), and the rest over NVLink, whichever
takes longer. Latency: the link's α plus one hop per extra member on a ring; an all-reduce
across nodes goes as a tree (log2 hops), as NCCL picks at scale.
"""

from __future__ import annotations

import math

from .cluster import Cluster, Curve
from .mesh import Group

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _latency_s(curve: Curve, kind: str, group: Group) -> float:
    hops = 2 * math.log2(group.size) if kind == "all_reduce" and group.spans_nodes else 0.0
    extra = hops if hops else max(0, group.size - 2)
    rounds = 2 if kind == "all_reduce" else 1
    return (rounds * curve.alpha_us + extra * curve.hop_us) * 1e-6


def collective_s(cluster: Cluster, kind: str, nbytes: float, group: Group) -> float:
    """Seconds one collective of `kind` over `group` takes, alone on its links."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: one of {', '.join(KINDS)}")
    n, g = group.size, group.per_node
    if n <= 1 or nbytes <= 0:
        return 0.0
    rounds = 2.0 if kind == "all_reduce" else 1.0
    intra = cluster.intra.curve(kind)
    if not group.spans_nodes:
        wire = rounds * (n - 1) / n * nbytes / (intra.gbs * 1e9)
        return _latency_s(intra, kind, group) + wire
    inter = cluster.inter.curve(kind)
    leaving = (1 - g / n) * nbytes  # what a node receives from the others, per member's share
    if kind == "all_to_all":
        inter_s = leaving / (inter.gbs * 1e9)
        intra_s = (g - 1) / n * nbytes / (intra.gbs * 1e9)
    else:
        inter_s = rounds * leaving / (g * inter.gbs * 1e9)
        intra_s = rounds * (n - 1) / n * nbytes / (intra.gbs * 1e9) if g > 1 else 0.0
    return _latency_s(inter, kind, group) + max(inter_s, intra_s)
