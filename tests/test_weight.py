"""The per-weight lifecycle and the pure interception query, on one process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.core.weight import GradState, ShardedWeight
from gtp_wrap.geometry import lay_out


def _weight() -> ShardedWeight:
    engine = engine_of(GTPWrap(nn.Linear(8, 8), {"min_shard_numel": 0}))
    (weight,) = engine.weights
    return weight


def test_a_weight_used_twice_lands_once_its_last_gradient_landed() -> None:
    w = _weight()
    assert w.grad_state is GradState.NONE
    w.grad_collected()
    w.grad_collected()
    w.grad_landed()
    assert w.grad_state is GradState.PENDING  # one of its two gradients is still reducing
    w.grad_landed()
    assert w.grad_state is GradState.LANDED
    ShardedWeight.backward_ended([w])
    assert w.grad_state is GradState.NONE


def test_a_gradient_landed_at_once_waits_for_one_still_pending() -> None:
    w = _weight()
    w.grad_collected()  # one use's gradient in a reduce-scatter group
    w.grad_landed_at_once()  # another's landed with no collective (a block's, a group of one)
    assert w.grad_state is GradState.PENDING
    w.grad_landed()
    assert w.grad_state is GradState.LANDED
    w.grad_landed_at_once()
    assert w.grad_state is GradState.LANDED
    ShardedWeight.backward_ended([w])
    w.grad_landed_at_once()  # the first gradient of the next backward
    assert w.grad_state is GradState.LANDED


def test_transitions_out_of_order_raise() -> None:
    w = _weight()
    with pytest.raises(RuntimeError, match="never collected"):
        w.grad_landed()
    w.grad_collected()
    with pytest.raises(RuntimeError, match="still pending"):
        ShardedWeight.backward_ended([w])
    with pytest.raises(RuntimeError, match="still pending"):
        w.region_grad_landed()
    w.abandon_grads()
    assert w.grad_state is GradState.NONE and w.pending_grads == 0


def test_every_weight_is_back_to_none_after_a_backward() -> None:
    torch.manual_seed(0)
    model = GTPWrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {"min_shard_numel": 0})
    x = torch.randn(2, 8)
    model(model[0](x)).sum().backward()  # the first Linear is used twice
    engine = engine_of(model)
    assert [w.grad_state for w in engine.weights] == [GradState.NONE] * 2
    assert all(w.param.grad is not None for w in engine.weights)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def test_a_hook_runs_once_when_a_weight_lands_twice_in_one_backward() -> None:
    """With one weight per reduce group, the second use's gradient arrives after the first one
    landed (LANDED -> PENDING -> LANDED): the hook still runs once, with the sum in `.grad`."""
    torch.manual_seed(0)
    ref = Twice()
    torch.manual_seed(0)
    model = GTPWrap(Twice(), {"min_shard_numel": 0, "group_numel": 0})
    seen: list[torch.Tensor] = []
    model.lin.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(2, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], ref.lin.weight.grad)


def test_intercepting_never_changes_state() -> None:
    """Asked on every torch function, the query must not close an abandoned backward: that
    happens where the next pass starts."""
    torch.manual_seed(0)
    model = GTPWrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {"min_shard_numel": 0})
    engine = engine_of(model)

    def boom(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))

    hook = model[0].register_forward_hook(boom)  # raises after the second Linear's backward
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(2, 8)).sum().backward()
    hook.remove()
    assert len(engine.passes.stack) == 1  # the abandoned backward
    assert not engine.intercepting()
    assert len(engine.passes.stack) == 1
    model(torch.randn(2, 8)).sum().backward()  # the next forward closes it
    assert engine.passes.stack == []


class GradInsideForward(nn.Module):
    """Its forward runs a backward of its own that raises after the engine joined it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        with contextlib.suppress(RuntimeError):  # e.g. a probe that may fail
            torch.autograd.grad(self.b(h).sum(), x)
        # Reads outside their modules: no module hook runs before these uses.
        h = torch.tanh(F.linear(x, self.a.weight, self.a.bias))
        return F.linear(h, self.b.weight, self.b.bias)


def test_a_backward_that_raised_inside_a_forward_leaves_that_forward_intact() -> None:
    torch.manual_seed(0)
    ref = GradInsideForward()
    torch.manual_seed(0)
    # bf16 over fp32: the engine's own linear joins the probe's backward (its input gradient).
    bf16 = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    model = GTPWrap(GradInsideForward(), bf16)
    x = torch.randn(2, 8, requires_grad=True)
    out = model(x)
    assert engine_of(model).passes.stack == []  # the forward closed, not the stale backward
    out.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(out.float(), ref(x), atol=0.02, rtol=0.02)
    torch.testing.assert_close(model.b.weight.grad, ref.b.weight.grad, atol=0.05, rtol=0.05)


def test_lay_out_puts_groups_of_one_last_and_returns_the_specs_order() -> None:
    """Gathered weights first in each flat tensor and weights of groups of one after them, so
    that a compute copy of the latter, and the FP8 quantization of the former, each cover one
    span (core/storage.py); the geometries come back in the order they were asked for."""
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [
        (torch.Size([8, 4]), 0, f32, 0, 1),  # a group of one
        (torch.Size([8, 4]), 0, f32, 1, 2),
        (torch.Size([6, 4]), 0, bf16, 0, 1),
        (torch.Size([4, 4]), 1, f32, 0, 2),
    ]
    geometries, sizes = lay_out(specs, align=False, block=128)
    assert [(g.shape, g.dtype, g.world) for g in geometries] == [
        (shape, dtype, world) for shape, _, dtype, _, world in specs
    ]
    gathered, local = geometries[1], geometries[0]
    assert (gathered.offset, geometries[3].offset, local.offset) == (0, 128, 256)
    assert geometries[2].offset == 0 and sizes == {f32: 384, bf16: 128}
