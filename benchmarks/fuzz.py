"""Fuzz GTPWrap: random small models, policies and meshes, each trained to parity or refused.

    python benchmarks/fuzz.py --cases 3000 --seed 1 --time-limit 570 \
        --out benchmarks/results/fuzz.json
    python benchmarks/fuzz.py --case SEED  # one case, printed and run

Each case is drawn from its seed alone (every rank draws the same one): a world of 1 to 4 gloo
ranks and a mesh over it (the default 1-D one, or dp x gtp), a small model (an embedding,
convolutions or plain vectors in front of linear layers, norms, attention, tied weights, a layer
called twice or registered twice, a weight read outside its module, frozen parameters,
activation checkpointing), built whole or on the meta device, and a policy (random rules,
min_shard_numel, group_numel, prefetch_depth, alignment, loss reduction, strictness,
gather_per_block, a precision; sometimes an invalid field or a rule for a tp dim or experts the
case lacks), trained a few SGD or AdamW steps with gradient accumulation, clipping (norm 2, 1 or
inf) and no-grad evaluations at random. Every rank trains the wrapped model on its own slice of
each global batch; rank 0 trains the unwrapped model on the whole batch (see Reference) and
compares losses, clipped norms, evaluation outputs and every final weight and buffer, within
the case's precision's Tolerance.

A case ends in one of: "parity"; "refused" (GTPWrap raised a GTPError subclass on every rank);
"failed" (anything else: another exception at wrap, any exception in training, ranks
disagreeing, values off the reference, a hang). All cases of one world size run in one spawn of
its ranks; after a case failed with an exception (its collectives may be half done) the spawn
stops and the driver starts a new one at the next case. Prints a summary and writes it, with
every case's record, as JSON: cases run, refusals by error class and message head, parity
passes by feature, the largest share of its bound a passing case took, every failure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.multiprocessing.spawn import ProcessException
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

import gtp_wrap
from gtp_wrap import GTPError, GTPWrap
from gtp_wrap.config.policy import policy_dtype

WORLDS = (1, 2, 2, 3, 4, 4)  # drawn from: more weight where there is something to shard over
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "none": lambda x: x,
}
# Precisions a CPU runs (fp8 gathers and fp8 GEMMs included), with the tolerance level each
# is compared at: the least precise of its gather, compute and reduction dtypes.
PRECISIONS: dict[str, tuple[dict[str, Any], str]] = {
    "fp32": ({}, "fp32"),
    "param_fp32": ({"param_dtype": "float32", "reduce_dtype": "float32"}, "fp32"),
    "bf16": ({"param_dtype": "bfloat16"}, "bf16"),
    "bf16_reduce_fp32": ({"param_dtype": "bfloat16", "reduce_dtype": "float32"}, "bf16"),
    "fp16": ({"param_dtype": "float16"}, "fp16"),
    "fp16_reduce_fp32": ({"param_dtype": "float16", "reduce_dtype": "float32"}, "fp16"),
    "reduce_bf16": ({"reduce_dtype": "bfloat16"}, "bf16"),
    "fp8": ({"param_dtype": "bfloat16", "reduce_dtype": "float32", "gather_dtype": "fp8"}, "fp8"),
    "fp8_gemm": (
        {
            "param_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "gather_dtype": "fp8",
            "fp8_matmul": True,
        },
        "fp8",
    ),
    "fp8_no_param_dtype": ({"gather_dtype": "fp8"}, "fp8"),
}
# Invalid or contradictory policy fields: a wrap must refuse each with a GTPError.
INVALID_FIELDS: tuple[dict[str, Any], ...] = (
    {"prefetch_depth": -1},
    {"group_numel": -4},
    {"min_shard_numel": -1},
    {"param_dtype": "int8"},
    {"reduce_dtype": "float64"},
    {"gather_dtype": "fp4"},
    {"fp8_matmul": True},
    {"loss_reduction": "max"},
    {"collective_timeout_s": 0},
    {"collectives": "copy_engine"},  # needs CUDA symmetric memory
    {"prefetch_depth": 1.5},
    {"shard_everything": True},
)
# Rules for what the fuzz's meshes and models do not have: a tp dim, expert stacks.
UNSUPPORTED_RULES: tuple[dict[str, Any], ...] = (
    {"match": "Linear", "tp": "colwise"},
    {"match": "body.*", "tp": "rowwise"},
    {"match": "Linear", "group": "egtp"},
    {"match": "*weight", "group": "egtp", "dim": 1},
)
OPTIMIZER_LR = {"sgd": 0.05, "adamw": 1e-2}
# The evaluation batch: as many samples as this many ranks' batches, enough for the norm of its
# outputs' rounding noise to be told from one sample of it.
EVAL_RANKS = 8


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a wrapped run may be from the exact reference (see Reference), in L2 norm:
    `noise` times how far the noisy reference is from it (the rounding of the policy's dtypes
    and of the ranks' summation order, which a badly conditioned model amplifies), plus, for
    each final tensor, `update` of how far training moved it and `value` of its norm, and for
    losses, clipped norms and evaluation outputs `output` of their norm. The noisy reference is
    one draw of the rounding: after a few steps the wrapped run's own draw was seen up to 5.8
    times as far from the exact one in bf16 (its first gradients about as far as the noisy
    one's) and 3.4 times in FP8, whose gathers the noisy reference rounds per weight, not per
    block of 128 elements."""

    noise: float
    update: float
    value: float
    output: float


TOLERANCES = {
    "fp32": Tolerance(noise=3.0, update=1e-3, value=1e-6, output=1e-4),
    "fp16": Tolerance(noise=3.0, update=5e-3, value=1e-3, output=2e-3),
    "bf16": Tolerance(noise=8.0, update=0.02, value=4e-3, output=1e-2),
    "fp8": Tolerance(noise=5.0, update=0.1, value=1e-2, output=3e-2),
}


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a model's forward (see FuzzNet.forward).

    Stem ops: "embed" (`width` features, `ref` its padding_idx or -1), "positions" (a position
    embedding), "conv" (`width` channels out, kernel size `ref`, then the norm `arg` if any),
    "again" (the conv op `ref` called again). Body ops on the last dim: "linear" (to `width`
    features, then the activation `arg`), "residual" (x + arg(linear(x))), "tied" (a residual
    whose weight is op `ref`'s), "again" (op `ref`'s layer called again, as a residual),
    "shared" (op `ref`'s layer registered again here, and called as a residual),
    "outside" (op `ref`'s weight read by the parent's forward), "norm" (kind `arg`, affine
    when `bias`), "attn" (self-attention, `width` heads).
    """

    name: str
    width: int = 0
    bias: bool = True
    ref: int = -1
    arg: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A small model as plain data: what it eats, its ops and which parameters are frozen."""

    kind: str  # "tokens" (index sequences), "vectors", "images" (N, C, H, W), "signals" (N, C, L)
    in_width: int  # vocabulary, vector features or input channels
    stem: tuple[Op, ...]  # the embedding or the convolutions
    body: tuple[Op, ...]  # ops on features of the last dim
    out_width: int  # logits or regression targets
    head_bias: bool
    tie_head: bool  # tokens: the head reads the embedding's weight
    frozen: tuple[int, ...]  # indices into the unique parameters, taken modulo their number
    checkpoint: bool  # each body op under activation checkpointing (recomputed in backward)


@dataclasses.dataclass(frozen=True)
class Case:
    """One fuzz case, drawn from `seed` alone."""

    seed: int
    world: int
    mesh: tuple[int, int] | None  # (dp, gtp); None: the default 1-D mesh over the world
    model: ModelSpec
    policy: dict[str, Any]
    precision: str
    optimizer: str  # "sgd" or "adamw"
    steps: int
    micro_batches: int
    batch: int  # samples per rank
    seq_lens: tuple[int, ...]  # tokens: the sequence length of each step
    clip: tuple[float, float] | None  # clip_grad_norm_'s max_norm and norm_type
    evaluate: bool  # a no-grad forward after each step
    meta_init: bool  # the wrapped side is built on the meta device and initialized by GTPWrap

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[PRECISIONS[self.precision][1]]

    def features(self) -> list[str]:
        """What this case exercises, for the summary's per-feature counts."""
        ops = {op.name for op in (*self.model.stem, *self.model.body)}
        out = [f"kind:{self.model.kind}", f"precision:{self.precision}", f"opt:{self.optimizer}"]
        out += [f"op:{name}" for name in sorted(ops)]
        out += [f"norm:{op.arg}" for op in self.model.body if op.name == "norm"]
        out += [f"conv_norm:{op.arg}" for op in self.model.stem if op.arg]
        if self.model.tie_head:
            out.append("tied_head")
        if self.model.frozen:
            out.append("frozen")
        if self.mesh is not None:
            out.append(f"mesh:{self.mesh[0]}x{self.mesh[1]}")
        if self.micro_batches > 1:
            out.append("no_sync")
        if self.clip is not None:
            out.append(f"clip:norm_type={self.clip[1]}")
        if self.evaluate:
            out.append("eval")
        if self.meta_init:
            out.append("meta_init")
        if self.model.checkpoint:
            out.append("checkpoint")
        if "gather_per_block" in self.policy:
            out.append("gather_per_block")
        if "rules" not in self.policy:
            out.append("default_rules")
        for key in ("prefetch_depth", "group_numel", "min_shard_numel", "loss_reduction"):
            if key in self.policy:
                out.append(f"{key}:{self.policy[key]}")
        return sorted(set(out))


class FuzzNet(nn.Module):
    """The model a ModelSpec describes (see ModelSpec and Op)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.stem = nn.ModuleList()
        self.body = nn.ModuleList()
        width = spec.in_width
        if spec.kind == "tokens":
            emb = spec.stem[0]
            padding = None if emb.ref < 0 else emb.ref
            self.stem.append(nn.Embedding(spec.in_width, emb.width, padding_idx=padding))
            if len(spec.stem) > 1:
                self.stem.append(nn.Embedding(16, emb.width))  # positions
            width = emb.width
        else:
            for op in spec.stem:
                self.stem.append(self._conv_op(op, width))
                width = op.width if op.name == "conv" else width
        for op in spec.body:
            self.body.append(self._body_op(op, width))
            width = op.width if op.name == "linear" else width
        self.head = nn.Linear(width, spec.out_width, bias=spec.head_bias)
        if spec.tie_head:
            self.head.weight = self.stem[0].weight
        # Never the last parameter: a model with nothing to train cannot run backward.
        may_freeze = list(self.parameters())[:-1]
        for i in spec.frozen if may_freeze else ():
            may_freeze[i % len(may_freeze)].requires_grad_(False)

    def _conv_op(self, op: Op, channels: int) -> nn.Module:
        if op.name == "again":
            return nn.Identity()  # the forward calls stem[op.ref]
        conv = nn.Conv2d if self.spec.kind == "images" else nn.Conv1d
        layers = [conv(channels, op.width, op.ref, padding=op.ref // 2, bias=op.bias)]
        if op.arg:
            layers.append(_norm(op.arg, op.width, spatial=2 if self.spec.kind == "images" else 1))
        return nn.Sequential(*layers)

    def _body_op(self, op: Op, width: int) -> nn.Module:
        if op.name == "linear":
            return nn.Linear(width, op.width, bias=op.bias)
        if op.name == "shared":
            return self.body[op.ref]  # the same module registered a second time
        if op.name in ("residual", "tied"):
            layer = nn.Linear(width, width, bias=op.bias)
            if op.name == "tied":
                layer.weight = self.body[op.ref].weight
            return layer
        if op.name == "norm":
            return _norm(op.arg, width, spatial=0, affine=op.bias)
        if op.name == "attn":
            return nn.MultiheadAttention(width, op.width, bias=op.bias, batch_first=True)
        return nn.Identity()  # "again" and "outside" use an earlier layer's module or weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.kind == "tokens":
            h = self.stem[0](x)
            if len(self.stem) > 1:
                h = h + self.stem[1](torch.arange(x.shape[1], device=x.device))
        elif spec.kind == "vectors":
            h = x
        else:
            h = x
            for op, module in zip(spec.stem, self.stem):
                conv = self.stem[op.ref] if op.name == "again" else module
                h = torch.tanh(conv(h))
            h = h.flatten(2).mean(-1)  # pool: (N, C)
        for i in range(len(spec.body)):
            if spec.checkpoint:
                h = checkpoint(self._body_op_call, i, h, use_reentrant=False)
            else:
                h = self._body_op_call(i, h)
        return self.head(h)

    def _body_op_call(self, i: int, h: torch.Tensor) -> torch.Tensor:
        op, module = self.spec.body[i], self.body[i]
        act = ACTIVATIONS.get(op.arg, ACTIVATIONS["none"])
        if op.name == "linear":
            return act(module(h))
        if op.name in ("residual", "tied", "shared"):
            return h + act(module(h))
        if op.name == "again":
            return h + act(self.body[op.ref](h))
        if op.name == "outside":  # the weight read by the parent, not by its module
            return h + torch.tanh(F.linear(h, self.body[op.ref].weight))
        if op.name == "attn":
            return h + module(h, h, h, need_weights=False)[0]
        return module(h)


class _RandomStats:
    """A batch norm in eval mode whose running statistics start random, drawn in its reset (as
    torch's layers draw their weights), so that a meta-device build replays them. Eval mode:
    in training mode a batch norm normalizes each rank's batch alone, which no data-parallel
    run matches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train(False)

    def reset_running_stats(self) -> None:
        super().reset_running_stats()  # type: ignore[misc]
        with torch.no_grad():
            self.running_mean.uniform_(-0.5, 0.5)  # type: ignore[attr-defined]
            self.running_var.uniform_(0.5, 2.0)  # type: ignore[attr-defined]

    def train(self, mode: bool = True) -> nn.Module:
        return super().train(False)  # type: ignore[misc]


class EvalBatchNorm1d(_RandomStats, nn.BatchNorm1d):
    """See _RandomStats."""


class EvalBatchNorm2d(_RandomStats, nn.BatchNorm2d):
    """See _RandomStats."""


def _norm(name: str, width: int, spatial: int, affine: bool = True) -> nn.Module:
    """A norm over `width` features or channels, of inputs with `spatial` dims after them."""
    if name == "layer":
        return nn.LayerNorm(width, elementwise_affine=affine, bias=affine)
    if name == "rms":
        return nn.RMSNorm(width, elementwise_affine=affine)
    if name == "group":
        return nn.GroupNorm(1, width, affine=affine)  # smaller groups: see _draw_model
    if name == "instance":
        return nn.InstanceNorm2d(width, affine=True)
    return (EvalBatchNorm2d if spatial == 2 else EvalBatchNorm1d)(width, affine=affine)


def _draw_model(rng: random.Random, adam: bool, fp16: bool) -> ModelSpec:
    """A random small model: sizes of a few to a few hundred elements per weight, odd row
    counts included, so that shards are uneven or empty on some ranks. Norms see 3 features or
    more (over 1 or 2 they pass no gradient back). For Adam, no parameter whose gradient is
    zero but for rounding (a convolution before an instance norm, which undoes each channel's
    shift and scale; attention's key bias): Adam would turn that rounding into full-size steps,
    different in every summation order. In fp16, no embedding padding row: its zero rows make
    stacked RMS norms overflow fp16 in backward, unwrapped too."""
    kind = rng.choice(["tokens", "tokens", "vectors", "vectors", "images", "signals"])
    stem: list[Op] = []
    if kind == "tokens":
        in_width, width = rng.randint(8, 40), rng.choice([4, 6, 8, 12, 16, 24])
        padding = rng.choice([-1, -1, 0, 3])
        stem.append(Op("embed", width=width, ref=-1 if fp16 else padding))  # padding_idx
        if rng.random() < 0.5:
            stem.append(Op("positions"))
        out_width = in_width
    elif kind == "vectors":
        in_width = width = rng.choice([3, 5, 8, 12, 16])
        out_width = rng.choice([1, 2, 4, 7])
    else:
        in_width = width = rng.choice([1, 2, 3])
        norms = ["", "", "batch", "group"] + (["instance"] if kind == "images" and not adam else [])
        square: list[int] = []  # stem ops whose convolution maps `width` channels to as many
        for _ in range(rng.randint(1, 3)):
            square = [i for i in square if stem[i].width == width]
            if square and rng.random() < 0.3:
                stem.append(Op("again", ref=rng.choice(square)))
                continue
            out = width if width >= 3 and rng.random() < 0.3 else rng.choice([3, 4, 6, 8])
            if out == width:
                square.append(len(stem))
            bias = rng.random() < 0.7
            stem.append(
                Op("conv", width=out, bias=bias, ref=rng.choice([1, 3]), arg=rng.choice(norms))
            )
            width = out
        out_width = rng.choice([2, 5])
    body: list[Op] = []
    body_norms = ["layer", "rms"] + (["group", "batch"] if kind != "tokens" else [])
    owners: list[int] = []  # body ops owning a square Linear (of their width), to reuse
    for _ in range(rng.randint(1, 5)):
        square = [i for i in owners if body[i].width == width]
        choices = ["linear", "linear", "residual", "norm"]
        if square:
            choices += ["again", "tied", "outside", "shared"]
        if kind == "tokens":
            choices.append("attn")
        name = rng.choice(choices)
        act = rng.choice(list(ACTIVATIONS))
        bias = rng.random() < 0.7
        if name == "linear":
            out = width if rng.random() < 0.3 else rng.choice([3, 5, 8, 16, 33])
            if out == width:
                owners.append(len(body))
            body.append(Op("linear", width=out, bias=bias, arg=act))
            width = out
        elif name == "residual":
            owners.append(len(body))
            body.append(Op("residual", width=width, bias=bias, arg=act))
        elif name == "norm":
            body.append(Op("norm", bias=rng.random() < 0.8, arg=rng.choice(body_norms)))
        elif name == "attn":
            heads = rng.choice([h for h in (1, 2, 4) if width % h == 0])
            body.append(Op("attn", width=heads, bias=rng.random() < 0.5 and not adam))
        else:  # again, tied, outside, shared: through an earlier square Linear
            if name == "tied":
                owners.append(len(body))
            body.append(Op(name, width=width, bias=bias, ref=rng.choice(square), arg=act))
    tie_head = kind == "tokens" and width == stem[0].width and rng.random() < 0.6
    frozen = tuple(rng.randrange(64) for _ in range(rng.choice([0, 0, 0, 1, 2])))
    checkpointed = rng.random() < 0.15
    return ModelSpec(
        kind=kind,
        in_width=in_width,
        stem=tuple(stem),
        body=tuple(body),
        out_width=out_width,
        head_bias=rng.random() < 0.5,
        tie_head=tie_head,
        frozen=frozen,
        checkpoint=checkpointed,
    )


def _draw_rule(rng: random.Random, model: nn.Module) -> dict[str, Any]:
    """A random rule over this model's class names, dotted class paths and parameter FQNs (exact
    or globs), or a name that matches nothing."""
    classes = sorted(
        {type(m).__name__ for m in model.modules()} - {"FuzzNet", "ModuleList", "Sequential"}
    )
    fqns = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    kind = rng.random()
    if kind < 0.45:
        match = rng.choice(classes)
    elif kind < 0.55:
        match = rng.choice(
            ["torch.nn.Linear", "torch.nn.Embedding", "torch.nn.modules.conv.Conv2d"]
        )
    elif kind < 0.7:
        match = rng.choice(fqns)
    elif kind < 0.92:
        match = rng.choice(["body.*.weight", "*.bias", "stem.*", "head.*", "*weight", "body.?.*"])
    else:
        match = rng.choice(["Linaer", "body.99.weight", "Conv3d"])
    rule: dict[str, Any] = {"match": match}
    if rng.random() < 0.2:
        rule["action"] = "replicate"
    if rng.random() < 0.2:
        rule["dim"] = rng.choice([1, 1, 1, 2, 3])
    if rng.random() < 0.05:
        rule["strict"] = True
    return rule


def _draw_policy(rng: random.Random, spec: ModelSpec, precision: str) -> dict[str, Any]:
    """A random policy in the precision of this name, as a mapping (so that GTPWrap validates
    it)."""
    with torch.device("meta"):
        model = FuzzNet(spec)
    policy: dict[str, Any] = {"collective_timeout_s": 15.0}  # a hang ends in an error, soon
    roll = rng.random()
    if roll < 0.05:
        policy["rules"] = []  # GTP off: everything replicated
    elif roll < 0.85:
        policy["rules"] = [_draw_rule(rng, model) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:  # a rule for the rest, as a real policy ends
            policy["rules"].append({"match": rng.choice(["Linear", "*weight", "Embedding"])})
    policy["min_shard_numel"] = rng.choice([0, 0, 0, 0, 0, 0, 16, 64, 256, 1 << 14])
    policy["group_numel"] = rng.choice([0, 0, 1, 64, 500, 4096, 1 << 24])
    policy["prefetch_depth"] = rng.choice([0, 1, 1, 2, 3])
    policy["pad_for_alignment"] = rng.random() < 0.7
    if rng.random() < 0.15:
        policy["loss_reduction"] = "sum"
    if rng.random() < 0.05:
        policy["strict"] = True
    if rng.random() < 0.2:
        policy["check_finite"] = True
    if rng.random() < 0.1:
        blocks = ["body.*", "Linear", "Sequential", "MultiheadAttention", "body.1", "stem.0"]
        policy["gather_per_block"] = [rng.choice(blocks)]
    if rng.random() < 0.04 and "rules" in policy:  # what a model without a tp dim or experts lacks
        policy["rules"].insert(0, rng.choice(UNSUPPORTED_RULES))
    policy.update(PRECISIONS[precision][0])
    if "param_dtype" in policy:
        policy["compute_copy"] = rng.random() < 0.3
        policy["norm_in_fp32"] = rng.random() < 0.7
    if rng.random() < 0.06:
        policy.update(rng.choice(INVALID_FIELDS))
    return policy


def make_case(seed: int) -> Case:
    """The case of `seed`: the same on every rank and in every process."""
    rng = random.Random(seed)
    world = rng.choice(WORLDS)
    # The default 1-D mesh, or dp x gtp; a gtp group of one (pure data parallelism) is rarer.
    shapes = [(world // g, g) for g in range(2, world + 1) if world % g == 0]
    roll = rng.random()
    mesh = None if roll < 0.5 or world == 1 else (world, 1) if roll < 0.6 else rng.choice(shapes)
    precision = rng.choice(list(PRECISIONS)) if rng.random() < 0.5 else "fp32"
    level = PRECISIONS[precision][1]
    # Adam scales each gradient by its own size, so rounding in a small one becomes a full-size
    # step: low precision is compared under SGD, whose steps keep it small.
    optimizer = rng.choice(["sgd", "adamw"]) if level == "fp32" else "sgd"
    model = _draw_model(rng, adam=optimizer == "adamw", fp16=level == "fp16")
    policy = _draw_policy(rng, model, precision)
    return Case(
        seed=seed,
        world=world,
        mesh=mesh,
        model=model,
        policy=policy,
        precision=precision,
        optimizer=optimizer,
        steps=rng.choice([2, 3]),
        micro_batches=rng.choice([1, 1, 1, 2]),
        batch=rng.choice([1, 2, 3]),
        seq_lens=tuple(rng.randint(2, 8) for _ in range(3)),
        clip=rng.choice([None, None, None, (0.5, 2.0), (5.0, 2.0), (0.5, math.inf), (1.0, 1.0)]),
        evaluate=rng.random() < 0.4,
        meta_init=rng.random() < 0.2,
    )


def world_of(seed: int) -> int:
    """The world size a case is drawn with (its first draw), without drawing the rest."""
    return random.Random(seed).choice(WORLDS)


def build_model(case: Case, meta: bool = False) -> FuzzNet:
    """The case's model with its initial weights, the same on every rank; with `meta`, built on
    the meta device, its generator seeded for GTPWrap to replay the inits from."""
    torch.manual_seed(case.seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return FuzzNet(case.model)


def global_batch(
    case: Case, step: int, micro: int, ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of every rank (`ranks` x batch samples, rank-major)."""
    g = torch.Generator().manual_seed(case.seed * 7919 + 100 * step + micro)
    n, spec = ranks * case.batch, case.model
    if spec.kind == "tokens":
        t = case.seq_lens[step % len(case.seq_lens)]
        return (
            torch.randint(0, spec.in_width, (n, t), generator=g),
            torch.randint(0, spec.out_width, (n, t), generator=g),
        )
    if spec.kind == "vectors":
        x = torch.randn(n, spec.in_width, generator=g)
        return x, torch.randn(n, spec.out_width, generator=g)
    shape = (n, spec.in_width, 5, 4) if spec.kind == "images" else (n, spec.in_width, 7)
    return torch.randn(*shape, generator=g), torch.randint(0, spec.out_width, (n,), generator=g)


def loss_of(case: Case, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss of a batch: squared error for vectors, cross-entropy for classes."""
    out = out.float()
    if case.model.kind == "vectors":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def train(case: Case, model: nn.Module, rank: int | None, chunks: int = 1) -> dict[str, Any]:
    """The training loop both sides run. The wrapped side (`rank` given) sees this rank's rows of
    every global batch; the reference (`rank` None) all of them, in `chunks` equal parts whose
    gradients it accumulates, as data ranks sum theirs."""
    # Summing the ranks' mean-loss gradients is the global mean-loss gradient times the number
    # of data ranks (every GTP rank is one); the learning rate takes that back, as a user
    # would, so that SGD does not diverge (where rounding differences grow without bound).
    summed = case.policy.get("loss_reduction") == "sum"
    lr = {k: v / (case.world if summed else 1) for k, v in OPTIMIZER_LR.items()}
    if case.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=lr["sgd"], momentum=0.9, weight_decay=0.01
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr["adamw"], eps=1e-4)
    wrapped = rank is not None
    loss_scale = case.world if summed and not wrapped else 1.0
    out: dict[str, Any] = {"losses": [], "norms": [], "grads": [], "evals": []}
    for step in range(case.steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(case.micro_batches):
            x, y = global_batch(case, step, micro, case.world)
            if wrapped:
                rows = slice(rank * case.batch, (rank + 1) * case.batch)
                parts = [(x[rows], y[rows])]
            else:
                parts = list(zip(x.chunk(chunks), y.chunk(chunks)))
            last = micro == case.micro_batches - 1
            sync = gtp_wrap.no_sync(model) if wrapped and not last else contextlib.nullcontext()
            with sync:
                for xs, ys in parts:
                    loss = loss_of(case, model(xs), ys) / (case.micro_batches * len(parts))
                    (loss * loss_scale).backward()
                    total += loss.item()
        out["losses"].append(total)
        if not wrapped:  # for the noise of the clipped norms (see compare)
            grads = [
                p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
            ]
            out["grads"].append(torch.cat([g.flatten() for g in grads]))
        if case.clip is not None:
            clip = gtp_wrap.clip_grad_norm_ if wrapped else nn.utils.clip_grad_norm_
            max_norm, norm_type = case.clip
            params = model if wrapped else model.parameters()
            norm = clip(params, max_norm, norm_type)  # type: ignore[operator]
            out["norms"].append(float(norm))
        opt.step()
        if case.evaluate:
            with torch.no_grad():
                x = global_batch(case, 99, 0, EVAL_RANKS)[0]
                out["evals"].append(model(x).float())
    out["eval"] = torch.stack(out.pop("evals")) if case.evaluate else None
    return out


def compare(case: Case, got: dict[str, Any], ref: Reference) -> tuple[list[str], float]:
    """What differs between a wrapped run (losses averaged over ranks) and the reference, as
    readable lines (none when within the case's tolerance, see Tolerance), and the largest
    share of its bound that a difference took."""
    tol, exact, noisy = case.tolerance, ref.exact, ref.noisy
    problems: list[str] = []
    shares = [0.0]

    def check(what: str, a: Any, b: Any, noise: float, allowed: float) -> None:
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        if a.shape != b.shape:
            problems.append(f"{what}: shape {tuple(a.shape)}, reference {tuple(b.shape)}")
            return
        err, bound = (a - b).norm().item(), tol.noise * noise + allowed + 1e-7
        shares.append(err / bound)
        if not err <= bound:  # NaN fails too
            problems.append(f"{what}: |got - ref| = {err:.3g} > {bound:.3g} (noise: {noise:.3g})")

    b = torch.tensor(exact["losses"], dtype=torch.float64)
    check("losses", got["losses"], b, _dist(noisy["losses"], b), tol.output * b.norm().item())
    # A norm's noise is bounded by its gradients' (triangle inequality); one noisy sample of
    # the norm itself can land near the exact one by chance.
    norm_type = case.clip[1] if case.clip else 2.0
    steps = [
        torch.linalg.vector_norm((n - e).double(), norm_type).item()
        for n, e in zip(noisy["grads"], exact["grads"])
    ]
    b = torch.tensor(exact["norms"], dtype=torch.float64)
    noise = torch.tensor(steps).norm().item() if exact["norms"] else 0.0
    check("clipped gradient norms", got["norms"], b, noise, tol.output * b.norm().item())
    if (got["eval"] is None) != (exact["eval"] is None):
        problems.append("evaluation output: only one side has it")
    elif exact["eval"] is not None:
        b = exact["eval"]
        noise = _dist(noisy["eval"], b)
        check("evaluation output", got["eval"], b, noise, tol.output * b.norm().item())
    state = got["state"]
    if state.keys() != exact["state"].keys():
        problems.append(f"state dict keys: got {sorted(state)}, reference {sorted(exact['state'])}")
        return problems, math.inf
    moved = {k: _dist(b, ref.init[k]) for k, b in exact["state"].items()}
    noise_of = {k: _dist(noisy["state"][k], b) for k, b in exact["state"].items()}
    # The run's noise relative to its updates, for tensors too small for their own sample of
    # the noise to tell its size.
    relative = math.hypot(*noise_of.values()) / max(math.hypot(*moved.values()), 1e-12)
    for key, b in exact["state"].items():
        noise = max(noise_of[key], relative * moved[key])
        allowed = tol.update * moved[key] + tol.value * b.double().norm().item()
        check(key, state[key], b, noise, allowed)
    return problems, max(shares)


def _dist(a: Any, b: Any) -> float:
    """||a - b|| in float64, of tensors or lists of numbers."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).norm().item()


@dataclasses.dataclass(frozen=True)
class Reference:
    """The unwrapped model trained on the whole global batch: `exact` in fp32 on the batch at
    once; `noisy` in the policy's compute and reduction dtypes on the ranks' parts of it,
    accumulated (the same math rounded as a data-parallel run rounds it); its initial state."""

    exact: dict[str, Any]
    noisy: dict[str, Any]
    init: dict[str, torch.Tensor]


class CastForward(nn.Module):
    """`model` trained in a policy's dtypes without GTP: each call casts the parameters and
    floating inputs to `dtype` (running-statistics norms keep fp32 parameters and statistics
    under norm_in_fp32, else their statistics are cast too), first rounding weights to FP8 as
    FP8 gathers do with `fp8` (and each Linear's input, row by row, as FP8 GEMMs do with
    `fp8_inputs`), and each gradient is rounded to `grad_dtype` as a reduction in it rounds.
    How far rounding alone moves a run."""

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | None,
        fp8: bool,
        fp8_inputs: bool,
        norm_in_fp32: bool,
        grad_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.model, self.dtype, self.fp8 = model, dtype, fp8
        self.keep = set()
        if norm_in_fp32:
            norms = [m for m in model.modules() if isinstance(m, _NormBase)]
            self.keep = {id(t) for m in norms for t in (*m.parameters(), *m.buffers())}
        if fp8_inputs:
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.register_forward_pre_hook(lambda m, args: (_round_fp8(args[0], -1),))
        if grad_dtype is not None:

            def round_grad(p: torch.Tensor) -> None:
                p.grad.copy_(p.grad.to(grad_dtype))

            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(round_grad)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.keep or not t.is_floating_point():
            return t
        if self.fp8 and t.dim() >= 2:
            t = _round_fp8(t, None)  # one scale for the weight: a gather's blocks hold 128
        return t if self.dtype is None else t.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The casts swapped into each module's own slots for the call (torch.func's
        # functional_call swaps by name, which a module registered under two names defeats);
        # every slot of a tensor (tied weights) gets its one cast.
        slots = [
            (slot, name, t)
            for module in self.model.modules()
            for slot in (module._parameters, module._buffers)
            for name, t in slot.items()
            if t is not None
        ]
        cast = {id(t): self._cast(t) for _, _, t in slots}
        if self.dtype is not None and x.is_floating_point():
            x = x.to(self.dtype)
        try:
            for slot, name, t in slots:
                slot[name] = cast[id(t)]
            return self.model(x)
        finally:
            for slot, name, t in slots:
                slot[name] = t


def _round_fp8(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """`t` rounded to float8_e4m3fn with one scale per slice along `dim` (None: one for all),
    the gradient passing straight through, as to the tensor it was quantized from."""
    amax = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim, keepdim=True)
    scale = amax.clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    rounded = (t.detach() / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale
    return t + (rounded - t.detach())


def reference(case: Case) -> Reference:
    """The case's reference runs (see Reference)."""
    model = build_model(case)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    exact = train(case, model, None)
    exact["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Checkpointing changes no value, and its recomputation in backward would run outside
    # the call that casts the parameters.
    plain = dataclasses.replace(case, model=dataclasses.replace(case.model, checkpoint=False))
    model = build_model(plain)
    reduce_dtype = policy_dtype(case.policy.get("reduce_dtype"))
    cast = CastForward(
        model,
        policy_dtype(case.policy.get("param_dtype")),
        fp8=case.policy.get("gather_dtype") is not None,
        fp8_inputs=bool(case.policy.get("fp8_matmul")),
        norm_in_fp32=case.policy.get("norm_in_fp32", True),
        grad_dtype=reduce_dtype if reduce_dtype in (torch.bfloat16, torch.float16) else None,
    )
    noisy = train(plain, cast, None, chunks=case.world)
    noisy["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(exact=exact, noisy=noisy, init=init)


def refusal_reason(error: BaseException) -> str:
    """A refusal's class and the head of its message, with names and numbers blanked, so that
    refusals for one reason group together."""
    text = str(error).split("\n")[0]
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\([^()]*\)", "(…)", text)
    text = re.sub(r"\d+", "N", text)
    return f"{type(error).__name__}: {re.split(r'[;:]', text)[0][:90].strip()}"


def _run_wrapped(case: Case, rank: int, mesh: DeviceMesh | None) -> dict[str, Any]:
    """This rank's side of a case: wrap (a GTPError there is a refusal), train, then the full
    weights. Never raises: the outcome carries the error."""
    model = build_model(case, meta=case.meta_init)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PolicyWarnings: a random policy misses often
            device = "cpu" if case.meta_init else None
            GTPWrap(model, case.policy, mesh=mesh, device=device)
    except GTPError as e:
        return {"status": "refused", "reason": refusal_reason(e), "error": f"{e}"}
    except Exception:  # noqa: BLE001 - any other error at wrap is a failure to report
        return {"status": "failed", "stage": "wrap", "error": traceback.format_exc()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = train(case, model, rank)
            rows = gtp_wrap.describe(model).rows
            out["state"] = gtp_wrap.full_state_dict(model)
    except Exception:  # noqa: BLE001 - an error in training is a failure, GTPError or not
        return {"status": "failed", "stage": "train", "error": traceback.format_exc()}
    out["status"] = "trained"
    out["sharded"] = sum(row.sharded and row.group_size > 1 for row in rows)
    return out


def _mesh(shape: tuple[int, int] | None, meshes: dict) -> DeviceMesh | None:
    """The (dp, gtp) mesh of this shape, made once per spawn (every rank makes it at the same
    case, since all draw the same cases)."""
    if shape is None:
        return None
    if shape not in meshes:
        meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "gtp"))
    return meshes[shape]


def run_cases(
    rank: int, world: int, seeds: list[int], log_dir: str, deadline: float = math.inf
) -> list[dict[str, Any]]:
    """Every case of `seeds` (all drawn with this world size) on this rank, in order, until one
    fails with an exception or the wall clock passes `deadline`; rank 0 also compares with the
    reference. Returns one record per case run (the same on every rank) and rank 0 appends each
    to `log_dir`/records.jsonl as it ends (`current` names the case running), so a driver that
    has to kill a hung spawn knows what ran."""
    # Outcomes travel over a group of their own: a failed case may leave the library's
    # collectives unpaired, and this group must still pair.
    sync = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
    meshes: dict = {}
    records = []
    for seed in seeds:
        go = [False] * world
        dist.all_gather_object(go, time.time() < deadline, group=sync)
        if not all(go):
            break
        case = make_case(seed)
        assert case.world == world, (seed, case.world, world)
        if rank == 0:
            with open(os.path.join(log_dir, "current"), "w") as f:
                f.write(str(seed))
        start = time.perf_counter()
        mine = _run_wrapped(case, rank, _mesh(case.mesh, meshes))
        shared = {k: mine.get(k) for k in ("status", "stage", "reason", "error", "losses")}
        outcomes: list[dict[str, Any]] = [{}] * world
        dist.all_gather_object(outcomes, shared, group=sync)
        record = _record(case, rank, mine, outcomes)
        record["seconds"] = round(time.perf_counter() - start, 3)
        verdict = [record]
        dist.broadcast_object_list(verdict, src=0, group=sync)
        record = verdict[0]
        records.append(record)
        if rank == 0:
            with open(os.path.join(log_dir, "records.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        if record["status"] == "failed" and record["stage"] in ("wrap", "train", "agreement"):
            break  # its collectives may be half done: the next case gets a fresh spawn
    dist.destroy_process_group(sync)
    return records


# A case that failed may leave a gloo group mid-collective, which can abort in teardown
# (tests/harness.py): its ranks leave once their results are saved.
run_cases.leaves_group_broken = True  # type: ignore[attr-defined]


def _base_record(case: Case) -> dict[str, Any]:
    """What every record of a case holds, whatever its outcome."""
    return {
        "seed": case.seed,
        "world": case.world,
        "level": PRECISIONS[case.precision][1],
        "features": case.features(),
    }


def _record(
    case: Case, rank: int, mine: dict[str, Any], outcomes: list[dict[str, Any]]
) -> dict[str, Any]:
    """The case's verdict from every rank's outcome (rank 0 compares with the reference)."""
    record = _base_record(case)
    statuses = {o["status"] for o in outcomes}
    failed = [(r, o) for r, o in enumerate(outcomes) if o["status"] == "failed"]
    if failed:
        # Each failed rank's error, then the whole traceback of the first whose error is not
        # a wait for its peers (the cause, where a rank raised and the others waited).
        last = {r: o["error"].strip().splitlines()[-1] for r, o in failed}
        waits = ("CollectiveTimeoutError", "PeerFailedError", "CollectiveError")
        causes = [o for r, o in failed if last[r].split(":")[0].rpartition(".")[2] not in waits]
        lines = [f"rank {r}: {line}" for r, line in last.items()]
        detail = "\n".join([*lines, (causes or [failed[0][1]])[0]["error"]])
        return record | {"status": "failed", "stage": failed[0][1]["stage"], "detail": detail}
    reasons = {o.get("reason") for o in outcomes}
    if statuses == {"refused"} and len(reasons) == 1:
        return record | {"status": "refused", "reason": reasons.pop(), "detail": mine["error"]}
    if statuses != {"trained"}:
        detail = "; ".join(
            f"rank {r}: {o['status']} {o.get('reason') or ''}" for r, o in enumerate(outcomes)
        )
        return record | {"status": "failed", "stage": "agreement", "detail": detail}
    record["sharded"] = mine["sharded"]
    if rank != 0:
        return record | {"status": "pending"}  # rank 0 broadcasts the verdict
    got = dict(mine)
    steps = torch.tensor([o["losses"] for o in outcomes], dtype=torch.float64)
    got["losses"] = steps.mean(0).tolist()
    try:
        problems, share = compare(case, got, reference(case))
    except Exception:  # noqa: BLE001 - the reference failing is a fuzzer bug, reported as such
        return record | {"status": "failed", "stage": "reference", "detail": traceback.format_exc()}
    record["share_of_bound"] = round(share, 4)
    if problems:
        return record | {"status": "failed", "stage": "values", "detail": "\n".join(problems)}
    return record | {"status": "parity"}


def describe_case(case: Case) -> str:
    """The case in a few readable lines, for failure reports."""
    lines = [f"seed {case.seed}: world {case.world}, mesh {case.mesh or '1-D'}"]
    lines.append(f"model: {case.model}")
    lines.append(f"policy: {case.policy}")
    lines.append(
        f"precision {case.precision}, {case.optimizer}, {case.steps} steps x "
        f"{case.micro_batches} micro-batches of {case.batch} per rank, clip {case.clip}, "
        f"eval {case.evaluate}, meta init {case.meta_init}"
    )
    return "\n".join(lines)


def case_seeds(seed: int, cases: int) -> list[int]:
    """The seeds of a run's cases: distinct runs (seeds) draw disjoint cases."""
    return [seed * 1_000_003 + i for i in range(cases)]


def _spawn_entry(rank: int, world: int, seeds: list[int], log_dir: str, deadline: float) -> None:
    """A spawned rank of the driver, started as tests/harness.py starts its ranks."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{log_dir}/store", rank=rank, world_size=world
    )
    run_cases(rank, world, seeds, log_dir, deadline)
    os._exit(0)  # see run_cases.leaves_group_broken


def spawn_world(world: int, seeds: list[int], deadline: float, grace: float) -> list[dict]:
    """Run `seeds` on `world` spawned ranks, one spawn after another until all ran or the
    deadline passed; a spawn whose rank died, or that made no progress for `grace` seconds (it
    is killed then), fails the case it was running. Returns every case's record."""
    records: list[dict] = []
    todo = list(seeds)
    while todo and time.time() < deadline:
        with tempfile.TemporaryDirectory() as log_dir:
            ctx = mp.start_processes(
                _spawn_entry,
                args=(world, todo, log_dir, deadline),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            ended, seen, last_progress = "", 0, time.time()
            while not ended:
                try:
                    if ctx.join(timeout=0.5):
                        break
                except ProcessException as e:  # a rank died or raised
                    ended = f"a rank ended abnormally: {e}"
                done = _read_records(log_dir)
                if len(done) != seen:
                    seen, last_progress = len(done), time.time()
                if time.time() > last_progress + grace:
                    ended = f"no result after {grace:.0f}s (a hang): the spawn was killed"
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            done = _read_records(log_dir)
            current = _read_current(log_dir)
        records += done
        ran = {r["seed"] for r in done}
        if ended and current is not None and current not in ran:
            hung = {"status": "failed", "stage": "spawn", "detail": ended}
            records.append(_base_record(make_case(current)) | hung)
            ran.add(current)
        if not ran:
            break  # the spawn ran nothing: its deadline passed while it started, or it died
        todo = [s for s in todo if s not in ran]
    return records


def _read_records(log_dir: str) -> list[dict]:
    path = os.path.join(log_dir, "records.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _read_current(log_dir: str) -> int | None:
    path = os.path.join(log_dir, "current")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    return int(text) if text else None


def summarize(records: list[dict], requested: int) -> dict[str, Any]:
    """The run's figures: cases run, refusals by reason, parity passes by precision and by
    feature, failures with their seeds."""
    by_status = collections.Counter(r["status"] for r in records)
    refusals = collections.Counter(r["reason"] for r in records if r["status"] == "refused")
    parity = [r for r in records if r["status"] == "parity"]
    features = collections.Counter(f for r in parity for f in r["features"])
    return {
        "requested": requested,
        "ran": len(records),
        "parity": by_status["parity"],
        "parity_split_over_ranks": sum(1 for r in parity if r["sharded"] > 0),
        "refused": by_status["refused"],
        "failed": by_status["failed"],
        "by_world": {
            str(w): dict(collections.Counter(r["status"] for r in records if r["world"] == w))
            for w in sorted({r["world"] for r in records})
        },
        "refusals_by_reason": dict(refusals.most_common()),
        "parity_by_feature": dict(sorted(features.items())),
        "largest_share_of_bound": {
            level: max((r["share_of_bound"] for r in parity if r["level"] == level), default=None)
            for level in TOLERANCES
        },
        "failures": [
            {k: r.get(k) for k in ("seed", "world", "stage", "detail")}
            for r in records
            if r["status"] == "failed"
        ],
    }


def _print_summary(summary: dict[str, Any], elapsed: float) -> None:
    print(
        f"{summary['ran']}/{summary['requested']} cases in {elapsed:.0f}s: "
        f"{summary['parity']} parity ({summary['parity_split_over_ranks']} with weights split "
        f"over ranks), {summary['refused']} refused, {summary['failed']} failed"
    )
    print(f"by world: {summary['by_world']}")
    print(f"largest share of the bound, by precision: {summary['largest_share_of_bound']}")
    print("refusals by reason:")
    for reason, n in summary["refusals_by_reason"].items():
        print(f"  {n:4d}  {reason}")
    for failure in summary["failures"]:
        print(f"FAILED seed {failure['seed']} (world {failure['world']}, {failure['stage']}):")
        print("  " + failure["detail"].strip().replace("\n", "\n  ")[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=100, help="how many cases to draw")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (its cases' seeds)")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds for all cases")
    parser.add_argument("--case", type=int, help="run only the case of this seed, and show it")
    parser.add_argument("--out", help="write the summary and every record as JSON here")
    args = parser.parse_args()
    start = time.time()
    seeds = [args.case] if args.case is not None else case_seeds(args.seed, args.cases)
    if args.case is not None:
        print(describe_case(make_case(args.case)))
    by_world: dict[int, list[int]] = collections.defaultdict(list)
    for s in seeds:
        by_world[world_of(s)].append(s)
    # Each world size gets a share of the time by its cases' ranks (a case's cost grows with
    # its world on a few cores), so that a slow world cannot starve the others.
    weight = {w: len(s) * w for w, s in by_world.items()}
    records: list[dict] = []
    for w in sorted(by_world):
        left = args.time_limit - (time.time() - start)
        share = left * weight[w] / sum(weight[v] for v in weight if v >= w)
        records += spawn_world(w, by_world[w], time.time() + share, grace=120.0)
    elapsed = time.time() - start
    summary = summarize(records, len(seeds))
    _print_summary(summary, elapsed)
    if args.out:
        command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
        data = {"command": command, "elapsed_s": round(elapsed, 1), "torch": torch.__version__}
        data |= summary | {"records": records}
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
