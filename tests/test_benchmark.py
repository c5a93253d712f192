"""The side-by-side benchmark's CPU smoke mode runs every method and writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/bench_step.py"),
        "--smoke",
        "--methods",
        *["floor", "ddp", "fsdp2", "gtp", "gtp_fp8", "gtp_fp8_gemm"],
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    methods = ["floor", "ddp", "fsdp2", "gtp", "gtp_fp8", "gtp_fp8_gemm"]
    assert [r["method"] for r in rows] == methods
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["blocking_by_pass"] == {"forward": 2, "backward": 2} for r in rows[3:])
    assert (tmp_path / "bench.png").stat().st_size > 5_000
    assert "GTP/FSDP2" in proc.stdout
