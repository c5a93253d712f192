"""Predictions of the H200 call of blocks_1204/gpu.sh, written before it runs (issue 26: predict
each run before making it). Each row is `gtp-plan validate`'s prediction on the calibration's
host (benchmarks/calibration/h200.json as committed with this file); once the call has run, its
rows carry their host probe and validate scales their host time by it, by the same code.

    python benchmarks/results/blocks_1204/predict_first.py   # writes predicted.json beside it
"""

import json
from pathlib import Path

from gtp_wrap.scaling.cluster import load_cluster
from gtp_wrap.scaling.validate import predicted_ms

HERE = Path(__file__).parent
PLAN = {"gpt_125m": (1, 4, 8), "gpt_1p36b": (1, 8)}
METHODS = ("floor", "gtp", "gtp_blocks", "fsdp2")

cluster = load_cluster("h200")
rows = [
    {
        "model": model,
        "batch": batch,
        "method": method,
        "predicted_ms": round(
            predicted_ms(cluster, {"model": model, "batch": batch, "seq": 2048, "method": method}),
            2,
        ),
    }
    for model, batches in PLAN.items()
    for batch in batches
    for method in METHODS
]
(HERE / "predicted.json").write_text(json.dumps(rows, indent=1) + "\n")
for r in rows:
    print(f"{r['model']:10} b{r['batch']} {r['method']:10} {r['predicted_ms']:8.2f} ms")
