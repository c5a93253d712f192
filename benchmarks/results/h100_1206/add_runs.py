"""Append this directory's 2026-12-06 H100 runs to benchmarks/calibration/h100.json as held-out
runs of `gtp-plan validate` (issue 26), each with the host probe its call timed beside it: the
step_phases.py JSONs, and the 125M batch-8 call whose JSON did not come back, read from the
call's output (gpu_a_output.txt). Runs already stored are left alone.

    python benchmarks/results/h100_1206/add_runs.py
"""

import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))

from stored_runs import METHODS, add, phases_runs  # noqa: E402


def output_runs(path: Path, name: str, model: str, batch: int) -> list[dict]:
    """The world-1 runs of step_phases call `name` as gpu.sh printed them: its table's header
    and step rows, and its host probe."""
    text = path.read_text().split(f"{name} rc=0\n", 1)[1]
    header, step = (line.strip("| ").split(" | ") for line in text.splitlines()[:2])
    probe = float(re.search(r"host_probe_ms ([\d.]+)", text).group(1))  # type: ignore[union-attr]
    return [
        {"model": model, "batch": batch, "seq": 2048, "mesh": "", "method": method,
         "measured_ms": float(ms), "host_probe_ms": probe,
         "source": f"results/{HERE.name}/{path.name} ({name})", "calibration": False}
        for method, ms in zip(header[1:], step[1:])
        if method in METHODS
    ]  # fmt: skip


runs = [r for p in sorted(HERE.glob("phases_*.json")) for r in phases_runs(p)]
runs += output_runs(HERE / "gpu_a_output.txt", "phases_w1_125M_b8", "gpt_125m", 8)
add(HERE.parents[1] / "calibration" / "h100.json", runs)
