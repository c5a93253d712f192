"""Host time of the primitives a block call's weights and gradients cost (issue 21): what one
call of each takes on this host, median of repeated timings, with the device synchronized
around each timing only (the ops are launched, not waited for).

    python benchmarks/results/host_1207c/primitives.py [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, device: torch.device, n: int = 2000, rounds: int = 7) -> float:
    """Median over rounds of the mean µs per call of `fn` (host time: launches, not kernels)."""
    for _ in range(5):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    n = max(5, min(n, int(0.05 / max(time.perf_counter() - t, 1e-7))))  # about 50 ms a round
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(out)


class Views(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *ps):
        return tuple(p.view_as(p) for p in ps)

    @staticmethod
    def backward(ctx, *gs):
        return gs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    d, ffn = 768, 2048
    shapes = [(3 * d, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]  # a 125M block's
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    numels = [g.numel() for g in grads]
    total = sum(numels)
    x = torch.randn(2048, d, device=dev, dtype=torch.bfloat16)
    g2 = torch.randn(2048, d, device=dev, dtype=torch.bfloat16)
    fp32 = torch.float32
    rows = {}
    rows["empty_like x7 (fp32)"] = timed(lambda: [torch.empty_like(g, dtype=fp32) for g in grads], dev)
    outs = [torch.empty_like(g, dtype=fp32) for g in grads]
    rows["_foreach_copy_ 7 bf16->fp32"] = timed(lambda: torch._foreach_copy_(outs, grads), dev)
    rows["empty(total) + unflatten"] = timed(
        lambda: torch._utils._unflatten_dense_tensors(torch.empty(total, device=dev, dtype=fp32), grads), dev)
    rows["empty(total) + split_with_sizes + view x7"] = timed(
        lambda: [t.view(s) for t, s in zip(torch.empty(total, device=dev, dtype=fp32).split(numels), shapes)], dev)
    rows["g.to(fp32) x7"] = timed(lambda: [g.to(fp32) for g in grads], dev)
    rows["mm bf16 (2048x768 @ 768x768)"] = timed(lambda: g2.t() @ x, dev)
    if dev.type == "cuda":
        rows["mm out_dtype fp32"] = timed(lambda: torch.mm(g2.t(), x, out_dtype=fp32), dev)
    ps = [torch.zeros(s, device=dev, requires_grad=True) for s in shapes]
    rows["Function.apply, 7 view outputs"] = timed(lambda: Views.apply(*ps), dev)
    rows["view_as x7"] = timed(lambda: [p.view_as(p) for p in grads], dev)
    for k, v in rows.items():
        print(f"{k:45s} {v:8.2f} us")


if __name__ == "__main__":
    main()
