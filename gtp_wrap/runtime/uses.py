"""One intercepted use of a managed parameter during a pass: what the torch function runs on.

Every torch function that reads a managed parameter's values inside a pass comes here from
`GTPParameter.__torch_function__` (see [Note: interception] in core/parameter.py). An F.linear
of a sharded 2-D weight takes the engine's own linear where the policy asks for it; an in-place
write is refused; any other use runs on the full weights, each wired so that its gradient
reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from ..core.parameter import GTPParameter, written_param
from ..core.weight import ShardedWeight
from ..errors import WrapError
from ..precision import fp8
from ..precision.encoding import Precision
from .autograd import CastGrad, GradRuntime, RouteGrad, ShardedLinear
from .gather import Gatherer
from .passes import Passes
from .stats import Stats

_CONTAINERS = (list, tuple, dict)


class Uses:
    """Runs the intercepted uses of one engine's parameters."""

    def __init__(
        self,
        runtime: GradRuntime,
        passes: Passes,
        gatherer: Gatherer,
        stats: Stats,
        precision: Precision,
    ) -> None:
        self.runtime = runtime  # what the uses' autograd functions call back in backward
        self.passes = passes
        self.gatherer = gatherer
        self.stats = stats
        self.precision = precision
        self.own_linear = precision.own_linear

    def use(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `func` with each managed parameter among its args replaced by the weight it
        uses: the gathered full weight, or a replicated parameter's compute-dtype copy."""
        if not self.passes.stack:
            self.runtime.ensure_backward()  # a checkpoint recompute: uses inside backward
        w = self.linear_weight(func, args, kwargs) if self.own_linear else None
        if w is not None:
            return self._linear(w, *args, **kwargs)
        p = written_param(func, args, kwargs)
        if p is not None:
            raise WrapError(
                f"{getattr(func, '__name__', func)} writes in place to '{p._gtp_weight.fqn}' "
                "during a forward or backward pass, where it reads as a temporary copy (the "
                "gathered weight, or its compute-dtype copy), so the write would be lost (e.g. "
                "nn.Embedding(max_norm=...) renormalizes its weight this way). Replicate that "
                "weight (a LayerRule with action 'replicate', without param_dtype) or change "
                "it outside passes, under torch.no_grad()"
            )
        full: dict[int, torch.Tensor] = {}

        def substitute(p: GTPParameter) -> torch.Tensor:
            if id(p) not in full:
                full[id(p)] = self.full_weight(p)
            return full[id(p)]

        if any(type(a) in _CONTAINERS for a in args) or kwargs:
            args, kwargs = tree_map_only(GTPParameter, substitute, (args, kwargs))
        else:  # the common case, F.linear(x, w, b): no tree walk
            args = tuple(substitute(a) if type(a) is GTPParameter else a for a in args)
        return func(*args, **kwargs)

    def full_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The weight one use of `p` sees, wired so that its gradient reaches `p`."""
        w = p._gtp_weight  # type: ignore[attr-defined]
        grad = torch.is_grad_enabled() and p.requires_grad
        if type(w) is not ShardedWeight:  # replicated, used in the compute dtype
            return CastGrad.apply(p, w.cast) if grad else w.cast
        full = self.gatherer.gather(w)
        return RouteGrad.apply(p, full, self.runtime, w) if grad else full

    def linear_weight(self, func: Callable, args: tuple, kwargs: dict) -> ShardedWeight | None:
        """The weight if this use is an F.linear that takes the engine's own linear: a sharded
        2-D weight, an input in the compute dtype, no bias or a 1-D one, and no autocast to
        another dtype (see [Note: fp32 weight gradients])."""
        if func is not F.linear or len(args) < 2 or type(args[1]) is not GTPParameter:
            return None
        x, param = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        w = param._gtp_weight
        if type(w) is not ShardedWeight or len(w.geometry.shape) != 2:
            return None
        if type(x) is GTPParameter or x.dtype != self.precision.param_dtype or x.dim() == 0:
            return None
        if x.shape[-1] != w.geometry.shape[1] or (bias is not None and bias.dim() != 1):
            return None
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype:
            return None
        if w.encoding.feeds_gemm:
            return w
        return w if torch.is_grad_enabled() and param.requires_grad else None

    def _linear(
        self,
        w: ShardedWeight,
        x: torch.Tensor,
        param: GTPParameter,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F.linear on the gathered weight through `ShardedLinear`; with fp8_matmul the
        gathered FP8 weight is fed straight to the FP8 GEMM."""
        if type(bias) is GTPParameter:
            bias = self.full_weight(bias)
        scale = None
        geo = w.geometry
        if w.encoding.feeds_gemm:
            full, scale = fp8.unpack_rows(self.gatherer.gather(w, packed=True), geo.world,
                                          geo.rows_per_rank, geo.row_numel)  # fmt: skip
            self.stats.fp8_matmuls += 1
        else:
            full = self.gatherer.gather(w)
        if torch.is_grad_enabled() and (
            x.requires_grad or param.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return ShardedLinear.apply(x, param, full, bias, self.runtime, w, scale)
        assert scale is not None  # without autograd only FP8 GEMMs take this route
        return fp8.linear_forward(x, full, scale, geo, bias)
