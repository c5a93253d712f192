"""The autograd functions of a pass: how a use's gradient reaches the engine.

- `RouteGrad`: identity on a gathered weight; its backward hands the full weight gradient to the
  reduce-scatter instead of to the shard.
- `CastGrad`: a replicated parameter read through its compute-dtype copy; the gradient is cast
  back and accumulates into the parameter as usual.
- `ShardedLinear`: F.linear on a gathered weight, with the weight gradient computed straight in
  the reduce dtype, and the weight re-gathered in backward for the input gradient.

[Note: fp32 weight gradients] With bf16 compute and fp32 reductions, autograd's own linear
backward writes the weight gradient in bf16 and the reduce-scatter then needs it in fp32: a cast
that reads and writes every gathered gradient once more (5.1 ms of a 76.6 ms graphed step at
1.36B, batch 1, 2xH200, `benchmarks/profile_gtp.py`). The GEMM can write fp32 itself (cuBLAS
accumulates in fp32 anyway), so uses that are F.linear take `ShardedLinear`: the forward is
F.linear as before, the input gradient is the same GEMM autograd runs, and the weight gradient
is one GEMM with an fp32 output: the bf16 products summed and rounded once in fp32, as
Megatron-LM's fp32 gradient accumulation keeps them. On CPU, where the GEMM has no output
dtype, the operands are upcast instead, which computes the same products. Uses that autograd's
linear handles differently (autocast to another dtype, a bias that is not 1-D) keep autograd's
linear (see `Uses.linear_weight`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..core.weight import ShardedWeight
from ..precision import fp8


class GradRuntime(Protocol):
    """What the backward of a use asks of its engine."""

    reduce_dtype: torch.dtype | None

    def ensure_backward(self) -> None: ...

    def gather(self, w: ShardedWeight, packed: bool = False) -> torch.Tensor: ...

    def full_weight(self, p: torch.Tensor) -> torch.Tensor: ...

    def reduce_grad(self, w: ShardedWeight, grad: torch.Tensor) -> None: ...


class CastGrad(torch.autograd.Function):
    """A replicated parameter used through its compute-dtype copy."""

    @staticmethod
    def forward(ctx, param, cast):  # type: ignore[override]
        ctx.dtype = param.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.to(ctx.dtype), None


class RouteGrad(torch.autograd.Function):
    """Identity on the gathered weight whose backward sends the full grad to the reduce-scatter.

    The shard parameter is an input only so the output requires grad; no gradient flows to it
    through autograd: the reducer writes `.grad` itself when the reduce-scatter is finalized.
    """

    @staticmethod
    def forward(ctx, param, full, runtime, weight):  # type: ignore[override]
        ctx.runtime, ctx.weight = runtime, weight
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.runtime.reduce_grad(ctx.weight, grad)
        return None, None, None, None


def weight_grad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad.T @ x (both 2-D, in the compute dtype) as a `dtype` tensor: rounded once when
    `dtype` is fp32 (the engine's route), else the compute-dtype product cast."""
    if grad.dtype == dtype:
        return grad.t() @ x
    if dtype != torch.float32:
        return (grad.t() @ x).to(dtype)
    if grad.is_cuda:
        return torch.mm(grad.t(), x, out_dtype=dtype)
    return grad.t().to(dtype) @ x.to(dtype)


def _will_run(ctx, index: int) -> bool:
    """Whether this backward needs the gradient of input `index`.

    [Note: needs_input_grad] `ctx.needs_input_grad` is fixed at forward time, while autograd's
    own nodes compute only what the running backward asks for: `autograd.grad(loss, x)` or
    `backward(inputs=[x])` must not reduce-scatter weight gradients. The engine knows which
    nodes it will run; asked about a node outside the graph it raises, and then the gradient
    is computed, as before.
    """
    if not ctx.needs_input_grad[index]:
        return False
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[index][0])
    except RuntimeError:
        return True


class ShardedLinear(torch.autograd.Function):
    """F.linear with a gathered weight (with `scale`, the gathered FP8 rows and their scales,
    run as one FP8 GEMM); backward re-gathers the weight in the compute dtype for the input
    gradient and hands the weight gradient, in the reduce dtype, to the reduce-scatter."""

    @staticmethod
    def forward(ctx, x, param, w, bias, runtime, weight, scale):  # type: ignore[override]
        ctx.runtime, ctx.weight, ctx.param = runtime, weight, param
        ctx.save_for_backward(x)
        if scale is None:
            return F.linear(x, w, bias)
        return fp8.linear_forward(x, w, scale, weight.geometry, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        runtime: GradRuntime = ctx.runtime
        weight: ShardedWeight = ctx.weight
        runtime.ensure_backward()
        g = grad.reshape(-1, weight.geometry.shape[0])
        dx = None
        if _will_run(ctx, 0):  # the weight is re-gathered only when the input needs it
            # With create_graph, dx stays differentiable in the weight, as autograd's is.
            if torch.is_grad_enabled():
                w = runtime.full_weight(ctx.param)
            else:
                w = runtime.gather(weight)
            dx = (g @ w).reshape(x.shape)
        if _will_run(ctx, 1):
            dtype = runtime.reduce_dtype or g.dtype
            runtime.reduce_grad(weight, weight_grad(g, x.reshape(-1, x.shape[-1]), dtype))
        dbias = g.sum(0) if _will_run(ctx, 3) else None
        return dx, None, None, dbias, None, None, None
