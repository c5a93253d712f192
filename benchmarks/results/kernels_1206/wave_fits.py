"""The wave model's GEMM time with and without split-K, fitted to parts.py's GEMM timings (those
above 30 µs: below it the host's launch set them): rate and cost per GEMM in relative least
squares, then the per-shape error and each model-batch step's GEMMs against the timings.

    python benchmarks/results/kernels_1206/wave_fits.py h200_parts.json
"""

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

UNITS, TILE_M, TILE_N = 132, 128, 256  # an H100's or H200's SMs; h200.json's tile


def flops(g: dict, split_k: bool) -> float:
    """FLOPs the SMs spend: whole waves of output tiles; with `split_k`, a GEMM of fewer tiles
    than SMs splits its sum among as many copies of its tiles as fit."""
    tiles = math.ceil(g["m"] / TILE_M) * math.ceil(g["n"] / TILE_N)
    split = max(1, UNITS // tiles) if split_k else 1
    waves = math.ceil(tiles * split / UNITS)
    return 2.0 * waves * UNITS * TILE_M * TILE_N * g["k"] / split


def modelled(gemms: list[dict], split_k: bool, inv_rate: float, overhead: float) -> list[float]:
    return [flops(g, split_k) * inv_rate + overhead for g in gemms]


def main() -> None:
    gemms = json.loads(Path(sys.argv[1]).read_text())["gemms"]
    timed = [g for g in gemms if g["seconds"] > 30e-6]
    for split_k in (False, True):
        rows = [[flops(g, split_k) / g["seconds"], 1 / g["seconds"]] for g in timed]
        (inv_rate, overhead), *_ = np.linalg.lstsq(np.array(rows), np.ones(len(timed)), rcond=None)
        fit = modelled(timed, split_k, inv_rate, overhead)
        errors = np.array([t / g["seconds"] - 1 for t, g in zip(fit, timed)])
        steps: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for g, t in zip(gemms, modelled(gemms, split_k, inv_rate, overhead)):
            step = steps[(g["model"], g["batch"])]
            step[0] += g["per_step"] * g["seconds"]
            step[1] += g["per_step"] * t
        print(
            f"split-K {split_k}: {1 / inv_rate / 1e12:.0f} TFLOP/s, {overhead * 1e6:.1f} µs each, "
            f"{len(timed)} shapes, rms error {np.sqrt(np.mean(errors**2)):.3f}, "
            f"max {np.abs(errors).max():.2f}; a step's GEMMs, model / timed: "
            + ", ".join(f"{m} b{b} {v[1] / v[0]:.2f}" for (m, b), v in steps.items())
        )


if __name__ == "__main__":
    main()
