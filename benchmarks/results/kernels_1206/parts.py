"""The cost model's device parts timed one by one on this GPU (issue 26, 2026-12-06): every
weight GEMM shape of the two reference models at batch 1 and 8 (forward, input and weight
gradient, as calibrate.py's GEMM fit times them, with how many a step runs), one layer's SDPA
forward and backward at each model's heads, and the fp32 cross-entropy over bf16 logits,
forward and backward. Each is run back to
back (10 in a burst, one sync), fastest of 5 bursts, so the host's launches are not timed.

    PYTHONPATH=. python benchmarks/results/kernels_1206/parts.py OUT.json
"""

import json
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
device, dtype = torch.device("cuda", 0), torch.bfloat16


def burst(fn):
    def run() -> None:
        for _ in range(BURST):
            fn()

    return lambda: timed(run, device, 5) / BURST


def attention_s(batch: int, heads: int, seq: int, hd: int) -> float:
    q, k, v = (
        torch.randn(batch, heads, seq, hd, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(batch, heads, seq, hd, device=device, dtype=dtype)
    # autograd.grad: each call writes new gradients, as a step does, not adding into .grad
    return burst(
        lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad
        )
    )()


def loss_s(rows: int, vocab: int) -> float:
    logits = torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (rows,), device=device)
    return burst(lambda: torch.autograd.grad(F.cross_entropy(logits.float(), y), logits))()


out: dict = {"device": torch.cuda.get_device_name(), "gemms": [], "attention": [], "loss": []}
for model in (GPT_125M, GPT_1P36B):
    for batch in (1, 8):
        m = batch * model.seq
        shapes: Counter[tuple[int, int, int]] = Counter()  # (M, K, N): GEMMs of one step
        for w, _ in pass_order(model, backward=False):
            if w.kind != "embedding":
                shapes.update([(m, w.cols, w.rows), (m, w.rows, w.cols), (w.rows, m, w.cols)])
        for (mm, k, n), count in sorted(shapes.items()):
            a = torch.randn(mm, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            s = burst(lambda a=a, b=b: a @ b)()
            out["gemms"].append({"model": model.name, "batch": batch, "m": mm, "k": k, "n": n,
                                 "per_step": count, "seconds": s})  # fmt: skip
        hd = model.d // model.heads
        s = attention_s(batch, model.heads, model.seq, hd)
        out["attention"].append({"model": model.name, "batch": batch, "heads": model.heads,
                                 "head_dim": hd, "seq": model.seq, "seconds": s})  # fmt: skip
        if model is GPT_125M:  # the same vocabulary at both models
            out["loss"].append({"logits": m * model.vocab, "seconds": loss_s(m, model.vocab)})
        print(model.name, batch, "done", flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: v for k, v in out.items() if k != "gemms"}, indent=1))
