"""benchmarks/soak.py, short: each kind of fault in a 25-step gtp-train run (CPU, 2 gloo
ranks), which must end bitwise in the state of the uninterrupted reference run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import soak  # noqa: E402
from soak import Fault  # noqa: E402

# At fixed steps, a checkpoint every 5: a nan batch on rank 1 at step 3 (the reference skips it
# too), rank 0 killed in the backward of step 7, rank 1 killed writing checkpoint 10, a full
# disk on rank 0 at checkpoint 15, a flipped byte in rank 1's file of checkpoint 20 (which only
# rank 1 reads: the ranks must agree to fall back), and a changed digit in checkpoint 25's
# meta.json (still valid JSON: only its checksum tells).
FAULTS = [
    Fault(0, "nan", 3, 1, "embedding"),
    Fault(1, "kill_step", 7, 0, "backward"),
    Fault(2, "kill_save", 10, 1, "write"),
    Fault(3, "enospc", 15, 0, "write"),
    Fault(4, "corrupt", 20, 1, "rank1.safetensors"),
    Fault(5, "corrupt", 25, 0, "meta.json"),
]


@pytest.mark.timeout(240)
def test_faults_are_reported_and_the_run_ends_in_the_uninterrupted_state(tmp_path: Path) -> None:
    result = soak.soak(tmp_path, steps=25, every=5, faults=FAULTS, seed=0)
    assert result["problems"] == []  # none lost, each resume from the newest intact, all equal
    assert result["final_diff"] == [] and result["final_match"]
    faults = {f["id"]: f for f in result["faults"]}
    for f in faults.values():
        assert f["detected_by"] in soak.EXPECTED[f["kind"]], f
        assert 0 <= f["detect_s"] < soak.DETECT_LIMIT_S, f
    assert "step 3 skipped: the gradient of 'embed.weight'" in faults[0]["line"]
    assert "process 0 terminated with signal SIGKILL" in faults[1]["line"]
    assert "process 1 terminated with signal SIGKILL" in faults[2]["line"]
    assert "failed on rank(s) [0]" in faults[3]["line"]
    assert "step_000020/rank1.safetensors is corrupted" in faults[4]["line"]
    assert "step_000025/meta.json is corrupted" in faults[5]["line"]
    resumes = [(faults[i]["resumed_from"], faults[i]["steps_lost"]) for i in range(1, 6)]
    assert resumes == [(5, 1), (5, 5), (10, 5), (15, 5), (20, 5)]
    assert (result["restarts"], result["jobs"], result["steps_lost"]) == (5, 6, 21)
    # Published 5 to 25 (20 and 25 again after the fall-backs); each compared once per save.
    assert (result["checkpoints_published"], result["checkpoints_compared"]) == (5, 7)

    # The comparison tells checkpoints apart (weights and optimizer state), and the reference
    # run skipped the nan step as the faulted one did: its loss there is NaN, the others not.
    ref = tmp_path / "reference" / "checkpoints"
    diff = soak.checkpoint_diff(ref / "step_000020", ref / "step_000025")
    for prefix in ("rank0.safetensors:model/", "rank1.safetensors:optim/", "meta.json: extra"):
        assert any(d.startswith(prefix) for d in diff), (prefix, diff)
    losses = json.loads((ref / "step_000025" / "meta.json").read_text())["extra"]["history"]
    assert [math.isnan(x) for x in losses["loss"]] == [s == 3 for s in range(1, 26)]
