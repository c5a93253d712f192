"""How close the copy-engine collectives' SM kernels run to memory bandwidth, and whether the
two-rank gradient sum would be cheaper inside the weight-gradient GEMM (one GPU).

    python benchmarks/copy_kernels_bw.py --out benchmarks/results

Part 1 times `copy_kernels.write_twice` (fp32 in, bf16 written twice) and `sum_into` (two fp32
inputs, one fp32 output, halved) on 64M elements against a plain fp32 copy and PyTorch's own
ops, as bytes moved per second.

Part 2 sizes an alternative to the reduce-scatter's sum kernel: compute the peer's rows of the
weight gradient first (to send them), then this rank's rows with `addmm(beta, alpha)` on top of
the rows the peer sent, so the sum happens in the GEMM's epilogue. For each weight shape of the
1.36B model at 2048 tokens it times today's work on one rank (the full fp32-output GEMM, then
`sum_into` over this rank's half) against the two half GEMMs, and checks the epilogue sum is
bit-equal to adding the own half's GEMM output. No second GPU is involved: this is the
compute-side cost only (the split would also make the compute stream wait for the peer).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from gtp_wrap.comm import copy_kernels

NUMEL = 64 << 20
TOKENS = 2048
SHAPES = [(2048, 2048), (6144, 2048), (5632, 2048), (2048, 5632), (32000, 2048)]  # 1.36B


def _ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Mean milliseconds per call, back to back on the current stream, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bandwidth() -> dict[str, dict[str, float]]:
    src, x, y, out = (torch.randn(NUMEL, device="cuda") for _ in range(4))
    a, b = (torch.empty(NUMEL, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "fp32 copy_": (lambda: x.copy_(y), 8),
        "write_twice fp32 -> 2 x bf16": (lambda: copy_kernels.write_twice(src, a, b), 8),
        "cast + copy (PyTorch)": (lambda: (a.copy_(src), b.copy_(a)), 8),
        "sum_into fp32, halved": (lambda: copy_kernels.sum_into(out, x, y, True), 12),
        "add fp32 (PyTorch)": (lambda: torch.add(x, y, out=out), 12),
    }
    results = {}
    for name, (fn, bytes_per_element) in cases.items():
        ms = _ms(fn)
        results[name] = {"ms": ms, "GB/s": bytes_per_element * NUMEL / ms / 1e6}
    return results


def epilogue_sum(rows: int, cols: int) -> dict[str, float | bool]:
    """Today's GEMM and sum against the split GEMMs, for one weight of `rows` x `cols`."""
    g = torch.randn(TOKENS, rows, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, cols, device="cuda", dtype=torch.bfloat16)
    half = rows // 2
    full = torch.empty(rows, cols, device="cuda")
    peer = torch.randn(half, cols, device="cuda")  # the rows the peer would have sent
    out = torch.empty(half, cols, device="cuda")

    def today() -> None:
        torch.mm(g.t(), x, out_dtype=torch.float32, out=full)
        copy_kernels.sum_into(out.view(-1), full[:half].reshape(-1), peer.view(-1), True)

    def split() -> None:
        torch.mm(g[:, half:].t(), x, out_dtype=torch.float32, out=full[half:])
        torch.addmm(peer, g[:, :half].t(), x, beta=0.5, alpha=0.5, out_dtype=torch.float32,
                    out=out)  # fmt: skip

    split()
    own = torch.mm(g[:, :half].t(), x, out_dtype=torch.float32)
    return {
        "gemm_and_sum_ms": _ms(today),
        "split_gemms_ms": _ms(split),
        "bit_equal": torch.equal(out, (own + peer) * 0.5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "bandwidth": bandwidth(),
        "epilogue_sum": {f"{r}x{c}": epilogue_sum(r, c) for r, c in SHAPES},
    }
    for name, r in report["bandwidth"].items():
        print(f"{name:32s} {r['ms']:.3f} ms  {r['GB/s']:.0f} GB/s")
    for shape, r in report["epilogue_sum"].items():
        print(f"W {shape:11s} GEMM + sum {r['gemm_and_sum_ms']:.3f} ms, split GEMMs "
              f"{r['split_gemms_ms']:.3f} ms, bit-equal {r['bit_equal']}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "copy_kernels_bw.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
