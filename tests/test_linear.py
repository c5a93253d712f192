"""The engine's own F.linear (gtp_wrap/runtime/uses.py, bf16 compute with fp32 reductions):
every way a user asks autograd for gradients gives what autograd's linear gives, against an
unwrapped float64 model on the same ranks' data."""

from __future__ import annotations

import pytest
import torch
from harness import cached_ranks
from linear_cases import MLP, TOL, compare, inputs, reference
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap

BF16 = {"min_shard_numel": 0, "param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty: the squared input gradient, itself differentiated (create_graph)."""
    (gx,) = torch.autograd.grad(model(x).float().sum(), x, create_graph=True)
    return gx.float().square().sum()


def _scenarios(rank: int, world: int) -> dict:
    x = inputs(world)[rank]
    out = {}

    torch.manual_seed(0)
    model = GTPWrap(MLP(), BF16)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(model(xr).float().sum(), xr)
    model(xr).float().sum().backward(inputs=[xr])
    out["input_only"] = {
        "weight_grads": [n for n, p in model.named_parameters() if p.grad is not None],
        "same_gx": torch.equal(gx, xr.grad),
    }

    torch.manual_seed(0)
    model = GTPWrap(MLP(), BF16)
    _penalty(model, x.clone().requires_grad_()).backward()
    out["penalty"] = compare(model, reference(world, _penalty))

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().square().sum()

    torch.manual_seed(0)
    model = GTPWrap(MLP(bias2d=True), BF16)
    plain(model, x.clone().requires_grad_()).backward()
    out["bias2d"] = compare(model, reference(world, plain, bias2d=True))

    torch.manual_seed(0)
    model = GTPWrap(MLP(), {"min_shard_numel": 0, "param_dtype": "float16",
                            "reduce_dtype": "float32"})  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x.clone().requires_grad_()).float().square().sum()
    loss.backward()
    out["autocast"] = compare(model, reference(world, plain))

    # Sharded weights frozen, replicated biases trained: their optimizer steps must not make the
    # engine re-cast the kept shard copy.
    torch.manual_seed(0)
    model = MLP()
    for lin in (model.a, model.b):
        lin.weight.requires_grad_(False)
    model = GTPWrap(model, BF16 | {"compute_copy": True})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    for step in range(3):
        plain(model, x).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            gtp_wrap.reset_stats(model)
    out["frozen_casts"] = gtp_wrap.stats(model)["weight_casts"]
    return out


def _results() -> list[dict]:
    return cached_ranks(_scenarios, 2)


def test_grads_of_inputs_only_reduce_no_weight_gradient() -> None:
    """autograd.grad(loss, x) and backward(inputs=[x]) reduce no weight gradient."""
    for rank, r in enumerate(_results()):
        assert r["input_only"] == {"weight_grads": [], "same_gx": True}, rank


@pytest.mark.parametrize(
    "scenario",
    [
        "penalty",  # a gradient penalty's second backward reaches the weights through dx
        "bias2d",  # a 2-D bias (not F.linear's usual 1-D) takes autograd's own path
        "autocast",  # so does autocast to another dtype than param_dtype
    ],
)
def test_gradients_equal_autograds_linear(scenario: str) -> None:
    for r in _results():
        assert max(r[scenario].values()) < TOL, r[scenario]


def test_frozen_shards_are_not_recast_by_steps_of_the_trained_biases() -> None:
    for r in _results():
        assert r["frozen_casts"] == 0


def test_an_input_that_outlived_a_functorch_transform_trains_as_unwrapped() -> None:
    """A tensor that leaked out of torch.func.grad (a dead functorch wrapper) fed to the
    engine's linear: its autograd function is applied through Function.apply's unwrapping
    (see [Note: applying the engine's autograd functions]), so backward reaches the input as
    autograd's own linear does."""
    torch.manual_seed(0)
    ref = MLP()
    model = GTPWrap(MLP(), {"min_shard_numel": 0})
    model.load_state_dict(ref.state_dict())
    leaked: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        leaked.append(x * 2)  # outlives the transform, with the outer graph's history
        return x.sum()

    grads = []
    for m in (model, ref):
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.func.grad(f)(x)
        assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[-1])
        m(leaked[-1]).sum().backward()
        grads.append((x.grad, dict(m.named_parameters())["a.weight"].grad))
    torch.testing.assert_close(grads[0], grads[1])


def test_forward_mode_ad_takes_autograds_linear() -> None:
    """Forward-mode AD through the default fp32 policy: the engine's linear has no jvp, so a
    use under a dual level takes autograd's linear, whose jvp is the unwrapped model's."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    ref = MLP()
    model = GTPWrap(MLP(), {"min_shard_numel": 0})
    model.load_state_dict(ref.state_dict())
    x, t = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)), torch.ones(3, 32)
    got, want = [], []
    for m, out in ((model, got), (ref, want)):
        with fwAD.dual_level():
            out.append(fwAD.unpack_dual(m(fwAD.make_dual(x, t))).tangent)
    torch.testing.assert_close(got[0], want[0])
