"""cold_parts.py's GEMM timings (hot and cold) beside the same shapes' device time in a floor
step (instep_shapes.py), per shape and summed per model and batch.

    python benchmarks/results/gemm_l2_1206/compare_instep.py h100
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
NAMES = {"125M": "gpt_125m", "1.36B": "gpt_1p36b"}

kind = sys.argv[1]
parts = json.loads((HERE / f"{kind}_cold_parts.json").read_text())
instep = json.loads((HERE / f"{kind}_instep.json").read_text())
timed = {(g["model"], g["batch"], g["m"], g["k"], g["n"]): g for g in parts["gemms"]}
sums: dict = defaultdict(lambda: [0.0, 0.0, 0.0])
print(f"{parts['device']}: µs per call | shape (M, K, N) | calls a step | in the step | hot | cold")
for r in instep["gemms"]:
    key = (NAMES[r["model"]], r["batch"], r["m"], r["k"], r["n"])
    g = timed.get(key)
    calls = r["per_step"]
    step_us = r["seconds"] * 1e6
    hot = g["hot_s"] * 1e6 if g else float("nan")
    cold = g["cold_s"] * 1e6 if g else float("nan")
    row = sums[key[:2]]
    row[0] += calls * step_us
    if g:
        row[1] += calls * hot
        row[2] += calls * cold
        shape = f"{key[0]} b{key[1]} | {key[2:]} | {calls:g}"
    print(f"{shape} | {step_us:.1f} | {hot:.1f} | {cold:.1f}")
print("\nms a step | in the step | hot | cold | hot / step")
for (model, batch), (step, hot, cold) in sums.items():
    ms = " | ".join(f"{v / 1e3:.2f}" for v in (step, hot, cold))
    print(f"{model} b{batch} | {ms} | {hot / step:.3f}")
