"""Measured steps as the runs a calibration JSON stores for `gtp-plan validate` (issue 26): read
from benchmarks/step_phases.py's JSON, and appended to a cluster's JSON without repeats.

    from stored_runs import add, phases_runs
    add(Path("benchmarks/calibration/h100.json"), phases_runs(Path("phases_w1_125M_b1.json")))

    python benchmarks/stored_runs.py h100 benchmarks/results/paired_1206/eager_*.json

The results folders' add_runs.py scripts use it, one per call that joined a calibration (later
calls, the command line: the cluster's name, then step_phases.py's or paired_steps.py's JSONs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODELS = {"125M": "gpt_125m", "1.36B": "gpt_1p36b"}  # bench_step.py's names, the model's
METHODS = ("floor", "gtp_blocks", "gtp", "fsdp2")  # those the cost model predicts


def phases_runs(path: Path) -> list[dict]:
    """The held-out runs of one step_phases.py JSON, each with the call's host probe: this
    tree's methods the cost model predicts, not a baseline's (`@base`) or those with backward
    on the calling thread (`/1t`); a faked world's marked `"comm": "faked"`. The source names
    the JSON under benchmarks/results/."""
    result = json.loads(path.read_text())
    command, world = result["command"], result["world"]
    return [
        {
            "model": MODELS[command["model"]],
            "batch": int(command["batch"]),
            "seq": int(command["seq"]),
            "mesh": f"gtp={world}" if world > 1 else "",
            "method": method,
            **({"comm": "faked"} if world > 1 else {}),
            "measured_ms": round(ms["step"], 2),
            "host_probe_ms": round(result["host_probe_ms"], 3),
            "source": f"results/{path.parent.name}/{path.name}",
            "calibration": False,
        }
        for method, ms in result["ms"].items()
        if method in METHODS
    ]


def run_key(run: dict) -> tuple:
    """What tells stored runs apart: source, method, model, batch and mesh."""
    return (run["source"], run["method"], str(run["model"]), run["batch"], run.get("mesh", ""))


def with_added(calibration: Path, made: list[dict]) -> list[dict]:
    """`made`, the runs a script builds `calibration` from, and after them the runs of the
    stored `calibration` from any other source: those later calls appended (`add`), which a
    rebuild keeps, held out (the fit is `made`'s)."""
    if not calibration.exists():
        return made
    sources = {r["source"] for r in made}
    stored = json.loads(calibration.read_text())["runs"]
    return made + [dict(r, calibration=False) for r in stored if r["source"] not in sources]


def add(calibration: Path, new: list[dict]) -> None:
    """Append the runs of `new` that `calibration` does not hold yet (by `run_key`)."""
    raw = json.loads(calibration.read_text())
    stored = {run_key(r) for r in raw["runs"]}
    added = [r for r in new if run_key(r) not in stored]
    raw["runs"] += added
    calibration.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"added {len(added)} runs to {calibration}")


if __name__ == "__main__":
    name, *paths = sys.argv[1:]
    add(
        Path(__file__).parent / "calibration" / f"{name}.json",
        [r for path in paths for r in phases_runs(Path(path))],
    )
