"""Append this directory's world-1 125M batch-1 runs (phases_125M_b1.json: floor, gtp_blocks,
gtp, with the call's host probe) to benchmarks/calibration/h100.json as held-out runs of
`gtp-plan validate` (issue 26). Runs already stored are left alone.

    python benchmarks/results/host_real_1206/add_runs.py
"""

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))

from stored_runs import add, phases_runs  # noqa: E402

add(HERE.parents[1] / "calibration" / "h100.json", phases_runs(HERE / "phases_125M_b1.json"))
