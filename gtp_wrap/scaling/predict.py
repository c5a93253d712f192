"""The predicted GTP training step: the chain's groups built as the engine cuts them, their
gathers, compute and reductions simulated on the host, compute and communication lanes
(`chain.simulate`), then the optimizer step; and the memory per GPU.

Per GPU, with `m = batch x seq` tokens per data rank:
- compute: each weight use's GEMMs (forward 2·m·rows·cols / tp FLOPs, backward twice that)
  at the cluster's GEMM rate plus a fixed cost per GEMM; attention; the layer's elementwise
  work (bytes per token at HBM speed) and small-kernel overhead; the loss over the vocabulary;
  the engine's own work (each gather casts this rank's fp32 shard into its buffer, FP8 or
  NVFP4 gathers decode per use at the measured kernel rate, weight gradients are written in
  fp32); AdamW over the shard.
- communication: per chain group one all-gather over gtp (egtp for expert stacks) per pass,
  and in backward one reduce-scatter, then the shard's all-reduce over dp (edp); experts'
  token all-to-alls over ep (on the critical path); replicated parameters all-reduced last.
- host: eager steps launch every use (`host.use_us`) and layer (`host.layer_us`); a graphed
  step replays with `host.graph_step_us`.

`gtp_blocks` is the engine with its blocks on gathered weights (`gather_per_block`, gtp-train's
default): see [Note: blocks in the model].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .chain import Lanes, Stage, Timeline, simulate
from .cluster import Cluster
from .collectives import collective_s
from .memory import Memory, local_numel, memory, sharded_numels
from .mesh import Mesh
from .model import ModelConfig, Weight
from .precision import Precision

Method = Literal["gtp", "floor", "gtp_blocks"]
ADAMW_BYTES = 28.0  # fused AdamW per fp32 element: read param, grad, m, v; write param, m, v
BACKWARD_SHARE = 2.0 / 3.0  # of a layer's elementwise work and small kernels
ATTENTION_BACKWARD = 2.5  # backward FLOPs of attention over forward (recomputed scores)


class PlanError(ValueError):
    """A plan whose parts do not fit together."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step to predict: `batch` sequences of `seq` tokens per data rank (seq 0: the
    model's), gathers `prefetch_depth` groups ahead in groups of `group_numel` elements.
    `recompute`: activation checkpointing per block (only the blocks' inputs are kept; backward
    runs each block's forward again on the weights it re-gathers anyway). `slowdown`: how
    many times slower each rank computes than the calibration measured (0: the cluster's own
    figure for the world, 1 unless ranks oversubscribe a node's units; a measured run on a
    shared CPU gives its own). `host_slowdown`: how many times slower the host launches work
    than the calibration's host did (0: as fast; a measured GPU run's host probe against the
    calibration's gives it, see benchmarks/host_probe.py)."""

    model: ModelConfig
    cluster: Cluster
    mesh: Mesh
    batch: float = 1.0
    seq: int = 0
    precision: Precision = Precision()
    graphed: bool = False
    prefetch_depth: int = 1
    group_numel: int = 1 << 24
    recompute: bool = False
    slowdown: float = 0.0
    host_slowdown: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.batch < math.inf:
            raise PlanError(f"batch={self.batch}: give a number of sequences per data rank above 0")
        if self.prefetch_depth < 0 or self.group_numel < 0:
            raise PlanError("prefetch_depth and group_numel must be >= 0 (as in GTPPolicy)")
        m, mesh = self.model, self.mesh
        if m.experts and m.experts % mesh.ep:
            raise PlanError(f"ep={mesh.ep} must divide the model's {m.experts} experts")
        if mesh.ep > 1 and not m.experts:
            raise PlanError(f"mesh ep={mesh.ep} but model {m.name!r} has no experts; drop ep")
        if m.heads % mesh.tp:
            raise PlanError(f"tp={mesh.tp} must divide the model's {m.heads} heads")
        if m.experts and mesh.tp > 1:  # as GTPWrap refuses it (mesh.py: resolve_mesh)
            raise PlanError(
                f"mesh tp={mesh.tp} with model {m.name!r}, a mixture of experts: gtp_wrap does "
                "not run experts beside tensor parallelism yet; drop tp (shard with gtp, ep, egtp)"
            )

    @property
    def cfg(self) -> ModelConfig:
        return self.model.with_seq(self.seq) if self.seq else self.model

    @property
    def tokens(self) -> float:
        return self.batch * self.cfg.seq

    @property
    def share(self) -> float:
        """The factor on each rank's compute and host time (see `slowdown`)."""
        return self.slowdown or self.cluster.share(self.mesh.world)

    @property
    def host_share(self) -> float:
        """The factor on each rank's host time: `share`, and the host's own speed."""
        return self.share * (self.host_slowdown or 1.0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step (seconds) and memory per GPU. `compute + exposed_comm + host =
    step`; `comm_busy` is the time collectives run, hidden or not: the communication stream's
    and those in line on the compute stream (tensor parallelism's, the experts' all-to-all)."""

    method: str
    plan: Plan
    step: float
    compute: float
    exposed_comm: float
    host: float
    comm_busy: float
    memory: Memory
    groups_per_pass: int
    largest_group_numel: float

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.plan.tokens / self.plan.mesh.tp / self.step

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.plan.cluster.memory_gib * 2.0**30

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) lines of the breakdown."""
        ms = 1e3
        rows = [
            ("step", f"{self.step * ms:.1f} ms"),
            ("  compute", f"{self.compute * ms:.1f} ms"),
            ("  exposed communication", f"{self.exposed_comm * ms:.1f} ms"),
            ("  host", f"{self.host * ms:.1f} ms"),
            ("communication busy (hidden or not)", f"{self.comm_busy * ms:.1f} ms"),
            ("tokens/s/GPU", f"{self.tokens_per_s_per_gpu:,.0f}"),
        ]
        if self.method == "floor":  # compute alone: it has no chain, and no GPU holds its state
            return rows
        return (
            rows
            + [("chain groups per pass", str(self.groups_per_pass))]
            + [(f"memory: {what}", f"{gib:.2f} GiB") for what, gib in self.memory.rows()]
        )


@dataclasses.dataclass(frozen=True)
class Use:
    """One weight use in a pass, with what it costs on each lane. `numel` is the weight as
    this rank's group gathers it whole (its tp part, or its ep experts)."""

    weight: Weight
    numel: float
    gathered: bool  # False: the embedding's backward (a lookup's gradient, nothing gathered)
    compute_s: float
    host_s: float
    inline_s: float = 0.0  # communication on the critical path (experts' all-to-alls)


def gemm_s(cluster: Cluster, m: float, n: float, k: float) -> float:
    """One GEMM of an `m x k` by `k x n` product, in whole waves of output tiles; one with
    fewer tiles than units splits its `k` among them (split-K), as cuBLAS does for a weight
    gradient's small output and long sum: one wave of tiles, each summing a share of `k`."""
    c = cluster.compute
    tiles = math.ceil(m / c.gemm_tile_m) * math.ceil(n / c.gemm_tile_n)
    if tiles == 0:  # an empty product (no tokens on this rank)
        return 0.0
    split = max(1, c.gemm_units // tiles)
    waves = math.ceil(tiles * split / c.gemm_units)
    flops = 2.0 * waves * c.gemm_units * c.gemm_tile_m * c.gemm_tile_n * k / split
    return flops / (c.gemm_tflops * 1e12) + c.gemm_overhead_us * 1e-6


def weight_gemms_s(plan: Plan, w: Weight, backward: bool) -> float:
    """A use's GEMMs: forward `y = x W^T`; backward the input gradient and the weight
    gradient. An expert stack's GEMMs run the tokens routed to this rank's experts (top_k
    slots per token, balanced), as one grouped GEMM."""
    cl, m = plan.cluster, plan.tokens
    if w.kind == "embedding":
        return 0.0
    rows, cols = w.rows, w.cols
    if w.kind == "expert":
        m = m * plan.cfg.top_k
    else:
        rows = math.ceil(rows / plan.mesh.tp)  # column- or row-parallel: a tp-th of the GEMM
    if not backward:
        return gemm_s(cl, m, rows, cols)
    return gemm_s(cl, m, cols, rows) + gemm_s(cl, rows, cols, m)


def hbm_s(cluster: Cluster, nbytes: float) -> float:
    return nbytes / (cluster.compute.hbm_gbs * 1e9)


def local_full_numel(w: Weight, mesh: Mesh) -> float:
    """Elements of `w` this rank's group gathers whole: its tp part, or its ep experts."""
    return w.numel / (mesh.ep if w.kind == "expert" else mesh.tp)


def loss_bytes(compute_bytes: float) -> float:
    """Bytes of device memory moved per logit by the fp32 cross-entropy, forward and backward,
    over logits in a `compute_bytes` dtype, as torch runs it: log-softmax reads and writes fp32
    (8); nll_loss's backward writes a zeroed fp32 gradient (4), which log-softmax's backward
    reads beside its output to write its own (12); narrower logits are copied to fp32 first
    and their gradient cast back (read and write each way). bf16: 36 bytes, in the kernels of
    an H100 step (`benchmarks/RESULTS.md`, 2026-12-06) about 1.0 ms per 65.5M logits. As the
    benchmarks and calibrate.py compute it, on logits cast to fp32 (`.float()`)."""
    casts = 2 * (compute_bytes + 4.0) if compute_bytes < 4.0 else 0.0
    return 24.0 + casts


def attention_layer_s(cluster: Cluster, cfg: ModelConfig, tokens: float) -> float:
    """Seconds of one layer's attention over `tokens`, forward and backward: its FLOPs at the
    cluster's attention rate, plus the kernels' fixed time per layer."""
    flops = tokens * cfg.attention_flops_per_token() * (1 + ATTENTION_BACKWARD)
    c = cluster.compute
    return flops / (c.attention_tflops * 1e12) + c.attention_layer_us * 1e-6


def layer_costs(plan: Plan, layer: int, backward: bool) -> float:
    """Device seconds of a layer's work that is not its weights' GEMMs: attention, elementwise
    kernels, small-kernel overhead (and the loss, for the head: layer -1)."""
    cfg, cl, mesh, m = plan.cfg, plan.cluster, plan.mesh, plan.tokens
    share = BACKWARD_SHARE if backward else 1 - BACKWARD_SHARE
    if layer < 0:
        logits = m * cfg.vocab / mesh.tp
        return share * hbm_s(cl, logits * loss_bytes(plan.precision.compute_bytes))
    attn = attention_layer_s(cl, cfg, m / mesh.tp) / (1 + ATTENTION_BACKWARD)
    width = cfg.d + (cfg.top_k * cfg.expert_ffn if cfg.experts else cfg.ffn)
    elementwise = hbm_s(cl, m * width * cl.compute.elementwise_bytes / mesh.tp)
    small = cl.compute.layer_overhead_us * 1e-6
    return (attn * ATTENTION_BACKWARD if backward else attn) + share * (elementwise + small)


def pass_order(cfg: ModelConfig, backward: bool, blocks: bool = False) -> list[tuple[Weight, bool]]:
    """(weight, gathered) in a pass's order. A tied head reads the embedding's weight again;
    backward re-gathers every weight but the embedding, whose gradient (a lookup's) is still
    reduced, last. With `blocks`, backward re-gathers each layer's weights together, in the
    layer's own order (runtime/gather.py, [Note: a block's weights come back together])."""
    order = cfg.weights()
    embed = order[0]
    if cfg.tie_embeddings:
        order = order + [dataclasses.replace(embed, kind="head", name="head")]
    if not backward:
        return [(w, True) for w in order]
    back = list(reversed(order[1:]))
    if blocks:
        root = [w for w in back if w.layer < 0]
        back = root + [w for i in reversed(range(cfg.layers)) for w in order if w.layer == i]
    return [(w, True) for w in back] + [(embed, False)]


def uses(plan: Plan, method: Method, backward: bool, comm: bool = True) -> list[Use]:
    """The uses of one pass, in chain order, with their lanes' costs (`comm=False`: without
    the experts' all-to-alls, for the no-communication floor)."""
    cfg, cl, mesh = plan.cfg, plan.cluster, plan.mesh
    m = plan.tokens
    blocks = method == "gtp_blocks"
    if blocks and cl.host.block_us is None:
        raise PlanError(
            f"cluster {cl.name!r} has no host.block_us (its calibration predates gtp_blocks): "
            "re-run benchmarks/calibrate.py on that machine, or predict --method gtp"
        )
    block_us = cl.host.block_us or 0.0
    out = []
    for w, gathered in pass_order(cfg, backward, blocks):
        full = local_full_numel(w, mesh)
        sharded = (mesh.egtp if w.kind == "expert" else mesh.gtp) > 1  # gathered per use
        compute = weight_gemms_s(plan, w, backward)
        host = 0.0
        again = backward and plan.recompute and w.layer >= 0  # the block's forward, recomputed
        if again:
            compute += weight_gemms_s(plan, w, False)
        if w.name.endswith(".o"):  # the layer's other work sits around its attention output
            compute += layer_costs(plan, w.layer, backward)
            compute += layer_costs(plan, w.layer, False) if again else 0.0
            host += cl.host.layer_us * 1e-6 / (1 if again else 2)
        if w.kind == "head":
            compute += layer_costs(plan, -1, backward)
        if not gathered:  # the embedding's gradient: an index_add of the tokens' rows, in fp32
            compute += hbm_s(cl, m * cfg.d * 4.0 * 2)
        dispatch = comm and w.name.endswith("gate_up")
        inline = 2 * expert_all_to_all_s(plan) if dispatch else 0.0
        inline *= 2 if again else 1
        in_block = blocks and w.layer >= 0
        if in_block:
            compute += engine_s(plan, w, full, backward, autograd_grad=True)
            # A block's weights are gathered (and their collectives launched) without an
            # intercepted use each; the block's call costs `block_us` a step.
            host += (cl.host.use_us - cl.host.use_us_local) * 1e-6 if sharded else 0.0
            if w.name.endswith(".o"):
                host += block_us * 1e-6 / 2
        elif method in ("gtp", "gtp_blocks"):
            compute += engine_s(plan, w, full, backward) if gathered else 0.0
            host += (cl.host.use_us if sharded else cl.host.use_us_local) * 1e-6
        out.append(Use(w, full, gathered, compute, host, inline))
    return out


def engine_s(
    plan: Plan,
    w: Weight,
    full: float,
    backward: bool,
    autograd_grad: bool = False,
) -> float:
    """The engine's work per use beside the GEMMs: the cast of this rank's shard into the
    gather buffer, or the decode of an encoded gather (a weight sharded over a group of one
    gathers nothing: its copy is cast once per step, see `step_engine_s`), and in backward
    the fp32 weight gradient's extra bytes: the engine's linear writes it in fp32 (2 bytes
    more per element than bf16); autograd's (`autograd_grad`, inside a block) writes it in
    bf16, cast to fp32 after (read 2, write 4)."""
    prec, cl = plan.precision, plan.cluster
    group = plan.mesh.egtp if w.kind == "expert" else plan.mesh.gtp
    nbytes = 0.0
    if group > 1 and not prec.encoded:
        nbytes += full / group * prec.cast_bytes_per_shard_element()
    if backward and prec.reduce_bytes > prec.compute_bytes:
        extra = prec.reduce_bytes + (prec.compute_bytes if autograd_grad else -prec.compute_bytes)
        nbytes += full * extra
    decode = cl.compute.decode_s(prec.gather, full) if prec.encoded and group > 1 else 0.0
    return hbm_s(cl, nbytes) + decode


def expert_all_to_all_s(plan: Plan) -> float:
    """One all-to-all of a layer's routed tokens (top_k slots of d in bf16) over ep."""
    cfg, mesh, cl = plan.cfg, plan.mesh, plan.cluster
    if not cfg.experts or mesh.ep <= 1:
        return 0.0
    nbytes = plan.tokens * cfg.top_k * cfg.d * 2.0
    return collective_s(cl, "all_to_all", nbytes, mesh.group("ep", cl.gpus_per_node))


def cut_groups(order: list[Use], group_numel: int, blocks: bool = False) -> list[list[Use]]:
    """The engine's cut of a chain (`runtime/chain.py`, Chain.build): close a group once its
    weights reach `group_numel` elements, never inside a layer's expert stacks (nor, with
    `blocks`, inside a layer: a block on gathered weights), and before a weight of the other
    axis (dense or expert)."""
    groups: list[list[Use]] = [[]]
    size = 0.0
    for i, use in enumerate(order):
        groups[-1].append(use)
        size += use.numel
        w = use.weight
        nxt = order[i + 1].weight if i + 1 < len(order) else None
        if nxt is None:
            break
        same_layer = nxt.layer == w.layer >= 0
        unit = same_layer and (blocks or w.kind == "expert" == nxt.kind)
        if (nxt.kind == "expert") != (w.kind == "expert") or (size >= group_numel and not unit):
            groups.append([])
            size = 0.0
    return groups


def group_comm_s(plan: Plan, group: list[Use], kind: str) -> float:
    """One group's gather (`all_gather`) or gradient reduction (`reduce_scatter` over its
    shard axis, then the shards' all-reduce over the replicas)."""
    cl, mesh, prec = plan.cluster, plan.mesh, plan.precision
    expert = group[0].weight.kind == "expert"
    shard_group = mesh.group("egtp" if expert else "gtp", cl.gpus_per_node)
    if kind == "all_gather":
        sizes = [u.numel * prec.gather_bytes for u in group if u.gathered]
    else:
        sizes = [u.numel * prec.reduce_bytes for u in group]
    parts = [sum(sizes)] if cl.grouped_collectives and sizes else sizes
    total = sum(collective_s(cl, kind, b, shard_group) for b in parts)
    if kind == "reduce_scatter":
        replicas = mesh.group("edp" if expert else "dp", cl.gpus_per_node)
        total += sum(collective_s(cl, "all_reduce", b / shard_group.size, replicas) for b in parts)
    return total


def stages(plan: Plan, groups: list[list[Use]], gathers: bool, reduces: bool) -> list[Stage]:
    """The chain groups as lanes' stages, compute and host scaled on an oversubscribed node."""
    share, host = plan.share, plan.host_share
    return [
        Stage(
            gather_s=group_comm_s(plan, g, "all_gather") if gathers else 0.0,
            compute_s=share * sum(u.compute_s for u in g),
            host_s=0.0 if plan.graphed else host * sum(u.host_s for u in g),
            reduce_s=group_comm_s(plan, g, "reduce_scatter") if reduces else 0.0,
            inline_s=sum(u.inline_s for u in g),
        )
        for g in groups
    ]


def block_stages(plan: Plan, groups: list[list[Use]], gathers: bool, reduces: bool) -> list[Stage]:
    """The chain groups of a step whose blocks run on gathered weights as lanes' stages.

    [Note: blocks in the model] A block (a layer) on gathered weights gathers all of its
    weights before its forward runs, along the chain as every use does, and in backward
    re-gathers them together at its first saved weight (in the layer's own order) and hands
    their gradients to the reduction when its backward ends. So a layer's compute and launches
    sit on the stage of the chain group that holds its last weight of the pass, and its
    reductions are issued there, cut into groups by size within the layer (the reducer carries
    a group on across layers; the root's uses are reduced one by one here). The chain
    keeps a layer's weights in one group (runtime/chain.py, [Note: a block's weights in one
    group]) but where its axes differ (dense, then expert stacks), and prefetches to the end
    of the next layer: a group that only starts a layer has nothing to compute. The root's
    weights (embedding, head) stay per use."""
    share, host = plan.share, plan.host_share
    last: dict[int, int] = {}  # layer -> the group holding its last use of the pass
    for i, g in enumerate(groups):
        for u in g:
            if u.weight.layer >= 0:
                last[u.weight.layer] = i
    n = len(groups)
    compute, hosts, inline, reduce = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    by_layer: dict[int, list[Use]] = {}
    for i, g in enumerate(groups):
        for u in g:
            layer = u.weight.layer
            at = last[layer] if layer >= 0 else i
            compute[at] += u.compute_s
            hosts[at] += u.host_s
            inline[at] += u.inline_s
            if layer >= 0:
                by_layer.setdefault(layer, []).append(u)
            elif reduces:
                reduce[i] += group_comm_s(plan, [u], "reduce_scatter")
    if reduces:
        for layer, block in by_layer.items():
            cuts = cut_groups(block, plan.group_numel)
            reduce[last[layer]] += sum(group_comm_s(plan, c, "reduce_scatter") for c in cuts)
    # The prefetch reaches to the end of the next layer (runtime/chain.py, Chain.reach).
    first = {layer: min(i for i, g in enumerate(groups) for u in g if u.weight.layer == layer)
             for layer in last}  # fmt: skip
    starts = sorted((i, layer) for layer, i in first.items())

    def reach(i: int) -> int:
        return next((last[layer] for start, layer in starts if start > i), -1)

    return [
        Stage(
            gather_s=group_comm_s(plan, g, "all_gather") if gathers else 0.0,
            compute_s=share * compute[i],
            host_s=0.0 if plan.graphed else host * hosts[i],
            reduce_s=reduce[i],
            inline_s=inline[i],
            reach=reach(i),
        )
        for i, g in enumerate(groups)
    ]


def step_engine_s(plan: Plan) -> float:
    """The engine's once-per-step work: the compute copies of the weights sharded over a group
    of one, and the encode of the others' shards for encoded gathers (with the replicated
    parameters' casts, where any of that runs)."""
    prec, mesh = plan.precision, plan.mesh
    numel = sum(
        n for group, n in sharded_numels(plan.cfg, mesh).items() if group == 1 or prec.encoded
    )
    if numel:
        numel += plan.cfg.replicated_numel
    return hbm_s(plan.cluster, numel * prec.cast_bytes_per_shard_element())


def optimizer_s(plan: Plan, method: str) -> float:
    """Fused AdamW over this rank's fp32 elements: the shard (the floor steps 1/world of the
    model, as bench_step's floor does)."""
    cfg, mesh = plan.cfg, plan.mesh
    numel = cfg.n_params / mesh.world if method == "floor" else local_numel(cfg, mesh)
    return hbm_s(plan.cluster, numel * ADAMW_BYTES)


def replicated_s(plan: Plan) -> float:
    """The replicated parameters' gradient all-reduce over every data rank (once, at the end)."""
    cl, mesh = plan.cluster, plan.mesh
    nbytes = plan.cfg.replicated_numel * plan.precision.reduce_bytes
    return collective_s(cl, "all_reduce", nbytes, mesh.group("data", cl.gpus_per_node))


def finish(
    plan: Plan,
    method: str,
    timeline: Timeline,
    after_compute_s: float,
    after_comm_s: float,
    groups: int,
    largest: float,
) -> Prediction:
    """The step from the passes' timeline, then the collectives and compute after them (the
    replicated gradients, the optimizer) while the host launches the step's tail."""
    cl = plan.cluster
    tail_us = cl.host.graph_step_us if plan.graphed else cl.host.step_us
    host_tail = plan.host_share * tail_us * 1e-6
    device_end = timeline.end + after_comm_s + after_compute_s
    if cl.async_host:
        host_end = timeline.lanes.host + host_tail
        step = max(device_end, host_end)
        host = timeline.host_wait + max(0.0, host_end - device_end)
    else:
        step = device_end + host_tail
        host = timeline.host_wait + host_tail
    compute = timeline.compute + after_compute_s
    mem = memory(
        plan.cfg,
        plan.mesh,
        plan.precision,
        plan.tokens,
        plan.prefetch_depth,
        largest,
        plan.recompute,
    )
    return Prediction(
        method,
        plan,
        step,
        compute,
        step - compute - host,
        host,
        timeline.comm_busy + after_comm_s,
        mem,
        groups,
        largest,
    )


def predict(plan: Plan, method: Method = "gtp") -> Prediction:
    """The predicted step of `method`: `gtp` (the engine on `plan.mesh`), `gtp_blocks` (the
    same with its blocks on gathered weights, see [Note: blocks in the model]) or `floor`
    (the same model's compute with no communication and no engine, its AdamW over 1/world of
    the parameters: bench_step's floor)."""
    cl, mesh = plan.cluster, plan.mesh
    engine = method != "floor"
    gathers = engine and mesh.gtp * mesh.egtp > 1
    reduces = engine and mesh.world > 1
    blocks = method == "gtp_blocks"
    fwd = cut_groups(uses(plan, method, False, engine), plan.group_numel, blocks)
    bwd = cut_groups(uses(plan, method, True, engine), plan.group_numel, blocks)
    build = block_stages if blocks else stages
    contended = gathers or reduces
    timeline = simulate(
        [build(plan, fwd, gathers, False), build(plan, bwd, gathers, reduces)],
        plan.prefetch_depth,
        cl.contention_compute if contended else 1.0,
        cl.contention_comm if contended else 1.0,
        cl.async_host,
        Lanes(),
    )
    share = plan.share
    after_compute = share * optimizer_s(plan, method)
    if engine:
        after_compute += share * step_engine_s(plan)
    after_comm = replicated_s(plan) if reduces else 0.0
    largest = max(sum(u.numel for u in g) for g in fwd + bwd)
    return finish(plan, method, timeline, after_compute, after_comm, len(fwd), largest)
