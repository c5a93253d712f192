"""The H100's 125M batch-1 floor runs against their host probes, and `gtp-plan validate` with
only a fraction f of a run's host time following the probe (RESULTS.md, 2026-12-07).

    python benchmarks/results/decompose_1207/host_scaling.py
"""

import json
from pathlib import Path

from gtp_wrap.scaling import validate
from gtp_wrap.scaling.cluster import load_cluster

CALIBRATION = Path(__file__).parents[2] / "calibration"


def floor_fit() -> None:
    runs = json.loads((CALIBRATION / "h100.json").read_text())["runs"]
    points = sorted(
        (r["host_probe_ms"], r["measured_ms"])
        for r in runs
        if (r["method"], r["batch"], r["model"]) == ("floor", 1, "gpt_125m")
        and not r.get("mesh")
        and r.get("host_probe_ms")
    )
    n = len(points)
    sx, sy = sum(p for p, _ in points), sum(m for _, m in points)
    sxx, sxy = sum(p * p for p, _ in points), sum(p * m for p, m in points)
    b = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - b * sx) / n
    print(f"{n} floor runs: {a:.2f} ms + {b:.2f} x probe")
    for probe, ms in points:
        print(f"  probe {probe:.3f}: {ms} ms, affine {(a + b * probe) / ms - 1:+.1%}, "
              f"proportional {sy / sx * probe / ms - 1:+.1%}")  # fmt: skip


def sweep() -> None:
    proportional = validate.host_slowdown
    for name in ("h100", "h200"):
        cluster = load_cluster(name)
        for f in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):

            def partial(c, run, f=f):
                s = proportional(c, run)
                return 0.0 if s == 0.0 else 1 + f * (s - 1)

            validate.host_slowdown = partial
            held = [c for c in validate.check(cluster) if not c.calibration]
            validate.host_slowdown = proportional
            within = sum(abs(c.error) <= validate.TARGET for c in held)
            print(f"{name} f={f}: {within} of {len(held)} held-out runs within 10 %")


if __name__ == "__main__":
    floor_fit()
    sweep()
