"""Gradient hooks and syncing: post-accumulate-grad hooks on shards see the reduced gradient;
tensor hooks, which would see no gradient at all, are refused with the alternative named; a
nested no_sync restores what it found; optimizer steps run without interception."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import caught, local_rows, run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

import gtp_wrap
from gtp_wrap import GTPWrap, WrapError, full_state_dict
from gtp_wrap.api import engine_of
from gtp_wrap.core.parameter import _INTERCEPT, GTPParameter


def _model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4, bias=bias))


def _optimizer_in_backward(rank: int, world: int) -> dict:
    """The optimizer-in-backward pattern (an SGD per parameter, stepped by its post-accumulate
    hook) against plain steps of the unsharded model on the whole batch."""
    model, ref = GTPWrap(_model(bias=False), {"min_shard_numel": 0}), _model(bias=False)
    seen: list[tuple[str, bool]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    optims = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        seen.append((names[id(p)], p.grad is not None))
        optims[p].step()
        optims[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x[rank * 2 : rank * 2 + 2]).square().sum().backward()
        ref(x).square().sum().div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, full = full_state_dict(model), ref.state_dict()
    handles[0].remove()
    calls = len(seen)
    model(x[:2]).sum().backward()
    return {
        "seen": seen[:calls],
        "after_remove": len(seen) - calls,
        "diff": max((got[k] - full[k]).abs().max().item() for k in full),
    }


def test_post_accumulate_hooks_see_the_reduced_grad() -> None:
    for got in run_ranks(_optimizer_in_backward, 2):
        assert len(got["seen"]) == 3 * 2, got["seen"]  # once per parameter per backward
        assert all(has_grad for _, has_grad in got["seen"]), got["seen"]
        assert got["after_remove"] == 1  # the removed hook (0.weight's) no longer runs
        assert got["diff"] < 1e-6


def test_tensor_hook_on_a_sharded_parameter_is_refused() -> None:
    model = GTPWrap(_model(), {"min_shard_numel": 0})
    with pytest.raises(WrapError, match="'0.weight'.*register_post_accumulate_grad_hook"):
        model[0].weight.register_hook(lambda g: g)
    model[0].bias.register_hook(lambda g: g)  # replicated: autograd's own hooks
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't require gradient"):  # as torch refuses
        model[0].weight.register_post_accumulate_grad_hook(lambda p: None)


def test_autograd_grad_of_a_sharded_parameter_is_refused() -> None:
    """With respect to a sharded weight, before anything runs (no `.grad` written); with
    respect to a replicated one or the input, the same gradients as the unwrapped model's."""
    torch.manual_seed(0)
    ref = _model()
    model = GTPWrap(copy.deepcopy(ref), {"min_shard_numel": 0})
    x = torch.randn(2, 8, requires_grad=True)
    loss = model(x).square().sum()
    with pytest.raises(
        WrapError, match="autograd.grad with respect to the sharded parameter '0.weight'"
    ):
        torch.autograd.grad(loss, [model[0].bias, model[0].weight])
    assert model[0].weight.grad is None
    got = torch.autograd.grad(loss, [model[0].bias, x])
    want = torch.autograd.grad(ref(x).square().sum(), [ref[0].bias, x])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with pytest.raises(WrapError, match="sharded parameter 'lin.weight'"):
        GTPWrap(_Penalized(), {"min_shard_numel": 0})(x)


class _Penalized(nn.Module):
    """A gradient penalty taken inside the forward, with respect to a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        (g,) = torch.autograd.grad(y.sum(), [self.lin.weight], create_graph=True)
        return y.sum() + g.square().sum()


def _replicated_hook(rank: int, world: int) -> list[str]:
    model = GTPWrap(_model(), {"min_shard_numel": 0})
    model[0].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.warns(UserWarning) as caught:
        model(torch.ones(2, 8)).sum().backward()
    return [str(w.message) for w in caught]


def test_hook_on_a_replicated_parameter_warns_it_sees_the_local_grad() -> None:
    """Autograd runs hooks of replicated parameters before GTP's all-reduce, as DDP's."""
    for messages in run_ranks(_replicated_hook, 2):
        assert any("'0.bias'" in m and "before the all-reduce" in m for m in messages), messages


def test_hook_on_a_replicated_bf16_parameter_steps_the_parameter() -> None:
    """With param_dtype, a replicated parameter is used through its compute-dtype copy; an
    optimizer step in its hook runs inside backward and must still reach the parameter."""
    model = GTPWrap(_model(), {"min_shard_numel": 0, "param_dtype": "bfloat16"})
    bias = model[0].bias
    before = bias.detach().clone()
    opt = torch.optim.SGD([bias], lr=0.5, foreach=True)
    seen: list[torch.Tensor] = []

    def step(p: torch.Tensor) -> None:
        seen.append(p.grad.detach().clone())
        opt.step()

    bias.register_post_accumulate_grad_hook(step)
    model(torch.ones(2, 8)).float().sum().backward()
    assert len(seen) == 1
    assert torch.equal(bias.detach(), before - 0.5 * seen[0])


def test_nested_no_sync_keeps_syncing_off_until_the_outermost_exits() -> None:
    model = GTPWrap(_model(), {"min_shard_numel": 0})
    engine = engine_of(model)
    with gtp_wrap.no_sync(model):
        with gtp_wrap.no_sync(model):
            pass
        assert engine.replicated.sync is False
    assert engine.replicated.sync is True


class _ProbeSGD(torch.optim.SGD):
    """SGD recording, per step, whether parameters were free of interception; it can fail
    before stepping."""

    def __init__(self, params, fail: bool = False) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=0.1)
        self.fail = fail
        self.plain: list[bool] = []

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        self.plain.append(GTPParameter.__torch_function__ is torch._C._disabled_torch_function_impl)
        if self.fail:
            raise RuntimeError("the step failed")
        return super().step(closure)


def _steps_without_interception(rank: int, world: int) -> dict:
    """Optimizer steps switch interception off, and it stays off through zero_grad until the
    next pass opens, after a step that raised too; training stays exact, and torch's clip is
    refused again once the next forward ran."""
    model, ref = GTPWrap(_model(), {"min_shard_numel": 0}), _model()
    opt, ref_opt = _ProbeSGD(model.parameters()), torch.optim.SGD(ref.parameters(), lr=0.1)
    intercepting: dict[str, list[bool]] = {"after_step": [], "after_zero_grad": [], "forward": []}

    def on() -> bool:
        return GTPParameter.__dict__["__torch_function__"] is _INTERCEPT

    model.register_forward_hook(lambda *_: intercepting["forward"].append(on()))
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x[rank * 2 : rank * 2 + 2]).square().sum().backward()
        ref(x).square().sum().div(world).backward()
        opt.fail = i == 1  # the second step raises and steps nothing
        try:
            opt.step()
        except RuntimeError:
            ref_opt.zero_grad()
        else:
            ref_opt.step()
        intercepting["after_step"].append(on())
        opt.zero_grad()
        ref_opt.zero_grad()
        intercepting["after_zero_grad"].append(on())
    got, full = full_state_dict(model), ref.state_dict()
    diff = max((got[k] - full[k]).abs().max().item() for k in full)
    model(torch.randn(2, 8)).sum().backward()
    clip = caught(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return {"plain": opt.plain, **intercepting, "clip": clip, "diff": diff}


def test_optimizer_steps_run_without_interception() -> None:
    for got in run_ranks(_steps_without_interception, 2):
        assert got["plain"] == [True, True, True]
        # Off from each step (the one that raised too) through zero_grad, on in every forward.
        assert got["after_step"] == [False, False, False]
        assert got["after_zero_grad"] == [False, False, False]
        assert got["forward"] == [True, True, True, True]
        assert got["clip"].startswith("WrapError: torch.nn.utils.clip_grad_norm_"), got["clip"]
        assert got["diff"] < 1e-6


class _Checkpointed(nn.Module):
    """Its body recomputed in backward (a checkpoint), where its weights are read again."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False)


def _step_between_forward_and_backward(rank: int, world: int) -> float:
    """Another model's optimizer steps between this one's forward and backward (a GAN's
    discriminator), which switches interception off: the backward's recompute still reads
    the gathered weights, as the reference's."""
    torch.manual_seed(0)
    model = GTPWrap(_Checkpointed(), {"min_shard_numel": 0})
    torch.manual_seed(0)
    ref = _Checkpointed()
    other = nn.Linear(3, 3)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = model(x[rank * 2 : rank * 2 + 2]).square().sum()
    ref(x).square().sum().div(world).backward()
    other(torch.randn(2, 3)).sum().backward()
    other_opt.step()
    loss.backward()
    params = dict(model.named_parameters())
    return max(
        (params[n].grad - local_rows(params[n], p.grad)).abs().max().item()
        for n, p in ref.named_parameters()
    )


def test_a_step_between_forward_and_backward_leaves_the_recompute_gathered() -> None:
    for diff in run_ranks(_step_between_forward_and_backward, 2):
        assert diff < 1e-6
