"""F.linear on a sharded weight, with the weight gradient computed straight in the reduce dtype.

Note: with bf16 compute and fp32 reductions, autograd's own linear backward writes the weight
gradient in bf16 and the reduce-scatter then needs it in fp32: a cast that reads and writes
every gathered gradient once more (5.1 ms of a 76.6 ms graphed step at 1.36B, batch 1, 2xH200,
`benchmarks/profile_gtp.py`). The GEMM can write fp32 itself (cuBLAS accumulates in fp32
anyway), so uses that are F.linear take this path: the forward is F.linear as before, the
input gradient is the same GEMM autograd runs, and the weight gradient is one GEMM with an fp32
output: the bf16 products summed and rounded once in fp32, as Megatron-LM's fp32 gradient
accumulation keeps them. On CPU, where the GEMM has no output dtype, the operands are upcast
instead, which computes the same products. Uses that autograd's linear handles differently
(autocast to another dtype, a bias that is not 1-D) keep autograd's linear (see
`GTPEngine._linear_layout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import fp8

if TYPE_CHECKING:
    from .engine import GTPEngine
    from .storage import ShardLayout


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

    Note: `ctx.needs_input_grad` is fixed at forward time, while autograd's own nodes compute
    only what the running backward asks for: `autograd.grad(loss, x)` or
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
    def forward(ctx, x, param, w, bias, engine, layout, scale):  # type: ignore[override]
        ctx.engine, ctx.layout, ctx.param = engine, layout, param
        ctx.save_for_backward(x)
        if scale is None:
            return F.linear(x, w, bias)
        return fp8.linear_forward(x, w, scale, layout, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        engine: GTPEngine = ctx.engine
        lay: ShardLayout = ctx.layout
        engine._ensure_backward()
        g = grad.reshape(-1, lay.shape[0])
        dx = None
        if _will_run(ctx, 0):  # the weight is re-gathered only when the input needs it
            # With create_graph, dx stays differentiable in the weight, as autograd's is.
            w = engine._full_weight(ctx.param) if torch.is_grad_enabled() else engine.gather(lay)
            dx = (g @ w).reshape(x.shape)
        if _will_run(ctx, 1):
            dtype = engine.reduce_dtype or g.dtype
            engine.reduce_grad(lay, weight_grad(g, x.reshape(-1, x.shape[-1]), dtype))
        dbias = g.sum(0) if _will_run(ctx, 3) else None
        return dx, None, None, dbias, None, None, None
