"""Overlap and memory counters: one blocking gather per pass direction after the first step,
and gathered memory bounded by the prefetch depth, not the model's depth."""

from __future__ import annotations

import pytest
import torch
from harness import cached_ranks, is_sharded, run_ranks, slot_bytes
from models import DeepMLP, TinyGPT
from torch import nn

import gtp_wrap
from gtp_wrap import GTPPolicy, GTPWrap

STEPS = 3  # counters are reset after the first step, so they cover STEPS - 1 steps


def _train_and_count(rank: int, world: int, model_name: str, layers: int, group_numel: int) -> dict:
    torch.manual_seed(0)
    if model_name == "mlp":
        model = DeepMLP(layers)
        data = lambda: torch.randn(4, 32)  # noqa: E731
    else:
        model = TinyGPT(layers=layers, ckpt=model_name == "gpt_ckpt")
        data = lambda: torch.randint(0, 48, (2, 8))  # noqa: E731
    GTPWrap(model, {"min_shard_numel": 0, "group_numel": group_numel})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        if step == 1:
            gtp_wrap.reset_stats(model)
        loss = model(data()).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return {**gtp_wrap.stats(model), "losses": losses, "params": params}


def _stats(model_name: str, layers: int, group_numel: int = GTPPolicy().group_numel) -> dict:
    return cached_ranks(_train_and_count, 2, model_name, layers, group_numel)[0]


def test_one_blocking_gather_per_pass_direction() -> None:
    s = _stats("mlp", 4)
    assert s["blocking_by_pass"] == {"forward": STEPS - 1, "backward": STEPS - 1}
    assert s["prefetched_gathers"] == s["gathers"] - s["blocking_gathers"]
    # 4 forward uses + 3 backward uses (the first layer's input needs no grad) per step.
    assert s["gathers"] == (4 + 3) * (STEPS - 1)


def test_gpt_with_tied_head_prefetches_everything_but_the_heads() -> None:
    s = _stats("gpt", 2)
    assert s["blocking_by_pass"] == {"forward": STEPS - 1, "backward": STEPS - 1}
    # Per step, forward: wte, wpe, 4 Linears per block, and wte again for the tied head (11);
    # backward re-gathers what an input gradient needs: the 8 Linears and the head's wte (9;
    # an embedding lookup's backward needs no weight). All but the two chain heads prefetched.
    assert s["gathers"] == (11 + 9) * (STEPS - 1)
    assert s["prefetched_gathers"] == (11 + 9 - 2) * (STEPS - 1)


def test_recompute_regions_follow_the_backward_chain() -> None:
    s = _stats("gpt_ckpt", 2)
    # The recomputes of both checkpointed blocks are gathered along the backward chain, so
    # backward has one blocking gather in all (the allowance is one more per region).
    assert s["blocking_by_pass"] == {"forward": STEPS - 1, "backward": STEPS - 1}


@pytest.mark.parametrize("per_group", [1, 2])
def test_peak_gathered_memory_does_not_grow_with_depth(per_group: int) -> None:
    group_numel = 0 if per_group == 1 else 2 * 32 * 32  # DeepMLP's weights are 32 x 32
    shallow, deep = _stats("mlp", 4, group_numel), _stats("mlp", 8, group_numel)
    assert deep["gathers"] > shallow["gathers"]
    assert deep["peak_gathered_bytes"] == shallow["peak_gathered_bytes"] > 0
    # The group in use plus the group prefetched, of 32 x 32 fp32 weights (4 KiB each).
    assert shallow["peak_gathered_bytes"] == 2 * per_group * 32 * 32 * 4
    assert shallow["blocking_by_pass"] == {"forward": STEPS - 1, "backward": STEPS - 1}


def test_grouped_collectives_train_like_one_per_weight() -> None:
    grouped, single = _stats("gpt", 2), _stats("gpt", 2, 0)
    assert grouped["gathers"] == single["gathers"]
    assert grouped["reduce_scatters"] == single["reduce_scatters"]
    assert grouped["bytes_gathered"] == single["bytes_gathered"]
    assert grouped["blocking_by_pass"] == single["blocking_by_pass"]
    assert grouped["losses"] == single["losses"]
    for a, b in zip(grouped["params"], single["params"], strict=True):
        assert torch.equal(a, b)


def _train_eval_train(rank: int, world: int, policy: dict, eval_mode: str) -> list[float]:
    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(), {"min_shard_numel": 0, **policy})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 48, (2, 8))
    evaluation = torch.inference_mode if eval_mode == "inference_mode" else torch.no_grad
    losses = []
    for step in range(3):
        if step != 1:  # an evaluation before the first training step and between two
            with evaluation():
                losses.append(model(idx).float().pow(2).mean().item())
        loss = model(idx).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_inference_mode_evaluation_between_training_steps() -> None:
    """Buffers made in an inference_mode forward are still writable by the training after it."""
    for policy in ({}, {"param_dtype": "bfloat16"}):
        inference = run_ranks(_train_eval_train, 2, policy, "inference_mode")
        assert inference == run_ranks(_train_eval_train, 2, policy, "no_grad")


def _grad_ownership(rank: int, world: int, policy: dict, keep_buffers: bool) -> dict:
    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(), {"min_shard_numel": 0, **policy})
    engine = gtp_wrap.api.engine_of(model)
    engine.keep_buffers = keep_buffers  # as graph_step sets it
    sharded = [p for p in model.parameters() if is_sharded(p)]
    model(torch.randint(0, 48, (2, 8))).float().pow(2).mean().backward()
    slots = [slot_bytes(p) for p in sharded]
    storages = [p.grad.untyped_storage() for p in sharded]
    for p in model.parameters():
        p.grad = None  # zero_grad(set_to_none=True)
    return {
        "gather_buffer_bytes": engine.gather_bytes(),
        "grad_bytes": [s.nbytes() for s in storages],
        "slot_bytes": slots,
        # References to each gradient's memory besides `storages` itself: none may be left.
        "held_elsewhere": [torch._C._storage_Use_Count(s._cdata) - 1 for s in storages],
    }


def test_no_gradient_or_gather_buffer_is_held_between_steps() -> None:
    """A weight's gradient is the slot its reduce-scatter wrote (or, reduced in another dtype,
    its own copy of the staging buffer), and nothing in the engine keeps it; gather buffers go
    back to the allocator after each backward. Between steps only the shards (and what the
    optimizer keeps) hold memory."""
    for policy in ({}, {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}):
        for r in run_ranks(_grad_ownership, 2, policy, False):
            assert r["gather_buffer_bytes"] == 0
            assert r["grad_bytes"] == r["slot_bytes"]  # TinyGPT's rows split evenly
            assert r["held_elsewhere"] == [0] * len(r["grad_bytes"])


def test_a_graphed_step_keeps_its_gather_buffers() -> None:
    kept = run_ranks(_grad_ownership, 2, {}, True)
    assert all(r["gather_buffer_bytes"] > 0 for r in kept)


class _Alternating(nn.Module):
    """Swaps the order of its middle layers every call: each pass leaves the recorded chain
    part-way, with a group of gathers already in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = self.layers
        self.calls += 1
        for layer in (a, b, c, d) if self.calls % 2 else (a, c, b, d):
            x = torch.tanh(layer(x))
        return x


def _diverging(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = _Alternating()
    torch.manual_seed(0)
    model = GTPWrap(_Alternating(), {"min_shard_numel": 0, "group_numel": 2 * 32 * 32})
    for net, rows in ((ref, slice(0, 8)), (model, slice(rank * 4, rank * 4 + 4))):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))[rows]
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    full = gtp_wrap.full_state_dict(model)
    error = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {**gtp_wrap.stats(model), "error": error}


def test_a_diverging_chain_stays_exact_and_counts_every_gather() -> None:
    for s in run_ranks(_diverging, 2):
        assert s["error"] < 1e-6
        assert s["prefetched_gathers"] + s["blocking_gathers"] == s["gathers"] > 0
        assert s["prefetched_gathers"] > 0
