"""Predictions of the faked-world calls of gpu.sh beside it (b and c), written before they run
(issue 26: predict each run before making it). Each row is `gtp-plan validate`'s prediction on
the calibration's host (benchmarks/calibration/h200.json as committed with this file), with
the collectives faked (`"comm": "faked"`); once a call has run, its rows carry their host probe
(step_phases.py records it) and validate scales their host time by it, by the same code.

    python benchmarks/results/fake_world_1205/predict_first.py   # writes predicted.json beside it

It refuses to overwrite predicted.json, which records the commit and the calibration it was
made from.
"""

import hashlib
import json
import subprocess
from pathlib import Path

from gtp_wrap.scaling.cluster import CHECKOUT_DIR, load_cluster
from gtp_wrap.scaling.validate import predicted_ms

HERE = Path(__file__).parent
PLAN = {  # (model, batch): the methods its call runs
    ("gpt_125m", 1): ("floor", "gtp_blocks", "gtp", "fsdp2"),
    ("gpt_1p36b", 1): ("floor", "gtp_blocks", "gtp", "fsdp2"),
    ("gpt_125m", 4): ("floor", "gtp_blocks", "fsdp2"),
    ("gpt_125m", 8): ("floor", "gtp_blocks", "fsdp2"),
}

OUT = HERE / "predicted.json"
if OUT.exists():
    raise SystemExit(f"{OUT} exists: predictions are made once, before the run (delete it first)")
cluster = load_cluster("h200")
calibration = CHECKOUT_DIR / "h200.json"
made_by = {
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=HERE).stdout.strip(),
    "calibration_sha256": hashlib.sha256(calibration.read_bytes()).hexdigest(),
}  # fmt: skip
rows = []
for (model, batch), methods in PLAN.items():
    for method in methods:
        run = {"model": model, "batch": batch, "seq": 2048, "mesh": "gtp=2", "method": method,
               "comm": "faked"}  # fmt: skip
        rows.append(dict(run, predicted_ms=round(predicted_ms(cluster, run), 2)))
OUT.write_text(json.dumps({**made_by, "rows": rows}, indent=1) + "\n")
for r in rows:
    print(f"{r['model']:10} b{r['batch']} {r['method']:10} {r['predicted_ms']:8.2f} ms")
