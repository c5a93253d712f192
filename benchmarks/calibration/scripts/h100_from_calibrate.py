"""Write benchmarks/calibration/h100.json from benchmarks/calibrate.py's output on one H100.

    python benchmarks/calibration/scripts/h100_from_calibrate.py CALIBRATED.json [more.json ...]

The first JSON gives every rate calibrate.py measures on one GPU (GEMMs, attention, HBM,
elementwise bytes, per-layer overhead, the host's costs and its probe) and its runs: the plain
model's graphed steps and the host-bound steps the host costs are fitted to (`"fits"`) are the
calibration set, every other run is held out. Later JSONs (other calls on H100s) add all their
runs, held out. h100.json was last built as

    R=benchmarks/results
    python benchmarks/calibration/scripts/h100_from_calibrate.py \
        $R/host_fit_1206/h100_calibrated.json $R/gemm_l2_1206/h100_calibrated_instep.json \
        $R/gemm_l2_1206/h100_calibrated_instep_b.json \
        $R/gemm_l2_1206/h100_calibrated_instep_c.json \
        $R/h100_1206/h100_calibrated_d.json $R/h100_1206/h100_calibrated.json \
        $R/h100_1205/h100_calibrated.json
 What one H100 cannot measure is taken
from benchmarks/calibration/h200.json and says so in its source: the NVLink curves (an HGX H100
has the H200's NVLink 4 and NVSwitch, 900 GB/s per GPU), the GEMM-beside-all-gather contention,
the inter-node links (nominal there too) and the FP8/NVFP4 decode kernels (memory-bound kernels,
timed on an H200 whose HBM is 1.4x faster: an H100 takes longer); FSDP2's host time per block is
the H200 host's fit, scaled by the two hosts' probes (benchmarks/host_probe.py). What
calibrate.py fitted to the first JSON's runs is fitted again to them under the cost model's
current counts (`calibrate.refit`), so the JSONs stay the records of their calls. Runs that
later calls appended to h100.json (results/*/add_runs.py) are kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[1]
CHECKOUT = CALIBRATION.parents[1]
sys.path.insert(0, str(CHECKOUT / "benchmarks"))

from calibrate import refit  # noqa: E402
from stored_runs import with_added  # noqa: E402

BORROWED = "borrowed from h200.json (not measured on an H100): "


def relative(path: Path) -> str:
    """`path` as the runs' sources name files: under benchmarks/ where it is there."""
    try:
        return str(path.resolve().relative_to(CHECKOUT / "benchmarks"))
    except ValueError:
        return path.name


def borrowed(entry: dict | float) -> dict:
    if not isinstance(entry, dict):
        return {"value": entry, "source": BORROWED + "a constant"}
    return {"value": entry["value"], "source": BORROWED + entry["source"]}


def build(calibrated: list[Path]) -> dict:
    raw = json.loads(calibrated[0].read_text())
    refit(raw, "scripts/h100_from_calibrate.py")
    h200 = json.loads((CALIBRATION / "h200.json").read_text())
    if raw["links"]["intra"]["all_gather"]["gbs"] != 1.0:
        raise SystemExit(f"{calibrated[0]}: measured links; this script is for one GPU's JSON")
    raw["name"] = "h100"
    raw["description"] = (
        "NVIDIA H100 SXM (80 GB) nodes of 8 (NVLink 4 / NVSwitch), one 400 Gb/s NIC per GPU. "
        "Compute, HBM and host costs measured on one H100 by benchmarks/calibrate.py; the "
        "links, contention and decode kernels borrowed from h200.json (see each source)"
    )
    raw["gpus_per_node"] = {"value": 8, "source": "nominal: HGX H100 8-GPU node"}
    raw["compute_units_per_node"] = raw["gpus_per_node"]
    raw["links"] = {
        where: {kind: {k: borrowed(v) for k, v in curve.items()} for kind, curve in link.items()}
        for where, link in h200["links"].items()
    }
    for key in ("contention_compute", "contention_comm"):
        raw[key] = borrowed(h200[key])
    for key, value in h200["compute"].items():
        if key.endswith(("_decode_us", "_decode_ns")):
            raw["compute"][key] = borrowed(value)
    scale = raw["host_probe_ms"]["value"] / h200["host_probe_ms"]["value"]
    fsdp2 = h200["host"]["fsdp2_block_us"]
    raw["host"]["fsdp2_block_us"] = {
        "value": round(fsdp2["value"] * scale, 2),
        "source": f"{BORROWED}{fsdp2['source']}, times this host's probe over the H200's "
        f"({scale:.3f})",
    }
    first = relative(calibrated[0])
    runs = [dict(r, source=f"{first} ({r['source']})") for r in raw["runs"]]
    for path in calibrated[1:]:
        for r in json.loads(path.read_text())["runs"]:  # another call's fit is held out here
            runs.append(dict(r, source=f"{relative(path)} ({r['source']})", calibration=False))
    raw["runs"] = with_added(CALIBRATION / "h100.json", runs)
    return raw


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    out = CALIBRATION / "h100.json"
    out.write_text(json.dumps(build([Path(p) for p in sys.argv[1:]]), indent=1) + "\n")
    print(f"wrote {out}")
