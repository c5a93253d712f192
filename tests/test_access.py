"""Access patterns beyond a plain forward: tensor-valued attributes, submodules called on their
own, metadata in the compute dtype, a backward that raises, ranks built with different seeds."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import cached_ranks, caught, run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.api import engine_of
from gtp_wrap.core.parameter import OpenPasses
from gtp_wrap.runtime import replicated


class TransposeHead(nn.Module):
    """Reads `.T` of a weight and casts its input with `x.to(weight.dtype)`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("noise", torch.rand(3))  # differs per seed; unused in forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(idx)))
        h = h.to(self.proj.weight.dtype)
        return h @ self.embed.weight.T


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TransposeHead()


def _patterns(rank: int, world: int) -> dict:
    idx = torch.arange(6).view(2, 3)
    ref = _model()
    model = GTPWrap(_model(seed=rank), {"min_shard_numel": 0})  # seeds differ per rank
    out = {"replicated_equal": torch.equal(model.proj.bias.detach(), ref.proj.bias.detach())}
    out["buffer_equal"] = torch.equal(model.noise, ref.noise)
    out["forward"] = (model(idx) - ref(idx)).abs().max().item()  # every rank: it gathers
    with torch.no_grad():  # a submodule on its own, outside the root's forward
        out["submodule"] = (model.embed(idx) - ref.embed(idx)).abs().max().item()
    bf16 = GTPWrap(_model(), {"min_shard_numel": 0, "param_dtype": "bfloat16"})
    out["bf16_out"] = str(bf16(idx).dtype)

    # A backward that raises part-way (after the replicated bias's all-reduce was launched)
    # must not leave the engine in a pass, nor that all-reduce's result for the next step.
    torch.manual_seed(0)
    model, ref = GTPWrap(TransposeHead(), {"min_shard_numel": 0}), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def boom(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))

    hook = model.embed.register_forward_hook(boom)
    try:
        model(idx).sum().backward()
    except RuntimeError as e:
        out["raised"] = "boom" in str(e)
    hook.remove()
    opt.zero_grad()
    x = torch.arange(12).view(4, 3) % 16
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    F.cross_entropy(model(x[rows]).flatten(0, 1), x[rows].flatten()).backward()
    opt.step()
    out["open_passes"] = OpenPasses.count
    F.cross_entropy(ref(x).flatten(0, 1), x.flatten()).backward()
    ref_opt.step()
    full = gtp_wrap.full_state_dict(model)
    out["after_error"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())

    # A replicated parameter frozen when wrapped and unfrozen later is still all-reduced.
    ref = _model()
    frozen = _model()
    frozen.proj.bias.requires_grad_(False)
    model = GTPWrap(frozen, {"min_shard_numel": 0})
    model(x[rows]).sum().backward()
    out["frozen_grad"] = model.proj.bias.grad
    model.proj.bias.requires_grad_(True)
    model(x[rows]).sum().backward()
    ref(x).sum().backward()  # the mean over ranks of each rank's sum
    out["unfrozen_diff"] = (model.proj.bias.grad - ref.proj.bias.grad / world).abs().max().item()
    # ... also when it is the only parameter training (nothing sharded takes part in backward),
    # and its bucket holds no buffer while it is frozen.
    ref = _model()
    frozen = _model()
    frozen.proj.bias.requires_grad_(False)
    model = GTPWrap(frozen, {"min_shard_numel": 0})
    buckets = engine_of(model).replicated.buckets
    out["frozen_bucket_numel"] = sum(b.flat.numel() for b in buckets)
    model.requires_grad_(False)
    model.proj.bias.requires_grad_(True)
    ref.requires_grad_(False)
    ref.proj.bias.requires_grad_(True)
    model(x[rows]).sum().backward()
    ref(x).sum().backward()
    out["only_bias_diff"] = (model.proj.bias.grad - ref.proj.bias.grad / world).abs().max().item()
    dist.barrier()
    return out


def _results() -> list[dict]:
    return cached_ranks(_patterns, 2)


def test_every_rank_starts_from_rank0s_parameters_and_buffers() -> None:
    for r in _results():
        assert r["replicated_equal"] and r["buffer_equal"]


def test_forward_reads_full_weights_on_every_rank() -> None:
    for r in _results():
        assert r["forward"] < 1e-6
        assert r["submodule"] < 1e-6  # a submodule called on its own gathers too


def test_metadata_during_a_pass_is_the_compute_dtypes() -> None:
    for r in _results():
        assert r["bf16_out"] == "torch.bfloat16"


def test_a_backward_that_raises_leaves_no_pass_nor_stale_result() -> None:
    for r in _results():
        assert r["raised"] and r["open_passes"] == 0
        assert r["after_error"] < 1e-6


def test_replicated_parameters_unfrozen_after_wrapping_are_all_reduced() -> None:
    for r in _results():
        assert r["frozen_grad"] is None and r["unfrozen_diff"] < 1e-5
        assert r["frozen_bucket_numel"] == 0 and r["only_bias_diff"] < 1e-5


def _forward_inside_backward(rank: int, world: int, group_numel: int) -> float:
    """A tensor hook evaluates the model under no_grad in the middle of backward (logging, say):
    the live backward pass and its pending gradients must survive the nested forward."""
    idx = torch.arange(12).view(4, 3) % 16
    probe = torch.arange(3).view(1, 3)
    torch.manual_seed(0)
    ref = TransposeHead()
    model = GTPWrap(_model(), {"min_shard_numel": 0, "group_numel": group_numel})
    for net, x in ((ref, idx), (model, idx[rank * 2 : (rank + 1) * 2])):

        def evaluate(grad: torch.Tensor, net: nn.Module = net) -> torch.Tensor:
            with torch.no_grad():
                net(probe)
            return grad

        def hook(module: nn.Module, args: tuple, out: torch.Tensor, evaluate=evaluate) -> None:
            if out.requires_grad:  # not in the evaluation itself
                out.register_hook(evaluate)

        net.proj.register_forward_hook(hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(2):
            F.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
    full = gtp_wrap.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_model_forward_inside_backward() -> None:
    for group_numel in (0, 1 << 24):
        assert max(run_ranks(_forward_inside_backward, 2, group_numel)) < 1e-6


class EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        return self.enc(x) if skip_head else self.head(self.enc(x))


def _chains_and_store(rank: int, world: int) -> dict:
    model = GTPWrap(EncoderHead(), {"min_shard_numel": 0, "group_numel": 0})
    agreement, store = engine_of(model).agreement, dist.distributed_c10d._get_default_store()
    x, out = torch.randn(2, 8), {}
    for step in range(6):  # submodules called on their own keep a chain each
        if step == 2:
            before = agreement.count
        model.head(model.enc(x)).sum().backward()
    out["split_new_records"] = agreement.count - before
    for step in range(8):  # a pass that changes every step re-records every step
        if step == 2:
            dist.barrier()  # both ranks done with the same exchanges when counting keys
            before, keys = agreement.count, store.num_keys()
        model(x, skip_head=step % 2 == 1).sum().backward()
    out["alternating_records"] = agreement.count - before
    dist.barrier()
    out["store_growth"] = store.num_keys() - keys
    return out


def test_chains_per_submodule_call_and_a_bounded_store() -> None:
    for got in run_ranks(_chains_and_store, 2):
        assert got["split_new_records"] == 0, got
        assert got["alternating_records"] >= 6, got  # the check each re-record makes
        assert got["store_growth"] == 0, got  # its keys are deleted once read


def _unfreeze_one_of_many(rank: int, world: int) -> float:
    """Of several replicated parameters frozen at wrap time, unfreeze one (not the first)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    model, ref = build().requires_grad_(False), build().requires_grad_(False)
    GTPWrap(model, {"min_shard_numel": 0})  # everything frozen when wrapped
    for m in (model, ref):
        m[0].bias.requires_grad_(True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    model(x[rows]).square().sum().backward()
    ref(x).square().sum().backward()
    return (model[0].bias.grad - ref[0].bias.grad / world).abs().max().item()


def test_unfreezing_one_of_several_frozen_replicated_parameters() -> None:
    assert max(run_ranks(_unfreeze_one_of_many, 2)) < 1e-5


class Branch(nn.Module):
    """A replicated scale and shift that each step's data may leave unused on some ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.shift = nn.Parameter(torch.linspace(-0.1, 0.1, 16))
        self.b = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor, scale: bool, shift: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = h * self.scale if scale else h
        return self.b(h + self.shift if shift else h)


def _replicated_used_by_some_ranks(rank: int, world: int, bucket_bytes: int) -> float:
    """SGD steps in which each replicated parameter is used on rank 0 only, on rank 1 only, on
    both or on neither; the reference averages each rank's own plain gradients (a gradient no
    rank had stays None), as DDP does. `bucket_bytes`: small, a bucket per parameter, which
    the two ranks fill in opposite orders."""
    replicated._BUCKET_BYTES = bucket_bytes
    torch.manual_seed(0)
    ref = Branch()
    model = GTPWrap(copy.deepcopy(ref), {"min_shard_numel": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps = [((True, False), (False, True)), ((False, True), (True, False)),
             ((True, True), (True, False)), ((False, False), (False, False))]  # fmt: skip
    for step, uses in enumerate(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x, *uses[rank]).square().mean().backward()
        ref(x, *uses[rank]).square().mean().backward()
        for p in ref.parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            had = torch.tensor(float(p.grad is not None))
            dist.all_reduce(grad)
            dist.all_reduce(had)
            p.grad = grad / world if had.item() else None
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got = gtp_wrap.full_state_dict(model)
    return max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("bucket_bytes", [replicated._BUCKET_BYTES, 4])
def test_replicated_parameters_some_ranks_leave_unused(bucket_bytes: int) -> None:
    """A rank with no gradient for a replicated parameter launches its bucket's all-reduce
    when backward ends, its peers as soon as their gradients are in: on a group of their own
    (see [Note: replicated all-reduces on a group of their own], mesh.py) and in one order of
    buckets on every rank, the all-reduces still meet. On the reduce-scatters' group gloo
    aborted with a size mismatch; buckets launched as they filled met the wrong partners."""
    assert max(run_ranks(_replicated_used_by_some_ranks, 2, bucket_bytes)) < 1e-6


class _Stall(torch.autograd.Function):
    """Identity whose backward sleeps 1.5 s: a rank late in the middle of its backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(1.5)
        return grad


class _Deeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.c = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor, scale: bool, stall: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = _Stall.apply(h) if stall else h
        h = h * self.scale if scale else h
        return self.c(torch.tanh(self.b(h)))


def _late_peer(rank: int, world: int) -> list[str]:
    """Rank 0 alone uses the scale, so it all-reduces its bucket mid-backward; the last rank
    stalls in its third backward after that point, and its peers' watch posts what they wait
    for."""
    torch.manual_seed(0)
    model = GTPWrap(_Deeper(), {"min_shard_numel": 0, "group_numel": 1})
    got = []
    for step in range(3):
        stall = step == 2 and rank == world - 1
        loss = model(torch.randn(4, 16), rank == 0, stall).square().mean()
        got.append(caught(loss.backward))
    return got


def test_replicated_all_reduces_are_numbered_on_their_own_group() -> None:
    """The replicated all-reduces, issued at different moments on different ranks, are counted
    on their own group: counted as collectives of the reduce-scatters' group, a late rank's
    peers compared different numbers and raised a false ChainMismatchError."""
    for got in run_ranks(_late_peer, 3):
        assert got == ["no error"] * 3, got


def _penalty_outside_forward(rank: int, world: int) -> list[str]:
    """A weight penalty summed over model.parameters() outside the forward, before it, after
    it, and before it after an optimizer step (interception off): each backward raises."""
    torch.manual_seed(0)
    model = GTPWrap(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                    {"min_shard_numel": 0})  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    errors = []
    for when in ("before", "after", "before, after a step"):
        if when == "before, after a step":
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        penalty = None if when == "after" else sum(p.square().sum() for p in model.parameters())
        loss = model(x).square().mean()
        if penalty is None:
            penalty = sum(p.square().sum() for p in model.parameters())
        try:
            (loss + 1e-2 * penalty).backward()
        except gtp_wrap.WrapError as error:
            errors.append(str(error))
        opt.zero_grad()
    return errors


def test_a_penalty_on_shards_outside_the_forward_is_refused_in_backward() -> None:
    """Outside the model's passes a sharded parameter holds this rank's rows, so a penalty on
    it is one rank's part, and its gradient would be silently wrong ([Note: gradients of
    shards], core/parameter.py): the gradient reaching the parameter raises, naming it."""
    for errors in run_ranks(_penalty_outside_forward, 2):
        assert len(errors) == 3, errors
        named = ("'0.weight' got a gradient through an op outside",
                 "'2.weight' got a gradient through an op outside")  # fmt: skip
        assert all(e.startswith(named) for e in errors), errors


class _ReadsItsWeights(nn.Module):
    """Reads a weight without its gradient in its forward (`.data` where `through_data`), and
    (through a forward hook the test adds after wrapping) a weight's norm under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 16), nn.Linear(16, 3)
        self.through_data = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a.weight
        scale = (w.data if self.through_data else w.detach()).norm()  # a statistic
        return self.c(torch.tanh(self.a(x) / scale))


def _scale_by_weight_norm(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        scale = module.c.weight.norm()
    return out * scale


def _reads_in_forward_and_hooks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = _ReadsItsWeights()
    model = GTPWrap(copy.deepcopy(ref), {"min_shard_numel": 0})
    for m in (ref, model):  # registered after wrapping: it runs after the engine's own hook
        m.register_forward_hook(_scale_by_weight_norm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    rows = slice(2 * rank, 2 * rank + 2)
    losses = []
    for _ in range(3):
        step = []
        for m, opt, inp in zip((ref, model), opts, (x, x[rows])):
            loss = m(inp).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            step.append(loss.detach())
        dist.all_reduce(step[1])
        losses.append((step[0].item(), step[1].item() / world))
    with torch.no_grad():
        out = (model(x) - ref(x)).abs().max().item() / ref(x).abs().max().item()
    model.through_data = True  # type: ignore[assignment]
    return {"losses": losses, "out": out, "data": caught(lambda: model(x[rows]))}


def test_weights_read_in_hooks_added_after_wrapping_are_full_and_data_is_refused() -> None:
    """A forward hook added after wrapping ran after the pass had closed and read this rank's
    rows, silently; so did `.data` in a forward, refused now (`.detach()` is the full weight)."""
    for r in run_ranks(_reads_in_forward_and_hooks, 2, timeout=120):
        for ref, got in r["losses"]:
            assert got == pytest.approx(ref, rel=1e-5)
        assert r["out"] < 1e-5
        assert r["data"].startswith("WrapError: 'a.weight'.data was read inside the forward")
        assert "weight.detach()" in r["data"]


class _MyLinear(torch.autograd.Function):
    """A user's own autograd Function taking a weight (a fused kernel, say)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _CustomFunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The README's recipe: a custom Function gets the weight through a use (view_as),
        # the gathered weight wired to the reducer, not the parameter itself.
        w = self.a.weight.view_as(self.a.weight)
        return self.c(torch.tanh(_MyLinear.apply(x, w) + self.a.bias))


def _custom_function(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = _CustomFunctionNet()
    model = GTPWrap(copy.deepcopy(ref), {"min_shard_numel": 0})
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ref, model)]
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, opt, inp in zip((ref, model), opts, (x, x[2 * rank : 2 * rank + 2])):
            m(inp).square().mean().backward()
            opt.step()
            opt.zero_grad()
    full = gtp_wrap.full_state_dict(model)
    return {k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()}


def test_a_custom_autograd_function_given_the_weight_through_a_use_trains_exactly() -> None:
    for r in run_ranks(_custom_function, 2, timeout=120):
        assert max(r.values()) < 1e-6, r
