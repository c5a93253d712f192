"""Why a step's GEMMs run slower than parts.py times them (issue 26, 2026-12-06): parts.py
repeats each GEMM on the same inputs, which then sit in the GPU's L2 (50 MB on an H100 or H200;
a 125M batch-8 activation is 12.6 MB), while in a step a weight gradient reads activations saved
long before, from HBM. Each weight-GEMM shape of the two reference models at batch 1 and 8 is
timed twice here, back to back (10 a burst, fastest of 5 bursts): hot, on one pair of inputs,
as parts.py does; and cold, cycling through as many copies of its inputs as fill 4 x the L2
(and at least 8), so no GEMM finds its inputs in L2. SDPA forward and backward likewise, at
batch 8.

    PYTHONPATH=. python benchmarks/results/gemm_l2_1206/cold_parts.py OUT.json
"""

import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from calibrate import timed  # noqa: E402

from gtp_wrap.scaling.model import GPT_1P36B, GPT_125M  # noqa: E402
from gtp_wrap.scaling.predict import pass_order  # noqa: E402

BURST = 10
L2_BYTES = 50 * 2**20
device, dtype = torch.device("cuda", 0), torch.bfloat16


def copies_for(nbytes: int) -> int:
    return max(8, math.ceil(4 * L2_BYTES / nbytes))


def burst_s(fn, inputs: list) -> float:
    """Seconds per call: fastest of 5 bursts, each a call on every one of `inputs` in turn
    (at least BURST calls)."""
    calls = max(BURST, len(inputs))

    def run() -> None:
        for i in range(calls):
            fn(*inputs[i % len(inputs)])

    return timed(run, device, 5) / calls


def gemm(m: int, k: int, n: int) -> tuple[float, float]:
    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(m, k, device=device, dtype=dtype),
                torch.randn(k, n, device=device, dtype=dtype))  # fmt: skip

    hot = burst_s(torch.mm, [pair()])
    cold = burst_s(torch.mm, [pair() for _ in range(copies_for(2 * (m * k + k * n)))])
    return hot, cold


def attention(batch: int, heads: int, seq: int, hd: int) -> tuple[float, float]:
    def inputs() -> tuple[torch.Tensor, ...]:
        q, k, v = (
            torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        return q, k, v, torch.randn(batch, heads, seq, hd, device=device, dtype=dtype)

    def run(q, k, v, grad) -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    one = inputs()
    nbytes = 4 * one[0].numel() * 2
    return burst_s(run, [one]), burst_s(run, [inputs() for _ in range(copies_for(nbytes))])


out: dict = {"device": torch.cuda.get_device_name(), "gemms": [], "attention": []}
for model in (GPT_125M, GPT_1P36B):
    for batch in (1, 8):
        m = batch * model.seq
        shapes: Counter[tuple[int, int, int]] = Counter()
        for w, _ in pass_order(model, backward=False):
            if w.kind != "embedding":
                shapes.update([(m, w.cols, w.rows), (m, w.rows, w.cols), (w.rows, m, w.cols)])
        for (mm, k, n), count in sorted(shapes.items()):
            hot, cold = gemm(mm, k, n)
            out["gemms"].append({"model": model.name, "batch": batch, "m": mm, "k": k, "n": n,
                                 "per_step": count, "hot_s": hot, "cold_s": cold})  # fmt: skip
        if batch == 8:
            hot, cold = attention(batch, model.heads, model.seq, model.d // model.heads)
            out["attention"].append({"model": model.name, "batch": batch, "heads": model.heads,
                                     "hot_s": hot, "cold_s": cold})  # fmt: skip
        torch.cuda.empty_cache()
        rows = [g for g in out["gemms"] if g["model"] == model.name and g["batch"] == batch]
        hot_ms = sum(g["per_step"] * g["hot_s"] for g in rows) * 1e3
        cold_ms = sum(g["per_step"] * g["cold_s"] for g in rows) * 1e3
        print(f"{model.name} b{batch}: a step's GEMMs hot {hot_ms:.2f} ms, cold {cold_ms:.2f} ms",
              flush=True)  # fmt: skip
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out["attention"], indent=1))
