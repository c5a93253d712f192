"""Host time per call of weight-gradient GEMM variants on the GPU (bf16 in, fp32 out)."""

import json
import sys
import time

import torch

dev = torch.device("cuda")
res = {}


def host(fn, n=300, rounds=5):
    best = 1e9
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        best = min(best, (t1 - t) / n)
    return round(best * 1e6, 2), round((t2 - t) / n * 1e6, 2)


for tokens, din, dout in [
    (2048, 768, 2304),
    (2048, 768, 768),
    (2048, 768, 2048),
    (2048, 2048, 768),
    (16, 768, 768),
]:
    g = torch.randn(tokens, dout, device=dev, dtype=torch.bfloat16)
    x = torch.randn(tokens, din, device=dev, dtype=torch.bfloat16)
    w = torch.randn(dout, din, device=dev, dtype=torch.bfloat16)
    variants = {
        "mm_bf16": lambda: torch.mm(g.t(), x),
        "mm_out_dtype_fp32": lambda: torch.mm(g.t(), x, out_dtype=torch.float32),
        "mm_bf16_then_float": lambda: torch.mm(g.t(), x).float(),
        "mm_fp32_upcast": lambda: torch.mm(g.t().float(), x.float()),
        "linear_fwd": lambda: torch.nn.functional.linear(x, w),
        "dx_mm": lambda: g @ w,
        "cast_to_fp32": lambda: g.to(torch.float32),
        "empty_fp32": lambda: torch.empty(dout, din, device=dev, dtype=torch.float32),
    }
    for lib in ("default", "cublas", "cublaslt"):
        if lib != "default":
            try:
                torch.backends.cuda.preferred_blas_library(lib)
            except Exception as e:
                res[f"{lib}_error"] = str(e)
                continue
        for k, fn in variants.items():
            if lib != "default" and not k.startswith("mm"):
                continue
            fn()
            fn()
            res[f"{tokens}x{din}x{dout} {lib} {k}"] = host(fn)
    torch.backends.cuda.preferred_blas_library("cublas")
# The same linear with its weight a view into one flat buffer (as gathered weights are), at
# several element offsets, against a standalone weight; with autograd recording, as in a step.
x = torch.randn(2048, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
flat = torch.randn(768 * 2304 * 3 + 4096, device=dev, dtype=torch.bfloat16)
alone = torch.randn(2304, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
for off in (0, 8, 64, 768 * 2304, 768 * 2304 + 8):
    wv = flat[off : off + 2304 * 768].view(2304, 768).requires_grad_(False)
    res[f"linear view offset {off}"] = host(lambda: torch.nn.functional.linear(x, wv))
res["linear standalone leaf"] = host(lambda: torch.nn.functional.linear(x, alone))
res["linear standalone nograd"] = host(lambda: torch.nn.functional.linear(x, alone.detach()))
for k, v in res.items():
    print(
        f"{k:55s} host {v[0] if isinstance(v, tuple) else v} us  wall {v[1] if isinstance(v, tuple) else ''} us"
    )
json.dump(res, open(sys.argv[1], "w"), indent=1)
