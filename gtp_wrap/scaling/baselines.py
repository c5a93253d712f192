"""FSDP2 and tensor parallelism on the same lanes, for comparison with GTP.

- FSDP2 (`fully_shard` on every block and the root, bf16 params, fp32 reductions, as
  bench_step's `fsdp2`): the shard group is the mesh's `gtp` axis (HSDP over `dp`); a
  mixture of experts keeps the mesh's expert parallelism and its all-to-alls. Each
  block's parameters are all-gathered as one collective, one block ahead of use (the host
  runs ahead, so the next block's gather is in flight while this one computes), and
  re-gathered in backward; the root's (embedding, head) are gathered once and kept until
  the end of backward. Its copy-in/copy-out moves the gathered and reduced bytes through
  HBM once more than GTP, and each block costs `host.fsdp2_block_us` of host time per step
  (`fsdp2_block_us_local` over a shard group of one, where FSDP2 gathers nothing).
  FSDP2's step is not captured in a CUDA graph: a graphed plan runs it eagerly.
- TP (Megatron-style with sequence parallelism): every weight split over `tp`; per layer and
  pass two all-gathers and two reduce-scatters of the layer's activations (`tokens x d`,
  bf16) on the critical path; gradients all-reduced over `dp` during backward; no sharding of
  weights, gradients or optimizer state beyond `tp`.
"""

from __future__ import annotations

import dataclasses

from .chain import Lanes, Stage, simulate
from .collectives import collective_s
from .predict import ADAMW_BYTES, Plan, Prediction, Use, finish, hbm_s, predict, uses

METHODS = ("gtp", "gtp_blocks", "floor", "fsdp2", "tp")


def _by_block(order: list[Use]) -> list[list[Use]]:
    """FSDP2's groups: each block's uses; the root's (embedding, head) uses on their own."""
    groups: list[list[Use]] = []
    key = None
    for use in order:
        k = (
            use.weight.layer
            if use.weight.kind in ("dense", "expert")
            else ("root", use.weight.name)
        )
        if k != key:
            groups.append([])
            key = k
        groups[-1].append(use)
    return groups


def fsdp2(plan: Plan) -> Prediction:
    """FSDP2's predicted step (always eager)."""
    plan = dataclasses.replace(plan, graphed=False)
    cfg, cl, mesh, prec = plan.cfg, plan.cluster, plan.mesh, plan.precision
    shard = mesh.group("gtp", cl.gpus_per_node)
    replicas = mesh.group("dp", cl.gpus_per_node)
    root = [w for w in cfg.weights() if w.kind in ("embedding", "head")]
    root_numel = sum(w.numel for w in root)
    alone = cl.host.fsdp2_block_us_local
    block_us = alone if alone is not None and shard.size == 1 else cl.host.fsdp2_block_us
    passes = []
    largest = 0.0
    for backward in (False, True):
        stages = []
        for g in _by_block(uses(plan, "floor", backward)):
            block = g[0].weight.kind in ("dense", "expert")
            numel = sum(u.numel for u in g) if block else root_numel
            largest = max(largest, numel)
            first_root = not block and g[0].weight.kind == "embedding" and not backward
            gathers_here = block or first_root
            gather = collective_s(cl, "all_gather", numel * 2.0, shard) if gathers_here else 0.0
            # copy-in of the shard (cast to bf16), copy-out of the gathered parameters
            copies = (
                numel / shard.size * 6.0 + numel * 4.0 if gathers_here and shard.size > 1 else 0.0
            )
            reduce = 0.0
            last_root = not block and g[0].weight.kind == "embedding" and backward
            if backward and (block or last_root):
                rs = numel * prec.reduce_bytes
                reduce = collective_s(cl, "reduce_scatter", rs, shard)
                reduce += collective_s(cl, "all_reduce", rs / shard.size, replicas)
                copies += numel * (2.0 + prec.reduce_bytes) if mesh.world > 1 else 0.0
            host = sum(u.host_s for u in g) + (block_us * 1e-6 / 2 if block else 0.0)
            compute = sum(u.compute_s for u in g) + hbm_s(cl, copies)
            inline = sum(u.inline_s for u in g)  # experts' all-to-alls (FSDP2 with EP)
            stages.append(Stage(gather, compute, host, reduce, inline))
        passes.append(stages)
    share, host_share = plan.share, plan.host_share
    passes = [
        [
            dataclasses.replace(s, compute_s=s.compute_s * share, host_s=s.host_s * host_share)
            for s in p
        ]
        for p in passes
    ]
    comm = mesh.world > 1
    timeline = simulate(
        passes,
        1,
        cl.contention_compute if comm else 1.0,
        cl.contention_comm if comm else 1.0,
        cl.async_host,
        Lanes(),
    )
    local = cfg.n_params / shard.size
    after = share * hbm_s(cl, local * ADAMW_BYTES)
    pred = finish(plan, "fsdp2", timeline, after, 0.0, len(passes[0]), largest)
    mem = pred.memory
    gathered = (2 * largest + root_numel) * 2.0 + largest * prec.reduce_bytes
    return dataclasses.replace(pred, memory=dataclasses.replace(mem, gathered=gathered))


def tp(plan: Plan) -> Prediction:
    """Tensor parallelism's predicted step over `plan.mesh.tp` (gtp must be 1)."""
    cfg, cl, mesh, prec = plan.cfg, plan.cluster, plan.mesh, plan.precision
    if mesh.gtp != 1 or mesh.ep != 1:
        raise ValueError(f"the tp baseline takes a mesh of dp and tp only, got {mesh.label()}")
    group = mesh.group("tp", cl.gpus_per_node)
    replicas = mesh.group("dp", cl.gpus_per_node)
    act = plan.tokens * cfg.d * 2.0
    per_layer = 2 * (
        collective_s(cl, "all_gather", act, group) + collective_s(cl, "reduce_scatter", act, group)
    )
    passes = []
    share = plan.share
    for backward in (False, True):
        stages = []
        for u in uses(plan, "floor", backward):
            inline = per_layer if u.weight.name.endswith(".o") else 0.0
            reduce = 0.0
            if backward:
                grad = u.numel * prec.reduce_bytes
                reduce = collective_s(cl, "all_reduce", grad, replicas)
            host = 0.0 if plan.graphed else u.host_s * plan.host_share
            stages.append(Stage(0.0, u.compute_s * share, host, reduce, inline))
        passes.append(stages)
    comm = replicas.size > 1
    timeline = simulate(
        passes, 0, cl.contention_compute if comm else 1.0, 1.0, cl.async_host, Lanes()
    )
    local = cfg.n_params / mesh.tp
    after = share * hbm_s(cl, local * ADAMW_BYTES)
    return finish(plan, "tp", timeline, after, 0.0, 0, 0.0)  # weights etc. over tp: memory()


def predict_method(plan: Plan, method: str) -> Prediction:
    """`gtp`, `gtp_blocks`, `floor`, `fsdp2` or `tp` on `plan`."""
    if method in ("gtp", "gtp_blocks", "floor"):
        return predict(plan, method)  # type: ignore[arg-type]
    if method == "fsdp2":
        return fsdp2(plan)
    if method == "tp":
        return tp(plan)
    raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
