"""Predictions of the step_phases.py runs of gpu.sh beside it, written before they run (issue 26:
predict each run before making it): `gtp-plan validate`'s prediction of each from the GPU's
calibration: on an H100 the one the same call has just made and built into
benchmarks/calibration/h100.json (scripts/h100_from_calibrate.py), on an H200 the committed
h200.json. Once the runs are stored they carry their host probe, which validate scales their
host time by; these rows are made without one (the calibration's host).

    python benchmarks/results/h100_1206/predict_first.py CLUSTER OUT.json   # refuses to overwrite

OUT records the time, the commit and the calibration's SHA-256 it was made from.
"""

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from gtp_wrap.scaling.cluster import CHECKOUT_DIR, load_cluster
from gtp_wrap.scaling.validate import predicted_ms

# (model, batch, mesh, faked): the methods gpu.sh's step_phases runs measure.
PLAN = {
    ("gpt_125m", 1, "", False): ("floor", "gtp_blocks", "gtp", "fsdp2"),
    ("gpt_125m", 8, "", False): ("floor", "gtp_blocks", "gtp"),
    ("gpt_1p36b", 4, "", False): ("floor", "gtp_blocks"),
    ("gpt_125m", 1, "gtp=2", True): ("floor", "gtp_blocks", "gtp", "fsdp2"),
}

name, out = sys.argv[1], Path(sys.argv[2])
if out.exists():
    raise SystemExit(f"{out} exists: predictions are made once, before the run")
calibration = CHECKOUT_DIR / f"{name}.json"
cluster = load_cluster(str(calibration))
made = {
    "cluster": name,
    "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=CHECKOUT_DIR).stdout.strip(),
    "calibration_sha256": hashlib.sha256(calibration.read_bytes()).hexdigest(),
}  # fmt: skip
rows = []
for (model, batch, mesh, faked), methods in PLAN.items():
    for method in methods:
        run = {"model": model, "batch": batch, "seq": 2048, "mesh": mesh, "method": method,
               **({"comm": "faked"} if faked else {})}  # fmt: skip
        rows.append(dict(run, predicted_ms=round(predicted_ms(cluster, run), 2)))
out.write_text(json.dumps({**made, "rows": rows}, indent=1) + "\n")
for r in rows:
    print(
        f"{r['model']:10} b{r['batch']} {r['mesh'] or 'world 1':7} {r['method']:10} "
        f"{r['predicted_ms']:8.2f} ms"
    )
