"""Append this directory's 2026-12-05 H200 runs to benchmarks/calibration/h200.json as held-out
runs of `gtp-plan validate` (issue 26), each with the host probe its call timed beside it:
step_phases.py's faked worlds of two (`"comm": "faked"`) and world-1 calls, and the world-1
bench_step runs of calibrate.py (h200_calibrated.json). Runs already stored are left alone.

    python benchmarks/results/fake_world_1205/add_runs.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
CALIBRATION = HERE.parents[1] / "calibration" / "h200.json"
MODELS = {"125M": "gpt_125m", "1.36B": "gpt_1p36b"}
METHODS = ("floor", "gtp_blocks", "gtp", "fsdp2")  # those the cost model predicts


def phases_runs(path: Path) -> list[dict]:
    """The runs of one step_phases.py JSON: this tree's methods, not a baseline's (`@base`) or
    those with backward on the calling thread (`/1t`)."""
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


def calibrate_runs(path: Path) -> list[dict]:
    """calibrate.py's world-1 bench_step runs, by model name; none was fitted here."""
    return [
        {**r, "model": r["model"]["name"], "calibration": False,
         "source": f"results/fake_world_1205/{path.name} ({r['source']})"}
        for r in json.loads(path.read_text())["runs"]
        if r["method"] != "plain"
    ]  # fmt: skip


def add(calibration: Path, new: list[dict]) -> None:
    """Append the runs of `new` that `calibration` does not hold yet (by source, method,
    model, batch and mesh)."""
    raw = json.loads(calibration.read_text())

    def key(r: dict) -> tuple:
        return (r["source"], r["method"], str(r["model"]), r["batch"], r.get("mesh", ""))

    stored = {key(r) for r in raw["runs"]}
    added = [r for r in new if key(r) not in stored]
    raw["runs"] += added
    calibration.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"added {len(added)} runs to {calibration}")


if __name__ == "__main__":
    runs = [r for p in sorted(HERE.glob("phases_*.json")) for r in phases_runs(p)]
    add(CALIBRATION, runs + calibrate_runs(HERE / "h200_calibrated.json"))
