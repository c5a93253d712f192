"""Memory per GPU of a GTP step: shards, gradients, optimizer state, gathered buffers (bounded by
the prefetch depth and the group size, not the model's depth) and activations.

The peak is the larger of two moments: late in the forward (shards, optimizer state,
activations, logits, buffers) and the optimizer step (shards, gradients, optimizer state and a
shard-sized temporary of fused AdamW). At 1.36B on 2 H200s this gives 13.2 / 27.4 / 46.4 GiB
at batch 1 / 4 / 8 against the 12.72 / 27.35 / 46.85 GiB measured
(`benchmarks/results/bench_fused_adamw.json`).
"""

from __future__ import annotations

import dataclasses

from .mesh import Mesh
from .model import ModelConfig
from .precision import Precision

GIB = 2.0**30
# Saved for backward per token, per layer, in bf16, by the reference GPT's block: its input,
# the two norms' outputs, q/k/v, the rotated q and k, attention's output and its rearranged
# copy, the residual, and gate, up, silu(gate) and their product (4 x ffn).
ACT_D, ACT_FFN = 7, 4
LOGIT_BYTES = 10  # bf16 logits, their fp32 copy for the loss, its fp32 gradient


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per GPU."""

    weights: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    copies: float = 0.0  # compute-dtype copies of the shards of groups of one

    @property
    def peak(self) -> float:
        held = self.weights + self.copies + self.optimizer
        forward = held + self.gathered + self.activations + self.logits
        step = held + self.weights + self.grads  # + fused AdamW's temporary
        return max(forward, step)

    def rows(self) -> list[tuple[str, float]]:
        """(what, GiB) for tables."""
        return [
            ("weights (shards)", self.weights / GIB),
            *([("compute copies", self.copies / GIB)] if self.copies else []),
            ("gradients", self.grads / GIB),
            ("optimizer state", self.optimizer / GIB),
            ("gathered buffers", self.gathered / GIB),
            ("activations", self.activations / GIB),
            ("logits (loss)", self.logits / GIB),
            ("peak estimate", self.peak / GIB),
        ]


def sharded_numels(model: ModelConfig, mesh: Mesh) -> dict[int, float]:
    """Elements of sharded weights this GPU keeps, by the size of the group they are sharded
    over: dense weights over gtp (their tp part), expert stacks over egtp (their ep part)."""
    dense = sum(w.numel for w in model.weights() if w.kind != "expert")
    expert = sum(w.numel for w in model.weights() if w.kind == "expert")
    out = {mesh.gtp: dense / (mesh.gtp * mesh.tp)}
    out[mesh.egtp] = out.get(mesh.egtp, 0.0) + expert / (mesh.ep * mesh.egtp)
    return out


def local_numel(model: ModelConfig, mesh: Mesh) -> float:
    """Parameter elements this GPU keeps: dense weights over gtp x tp, expert stacks over
    ep x egtp, small parameters replicated."""
    return sum(sharded_numels(model, mesh).values()) + model.replicated_numel


def copied_numel(model: ModelConfig, mesh: Mesh) -> float:
    """Elements of the weights sharded over a group of one, which gather nothing and keep a
    compute-dtype copy of their shard (gtp_wrap/core/storage.py)."""
    return sharded_numels(model, mesh).get(1, 0.0)


def activation_bytes_per_token(model: ModelConfig, tp: int) -> float:
    """Saved activations per token for the whole model (sequence-parallel under tp)."""
    kv = model.qkv_rows - model.d
    attention = (ACT_D * model.d + model.qkv_rows + kv // 2) * 2.0
    if model.experts:
        f = model.expert_ffn
        mlp = (model.top_k * (2 * model.d + 4 * f) + (4 * f if model.shared_expert else 0)) * 2.0
    else:
        mlp = ACT_FFN * model.ffn * 2.0
    return model.layers * (attention + mlp) / tp


def memory(
    model: ModelConfig,
    mesh: Mesh,
    precision: Precision,
    tokens: float,
    depth: int,
    largest_group_numel: float,
    recompute: bool = False,
) -> Memory:
    """Memory per GPU for `tokens` per data rank, with gathers up to `depth` groups ahead of
    the group in use, each at most `largest_group_numel` full elements; with `recompute`, the
    blocks' inputs (bf16) and one block's activations."""
    shard = local_numel(model, mesh)
    # No more is gathered at once than the whole model (a tp rank's part of it), whatever the
    # depth and group size.
    everything = model.n_params / mesh.tp
    group = min(largest_group_numel, everything)
    gathered = min((depth + 1) * group, everything) * precision.gather_bytes
    if precision.encoded:  # a use's decoded copy beside the encoded buffers
        gathered += group * precision.compute_bytes
    gathered += 2 * group * precision.reduce_bytes  # a group's full gradient, and the next's
    return Memory(
        weights=shard * precision.master,
        grads=shard * precision.grad,
        optimizer=shard * precision.optimizer,
        gathered=gathered if mesh.gtp * mesh.egtp > 1 else 0.0,
        copies=copied_numel(model, mesh) * precision.compute_bytes
        if precision.compute_bytes < precision.master
        else 0.0,
        activations=tokens
        * (
            model.layers * model.d * 2.0 / mesh.tp
            + activation_bytes_per_token(model, mesh.tp) / model.layers
            if recompute
            else activation_bytes_per_token(model, mesh.tp)
        ),
        logits=tokens * model.vocab * LOGIT_BYTES / mesh.tp,
    )
