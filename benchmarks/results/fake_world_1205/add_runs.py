"""Append this directory's 2026-12-05 H200 runs to benchmarks/calibration/h200.json as held-out
runs of `gtp-plan validate` (issue 26), each with the host probe its call timed beside it:
step_phases.py's faked worlds of two (`"comm": "faked"`) and world-1 calls, and the world-1
bench_step runs of calibrate.py (h200_calibrated.json). Runs already stored are left alone.

    python benchmarks/results/fake_world_1205/add_runs.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))

from stored_runs import add, phases_runs  # noqa: E402


def calibrate_runs(path: Path) -> list[dict]:
    """calibrate.py's world-1 bench_step runs, by model name; none was fitted here."""
    return [
        {**r, "model": r["model"]["name"], "calibration": False,
         "source": f"results/{HERE.name}/{path.name} ({r['source']})"}
        for r in json.loads(path.read_text())["runs"]
        if r["method"] != "plain"
    ]  # fmt: skip


runs = [r for p in sorted(HERE.glob("phases_*.json")) for r in phases_runs(p)]
add(HERE.parents[1] / "calibration" / "h200.json", runs + calibrate_runs(HERE / "h200_calibrated.json"))
