"""What a new user of `gtp-train` meets: configs found from anywhere, a policy given as a file,
one directory per run, a train.log, log lines instead of a bar off a terminal, a data directory.

One tiny run (started outside the repository, with a policy file from outside it) serves most
tests; a second and a third invocation of the same command show the refusal and the resume.
"""

from __future__ import annotations

import configparser
import dataclasses
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from gtp_wrap.app.data import DataConfig, DataError, load_tokens
from gtp_wrap.app.launch import LaunchError
from gtp_wrap.app.report import summary_table
from gtp_wrap.app.train import (
    CONFIG_DIR,
    _file_choices,
    _progress_bar,
    _run_suffix,
    log,
    progress,
)

REPO = Path(__file__).resolve().parents[1]
# CPU ranks, a tiny model and batch: 5 steps, stopped at 4 (the resume finishes it).
ARGS = ["device=cpu", "trainer.steps=5", "trainer.stop_at=4", "trainer.batch=4", "trainer.seq=32",
        "trainer.eval_every=2", "trainer.eval_batches=1", "trainer.log_every=2"]  # fmt: skip
# The run directory: the overrides that change what is trained, launch-only keys left out.
RUN_NAME = "gpt_tiny-mine,trainer.batch=4,trainer.seq=32,trainer.steps=5"
MY_POLICY = "defaults: [default, _self_]\nprefetch_depth: 2\n"


def _gtp_train(cwd: Path, *overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gtp_wrap.app.train", *overrides]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@dataclasses.dataclass
class Run:
    cwd: Path
    policy: Path
    proc: subprocess.CompletedProcess
    run_dir: Path
    train_log: str  # as the run left it (the resume test appends to it)
    metrics: dict


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    cwd = tmp_path_factory.mktemp("elsewhere")
    policy = tmp_path_factory.mktemp("my_configs") / "mine.yaml"
    policy.write_text(MY_POLICY)
    proc = _gtp_train(cwd, *ARGS, f"policy={policy}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = cwd / "runs" / RUN_NAME
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return Run(cwd, policy, proc, run_dir, (run_dir / "train.log").read_text(), metrics)


def test_setup_cfg_ships_every_package_and_the_configs() -> None:
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    listed = set(setup["options"]["packages"].split())
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "gtp_wrap").rglob("__init__.py")
    }
    assert listed == found | {"gtp_wrap.configs", "gtp_wrap.scaling.calibration"}
    assert setup["options"]["package_dir"].split() == [
        "gtp_wrap.configs", "=", "configs",
        "gtp_wrap.scaling.calibration", "=", "benchmarks/calibration",
    ]  # fmt: skip
    assert (Path(CONFIG_DIR) / "train.yaml").is_file()
    assert (Path(CONFIG_DIR) / "policy" / "default.yaml").is_file()


def test_runs_from_another_directory_into_its_own_run_dir(first_run: Run) -> None:
    assert first_run.cwd not in REPO.parents and REPO not in first_run.cwd.parents
    assert [p.name for p in (first_run.cwd / "runs").iterdir()] == [RUN_NAME]
    assert first_run.metrics["history"]["step"] == [1, 2, 3, 4]


def test_policy_file_outside_the_repo(first_run: Run) -> None:
    policy = first_run.metrics["config"]["policy"]
    built_in = yaml.safe_load((Path(CONFIG_DIR) / "policy" / "default.yaml").read_text())
    assert policy["prefetch_depth"] == 2  # the file's own value
    assert policy["rules"] == built_in["rules"]  # from the built-in its defaults list names
    assert policy["min_shard_numel"] == built_in["min_shard_numel"]


def test_log_lines_instead_of_a_bar_off_a_terminal(first_run: Run) -> None:
    # stderr is a pipe here: one line per trainer.log_every=2 steps, and no bar.
    steps = re.findall(r"^step (\d+)/5: loss \d+\.\d{3}, [\d,]+ tok/s, \d+ ms/step$",
                       first_run.proc.stdout, re.M)  # fmt: skip
    assert steps == ["2", "4"]
    assert "\r" not in first_run.proc.stderr and "step/s" not in first_run.proc.stderr
    assert "%|" not in first_run.proc.stderr + first_run.proc.stdout


def test_train_log_keeps_the_log(first_run: Run) -> None:
    text, history = first_run.train_log, first_run.metrics["history"]
    for step, value in zip(history["val_step"], history["val_loss"]):
        assert f"[gtp_wrap.app.train][INFO] - step {step}: validation loss {value:.4f}\n" in text
    assert history["val_step"] == [2, 4]
    for step in (2, 4):
        assert f"step {step}/5: loss {history['loss'][step - 1]:.3f}, " in text
    assert "optimizer state" in text and f"run directory: {first_run.run_dir}" in text


def test_fresh_run_refuses_existing_checkpoints_and_resume_finds_them(first_run: Run) -> None:
    ckpts = first_run.run_dir / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir())
    refused = _gtp_train(first_run.cwd, *ARGS, f"policy={first_run.policy}", timeout=90)
    assert refused.returncode == 2
    assert f"{first_run.run_dir} already holds checkpoints" in refused.stderr
    assert "resume=true" in refused.stderr and "out_dir=" in refused.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == before
    # The same overrides with resume=true (and without the stop) land in the same directory.
    args = [a for a in ARGS if not a.startswith("trainer.stop_at")]
    resumed = _gtp_train(first_run.cwd, *args, "resume=true", f"policy={first_run.policy}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [p.name for p in (first_run.cwd / "runs").iterdir()] == [RUN_NAME]
    history = json.loads((first_run.run_dir / "metrics.json").read_text())["history"]
    assert history["step"] == [1, 2, 3, 4, 5]
    assert history["loss"][:4] == first_run.metrics["history"]["loss"]
    assert history["val_step"] == [2, 4, 5]


def _out_dir(*overrides: str) -> str:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return str(cfg.out_dir)


def test_run_dir_names_the_overrides_that_change_training() -> None:
    assert _out_dir() == "runs/gpt_tiny-default"
    launch_only = ["resume=true", "nproc=1", "device=cpu", "mesh=[1,1]", "trainer.stop_at=3",
                   "trainer.log_every=1", "checkpoint.every=5", "checkpoint.keep=1"]  # fmt: skip
    assert _out_dir("trainer.steps=50", *launch_only) == "runs/gpt_tiny-default,trainer.steps=50"
    assert (
        _out_dir("trainer.lr=1e-3", "model=gpt_small", "policy=fp8", "data.path=/d/x.txt")
        == "runs/gpt_small-fp8,data.path=%2Fd%2Fx.txt,trainer.lr=1e-3"
    )
    assert _out_dir("trainer.steps=50", "trainer.lr=0.1") != _out_dir("trainer.steps=50")
    long_a, long_b = (_run_suffix(f"data.path={'d' * 300}{c}") for c in "ab")
    assert len(long_a) == 160 and long_a != long_b and "/" not in long_a


def test_policy_file_choices(tmp_path: Path) -> None:
    search = tmp_path / "search"
    search.mkdir()
    mine = tmp_path / "mine.yaml"
    mine.write_text(MY_POLICY)
    args = _file_choices([f"policy={mine}", "trainer.steps=3", "model=gpt_small"], search)
    assert args == ["policy=mine", "trainer.steps=3", "model=gpt_small",
                    f"hydra.searchpath=['file://{search}']"]  # fmt: skip
    assert (search / "policy" / "mine.yaml").read_text() == MY_POLICY
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=args)
    assert cfg.policy.prefetch_depth == 2 and cfg.policy.rules[0].match == "Linear"
    # A built-in config's own file is its name; nothing is linked.
    assert _file_choices([f"policy={CONFIG_DIR}/policy/fp8.yaml"], search) == ["policy=fp8"]
    clash = tmp_path / "fp8.yaml"
    clash.write_text(MY_POLICY)
    with pytest.raises(LaunchError, match=r"has the name of the built-in .*rename the file"):
        _file_choices([f"policy={clash}"], search)
    with pytest.raises(LaunchError, match=r"no such file; give an existing YAML file"):
        _file_choices([f"model={tmp_path / 'gone.yaml'}"], search)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_leaves_step_lines_to_the_log_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    terminal, console = _Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    caplog.set_level(logging.INFO)
    handlers = [logging.StreamHandler(console), logging.FileHandler(tmp_path / "train.log")]
    root = logging.getLogger()
    for h in handlers:
        root.addHandler(h)
    try:
        with _progress_bar(True, total=3, initial=0) as bar:
            bar.update()
            progress.info("step 1/3: loss 5.000")
            log.info("step 1: validation loss 4.0000")
    finally:
        for h in handlers:
            root.removeHandler(h)
            h.close()
    assert "1/3" in terminal.getvalue() and "%|" in terminal.getvalue()
    assert console.getvalue() == "step 1: validation loss 4.0000\n"
    assert (tmp_path / "train.log").read_text().splitlines() == [
        "step 1/3: loss 5.000",
        "step 1: validation loss 4.0000",
    ]
    assert progress.propagate and not progress.handlers


def test_data_path_directory(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"third")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "b.txt").write_bytes(b"second!")
    tokens = load_tokens(DataConfig(path=str(tmp_path)))
    assert bytes(tokens.astype(np.uint8)) == b"first" + b"third" + b"second!"  # sorted paths
    assert tokens.dtype == np.int64
    cut = load_tokens(DataConfig(path=str(tmp_path), max_bytes=7))
    assert bytes(cut.astype(np.uint8)) == b"firstth"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory with no files in it"):
        load_tokens(DataConfig(path=str(tmp_path / "empty")))
    with pytest.raises(DataError, match="does not exist; give a text file .* a directory of text"):
        load_tokens(DataConfig(path=str(tmp_path / "missing")))


def test_ranks_fork_only_from_a_launcher_without_threads_or_a_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See [Note: forked ranks]: on a Linux machine without CUDA a launcher with one thread and
    no process group forks its ranks; another Python thread, a process group, CUDA or another
    platform makes it spawn them."""
    from gtp_wrap.app import launch

    monkeypatch.setattr(launch.sys, "platform", "linux")
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch.threading, "active_count", lambda: 1)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    assert launch._start_method() == "fork"
    for module, name, value in (
        (launch.threading, "active_count", lambda: 2),
        (launch.dist, "is_initialized", lambda: True),
        (launch.torch.cuda, "is_available", lambda: True),
    ):
        with monkeypatch.context() as m:
            m.setattr(module, name, value)
            assert launch._start_method() == "spawn", name
    monkeypatch.setattr(launch.sys, "platform", "darwin")
    assert launch._start_method() == "spawn"


def test_the_summary_names_the_blocking_gathers_or_says_there_were_none() -> None:
    """A run that gathered nothing (a group of one rank: mesh [2,1], launch.sh with one rank a
    node) says so instead of ending the line at its label."""
    stats = {"gathers": 0, "prefetched_gathers": 0, "blocking_gathers": 0, "blocking_by_pass": {},
             "bytes_gathered": 0, "bytes_reduced": 0, "peak_gathered_bytes": 0}  # fmt: skip
    line = "blocking gathers by pass: none (nothing was gathered)"
    assert line in summary_table([], stats, 2).splitlines()
    stats["blocking_by_pass"] = {"backward": 1, "forward": 1}
    assert "blocking gathers by pass: backward pass 1, forward pass 1 (one chain head" in (
        summary_table([], stats, 2)
    )
