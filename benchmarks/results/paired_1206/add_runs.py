"""Append this call's paired_steps runs (eager_a, eager_b: not predicted first) to
benchmarks/calibration/h100.json as held-out runs of `gtp-plan validate` (issue 26). Runs
already stored are left alone.

    python benchmarks/results/paired_1206/add_runs.py
"""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))

from stored_runs import add, phases_runs  # noqa: E402

runs = [r for path in sorted(HERE.glob("eager_*.json")) for r in phases_runs(path)]
add(HERE.parents[1] / "calibration" / "h100.json", runs)
