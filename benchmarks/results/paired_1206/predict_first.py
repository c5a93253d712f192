"""Predictions of gpu.sh's paired runs from the calibration the same call has just made,
written before the runs start (issue 26: predict each run before making it). Each row is at
the calibration's host speed; once stored, a run carries its own host probe (timed in its
cycles), which `gtp-plan validate` scales its host time by.

    python benchmarks/results/paired_1206/predict_first.py CALIBRATION.json OUT.json [METHODS]

METHODS (comma-separated): predict these for every model and batch of the plan instead.
"""

import datetime
import hashlib
import json
import sys
from pathlib import Path

from gtp_wrap.scaling.cluster import load_cluster
from gtp_wrap.scaling.validate import predicted_ms

# (model, batch): the methods gpu.sh's paired runs measure.
PLAN = {
    ("gpt_125m", 1): ("floor", "gtp_blocks", "gtp", "fsdp2"),
    ("gpt_125m", 8): ("floor", "gtp_blocks", "gtp"),
    ("gpt_1p36b", 1): ("floor", "gtp_blocks"),
}

calibration, out = Path(sys.argv[1]), Path(sys.argv[2])
if len(sys.argv) > 3:
    PLAN = {key: tuple(sys.argv[3].split(",")) for key in PLAN}
if out.exists():
    raise SystemExit(f"{out} exists: predictions are made once, before the runs")
cluster = load_cluster(str(calibration))
rows = [
    {"model": model, "batch": batch, "seq": 2048, "mesh": "", "method": method,
     "predicted_ms": round(predicted_ms(cluster, {"model": model, "batch": batch, "seq": 2048,
                                                  "method": method}), 2)}
    for (model, batch), methods in PLAN.items()
    for method in methods
]  # fmt: skip
made = {
    "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "calibration_sha256": hashlib.sha256(calibration.read_bytes()).hexdigest(),
    "rows": rows,
}
out.write_text(json.dumps(made, indent=1) + "\n")
for r in rows:
    print(f"{r['model']:10} b{r['batch']} {r['method']:10} {r['predicted_ms']:8.2f} ms")
