"""The `gtp-train` app end to end: a run, its outputs, exact resume, configs, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import gtp_wrap
from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.app.train import CONFIG_DIR
from gtp_wrap.config.policy import GTPPolicy, resolve_policy

# CPU ranks on any machine: two of them, whatever GPUs it has.
FAST = ["device=cpu", "trainer.batch=4", "trainer.seq=32", "trainer.eval_every=0",
        "trainer.eval_batches=1"]  # fmt: skip


def _train(*overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gtp_wrap.app.train", *FAST, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_train_end_to_end(tmp_path: Path) -> None:
    proc = _train("trainer.steps=20", "trainer.eval_every=10", f"out_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(tmp_path)
    assert m["world"] == 2 and len(m["history"]["loss"]) == 20
    assert m["history"]["loss"][-1] < m["history"]["loss"][0] - 0.5
    assert m["history"]["val_step"] == [10, 20]
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    sharded = {row["what"]: row["gtp_bytes"] / row["unsharded_bytes"] for row in m["memory"]}
    assert sharded["parameters"] < 0.6 and sharded["optimizer state"] < 0.6
    assert m["stats"]["prefetched_gathers"] > m["stats"]["blocking_gathers"]
    assert "optimizer state" in proc.stdout and "gathers per step" in proc.stdout


def test_resume_is_exact(tmp_path: Path) -> None:
    """A run stopped at step 6 and resumed takes the steps the whole run takes, with
    optimizer=muon (gtp_wrap.optim.Muon on the matrices, each orthogonalized by one owner, AdamW
    on the rest; AdamW's state resumes in tests/test_checkpoint.py), which trains."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    common = ["optimizer=muon", "trainer.steps=12", "checkpoint.every=6", "trainer.warmup=3"]
    assert _train(*common, f"out_dir={whole}").returncode == 0
    losses = _metrics(whole)["history"]["loss"]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    first = _train(*common, "trainer.stop_at=6", f"out_dir={part}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(_metrics(part)["history"]["loss"]) == 6
    resumed = _train(*common, "resume=true", f"out_dir={part}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _metrics(part)["history"]["loss"] == losses


def test_resume_and_init_from_take_the_run_as_changed(tmp_path: Path) -> None:
    """What a user changes when continuing a run: a resume with another model stops with the
    rank's one-line CheckpointError (no traceback); one with another trainer.lr trains at it
    (with a learning rate of 1e-30 the weights stay the checkpoint's: the validation loss is
    the saved step's, to the bit); one on fewer ranks says that its batch changed; and
    init_from=<a checkpoint folder> starts a new run from its weights."""
    run, tiny_lr = tmp_path / "run", ["trainer.lr=1e-30", "trainer.min_lr=1e-30"]
    common = ["trainer.steps=4", "checkpoint.every=2", "trainer.warmup=0"]
    first = _train(*common, "trainer.stop_at=2", f"out_dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    saved_val = _metrics(run)["history"]["val_loss"][-1]
    for name in ("lr", "ranks"):
        shutil.copytree(run, tmp_path / name)

    other = _train(*common, "resume=true", "model.ffn=96", f"out_dir={run}")
    assert other.returncode == 1
    # The first rank to stop prints its error; the launcher then ends the others.
    assert re.search(r"rank [01]: CheckpointError: ", other.stderr), other.stderr[-2000:]
    assert "Traceback" not in other.stderr
    assert "out_dir=<another directory>" in other.stderr, other.stderr[-2000:]

    lr = _train(*common, *tiny_lr, "resume=true", f"out_dir={tmp_path / 'lr'}")
    assert lr.returncode == 0, lr.stderr[-3000:]
    assert "peak learning rate(s) [1e-30] differ from the checkpoint's" in lr.stdout
    assert _metrics(tmp_path / "lr")["history"]["val_loss"][-1] == saved_val

    fewer = _train(*common, "resume=true", "nproc=1", f"out_dir={tmp_path / 'ranks'}")
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "resumed on 1 data rank(s), where step_000002 was saved on 2" in fewer.stdout

    init = _train("trainer.steps=1", *tiny_lr, f"init_from={run / 'checkpoints'}",
                  f"out_dir={tmp_path / 'init'}")  # fmt: skip
    assert init.returncode == 0, init.stderr[-3000:]
    assert _metrics(tmp_path / "init")["history"]["val_loss"] == [saved_val]


def test_per_block_training_matches_per_use_eager(tmp_path: Path) -> None:
    """The default trainer.gather_per_block=true (every block on its gathered weights) gives
    per-use eager's losses, and so does per-use eager with trainer.backward_on_calling_thread
    (autograd's device thread off; on these CPU ranks backward runs on the calling thread
    either way, as metrics.json says, so this checks that the setting changes nothing else).
    trainer.compile=true is checked on the MoE below, where each compiled block also takes over
    the policy's MoE layer."""
    common = ["trainer.steps=4", "trainer.warmup=2"]
    eager = ["trainer.gather_per_block=false"]
    runs = {
        "eager": eager,
        "per_block": [],
        "calling_thread": [*eager, "trainer.backward_on_calling_thread=true"],
    }
    for name, overrides in runs.items():
        proc = _train(*common, *overrides, f"out_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = {name: _metrics(tmp_path / name) for name in runs}
    want = metrics["eager"]["history"]["loss"]
    assert len(want) == 4
    assert metrics["per_block"]["history"]["loss"] == pytest.approx(want, rel=1e-5)
    assert metrics["calling_thread"]["history"]["loss"] == want
    assert metrics["eager"]["backward_thread"] == "calling"  # a CPU has no device thread
    assert metrics["calling_thread"]["backward_thread"] == "calling"


def test_blocks_left_whole_by_the_policy_still_run_per_block_and_compiled(tmp_path: Path) -> None:
    """policy=replicate_all shards nothing, so no block holds a sharded weight: the default
    trainer.gather_per_block=true and trainer.compile=true still run (the blocks named by the
    app, not found by their sharded weights) and give per-use eager's losses."""
    common = ["policy=replicate_all", "trainer.steps=3", "trainer.warmup=1"]
    runs = {"eager": ["trainer.gather_per_block=false"], "per_block": [],
            "compiled": ["trainer.compile=true"]}  # fmt: skip
    for name, overrides in runs.items():
        proc = _train(*common, *overrides, f"out_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: _metrics(tmp_path / name)["history"]["loss"] for name in runs}
    assert len(losses["eager"]) == 3 and losses["eager"][-1] < losses["eager"][0]
    assert losses["per_block"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)


def test_tensor_parallel_training_matches_gtp_alone(tmp_path: Path) -> None:
    """mesh=[1,1,2] policy=tp (tensor and sequence parallelism in the blocks, GTP over it; two
    ranks, as many as CI's cores allow) takes the steps that one rank alone takes: its two
    ranks are one data rank. The 4- and 8-rank meshes are tests/test_tensor_parallel.py's."""
    common = ["trainer.steps=4", "trainer.warmup=2"]
    alone = _train(*common, "nproc=1", f"out_dir={tmp_path / 'alone'}")
    assert alone.returncode == 0, alone.stderr[-3000:]
    tp = _train(*common, "nproc=2", "mesh=[1,1,2]", "policy=tp", f"out_dir={tmp_path / 'tp'}")
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert "tp S(0)" in (tmp_path / "tp" / "train.log").read_text()  # describe's table
    want = _metrics(tmp_path / "alone")["history"]["loss"]
    got = _metrics(tmp_path / "tp")["history"]["loss"]
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-4)


def test_moe_training_reports_tokens_per_expert(tmp_path: Path) -> None:
    """model=moe_tiny policy=moe: the expert stacks sharded, the routed token slots per expert
    summed over the steps and ranks, shown as a table and kept in metrics.json."""
    proc = _train("model=moe_tiny", "policy=moe", "trainer.steps=3", f"out_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "routed token slots per expert" in log and "max/mean" in log
    assert "blocks.0.mlp.experts.gate_up  8x256x128  shard(1)" in log
    tokens = _metrics(tmp_path)["tokens_per_expert"]
    # 4 blocks x 8 experts; per block: 3 steps x 2 ranks x 4 sequences x 32 tokens x top 2.
    assert len(tokens) == 4 and all(len(row) == 8 for row in tokens)
    assert all(sum(row) == 3 * 2 * 4 * 32 * 2 for row in tokens)
    # Compiled, each transformer block takes over the policy's MoE layer inside it.
    compiled = _train("model=moe_tiny", "policy=moe", "trainer.steps=3", "trainer.compile=true",
                      f"out_dir={tmp_path / 'compiled'}")  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    want = _metrics(tmp_path)["history"]["loss"]
    got = _metrics(tmp_path / "compiled")["history"]["loss"]
    assert got == pytest.approx(want, rel=1e-5)
    # Expert parallelism: each rank keeps 4 of the 8 experts and the tokens go to them.
    ep = _train("model=moe_tiny", "policy=moe", "trainer.steps=3", "expert_mesh=[2,1]",
                f"out_dir={tmp_path / 'ep'}")  # fmt: skip
    assert ep.returncode == 0, ep.stderr[-3000:]
    assert (
        "blocks.0.mlp.experts.gate_up  8x256x128  shard(1)"
        in (tmp_path / "ep" / "train.log").read_text()
    )
    assert _metrics(tmp_path / "ep")["history"]["loss"] == pytest.approx(want, rel=1e-5)


def test_meta_init_and_init_from_train_as_the_whole_model(tmp_path: Path) -> None:
    """model.init=meta takes, bit for bit on CPU, the steps of init_from a file holding the
    whole model's seeded initial weights (tests/test_load_pretrained.py checks the weights it
    loads, tests/test_meta_init.py that a meta wrap builds them)."""
    common = ["trainer.steps=2", "trainer.warmup=1"]
    runs = {"meta": ["model.init=meta"]}
    torch.manual_seed(0)  # trainer's seed: the initial weights of every run above
    same = tmp_path / "same.safetensors"
    gtp_wrap.checkpoint.export_safetensors(same, GPT(GPTConfig(**_tiny())))
    runs |= {"same": [f"init_from={same}"]}
    for name, overrides in runs.items():
        proc = _train(*common, *overrides, f"out_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: _metrics(tmp_path / name)["history"]["loss"] for name in runs}
    assert len(losses["meta"]) == 2 and losses["meta"] == losses["same"]


def _tiny() -> dict:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        model = OmegaConf.to_container(compose("train").model)
    return {k: v for k, v in model.items() if k != "init"}  # type: ignore[union-attr]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("model", _options("model"))
@pytest.mark.parametrize("policy", _options("policy"))
def test_every_config_composes_and_instantiates(policy: str, model: str) -> None:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"policy={policy}", f"model={model}"])
    # The group's file given as a path composes as Hydra composes it.
    assert resolve_policy(f"{CONFIG_DIR}/policy/{policy}.yaml") == resolve_policy(cfg.policy)
    # Every field is a plain override (`policy.check_finite=true`, no `+`) whichever policy.
    assert set(cfg.policy) - {"defaults"} == {f.name for f in dataclasses.fields(GTPPolicy)}
    model = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "init"}
    assert cfg.model.init == "auto"
    with torch.device("meta"):
        gpt = GPT(GPTConfig(**model))
    assert sum(p.numel() for p in gpt.parameters()) == GPTConfig(**model).n_params


BAD_INPUT = [
    ("bogus_option=1", "Could not override 'bogus_option'"),
    ("+policy.min_shard=3", "unknown GTPPolicy field(s) ['min_shard']"),
    ("nproc=4096", "nproc=4096 but this machine has"),
    ("trainer.lr=-1", "trainer.lr=-1: must be a finite number > 0"),
    ("trainer.lr=nan", "trainer.lr=nan: must be a finite number > 0"),
    ("trainer.grad_clip=-0.5", "trainer.grad_clip=-0.5: must be a finite number >= 0"),
    ("trainer.min_lr=1.0", "trainer.min_lr=1.0 exceeds trainer.lr=0.003"),
    ("trainer.warmup=1.5", "trainer.warmup=1.5: must be a whole number >= 0"),
    ("data.path=/no/such/file.txt", "does not exist; give a text file (its bytes are the"),
    ("mesh=[3,1]", "mesh=[3, 1] does not multiply to nproc=2"),
    ("mesh_layout=diagonal", "mesh_layout='diagonal': use gtp_inner or gtp_outer"),
    ("mesh_layout=gtp_outer", "mesh_layout=gtp_outer lays out a mesh of dp and gtp"),
    ("device=tpu", "device='tpu': use auto"),
    ("mesh=[2]", "give two sizes, [dp, gtp]"),
    ("policy=copy_engine", "on CPU ranks use collectives=process_group"),
    ("model.vocab=100", "but model.vocab is 100"),
    ("trainer.accumulation=0", "trainer.accumulation=0: must be a whole number >= 1"),
    ("data.val_fraction=1.5", "data.val_fraction=1.5: must be between 0 and 1"),
    ("trainer.compile=yes", "trainer.compile='yes': must be true or false"),
    ("trainer.gather_per_block=1", "trainer.gather_per_block=1: must be true or false"),
    (
        "trainer.backward_on_calling_thread=on",
        "trainer.backward_on_calling_thread='on': must be true or false",
    ),
    ("mesh=[1,1,3]", "tp=3, but the policy has no tp rules"),
    ("mesh=[1,1,3] policy=tp", "tp=3 does not divide model.heads=4"),
    ("mesh=[1,2,0]", "every size must be a whole number >= 1"),
    ("mesh=[1,1,1,2]", "give two sizes, [dp, gtp], or three, [dp, gtp, tp]"),
    ("expert_mesh=[3,1]", "expert_mesh=[3, 1]: ep x egtp must divide nproc=2"),
    ("expert_mesh=[2]", "expert_mesh=[2]: give two whole numbers >= 1, [ep, egtp]"),
    ("optimizer=muon optimizer.adjust_lr_fn=rms", "optimizer=muon: Muon: adjust_lr_fn='rms'"),
    ("model.init=lazy", "model.init='lazy': use auto, meta or full"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite='ignore': use raise or skip"),
    ("init_from=/no/such.safetensors", "init_from='/no/such.safetensors' does not exist"),
    ("checkpoint.every=-1", "checkpoint.every=-1: must be a whole number >= 0"),
    ("checkpoint.keep=abc", "checkpoint.keep='abc': must be a whole number >= 0"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each bad override's gtp-train run, all in one process (tests/refusals.py), by override:
    its exit status, stderr and out_dir."""
    root = tmp_path_factory.mktemp("refused")
    out_dirs = {o: root / str(i) for i, (o, _) in enumerate(BAD_INPUT)}
    runs = [[*FAST, *o.split(), f"out_dir={out}"] for o, out in out_dirs.items()]
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "refusals.py"), json.dumps(runs)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    return {o: {**run, "out_dir": out} for (o, out), run in zip(out_dirs.items(), got, strict=True)}


@pytest.mark.parametrize(("override", "message"), BAD_INPUT)
def test_bad_input_is_refused_before_training(
    override: str, message: str, refusals: dict[str, dict]
) -> None:
    got = refusals[override]
    assert got["code"] not in (0, None)
    assert message in got["stderr"], got["stderr"][-2000:]
    assert not (got["out_dir"] / "checkpoints").exists()


def test_a_non_finite_step_raises_or_is_skipped(tmp_path: Path) -> None:
    """A learning rate of 1e30 sends the weights to Inf after one step, so the next gradients
    are not finite: by default the run stops with NonFiniteError naming a weight; with
    trainer.on_nonfinite=skip the steps are skipped, logged, and the run ends."""
    common = ["trainer.steps=2", "trainer.warmup=0", "trainer.lr=1e30", "trainer.min_lr=1e30",
              "trainer.grad_clip=0"]  # fmt: skip
    raised = _train(*common, f"out_dir={tmp_path / 'raise'}")
    assert raised.returncode != 0
    assert "NonFiniteError: the gradient of '" in raised.stderr, raised.stderr[-2000:]
    skipped = _train(*common, "trainer.on_nonfinite=skip", f"out_dir={tmp_path / 'skip'}")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    # Rank 0 logs it once; the other rank does not write to train.log (a forked rank
    # drops the logging it inherits, as a spawned one starts without it).
    log = (tmp_path / "skip" / "train.log").read_text()
    assert log.count("step 2 skipped: the gradient of '") == 1, log
