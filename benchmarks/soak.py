"""Soak gtp-train under injected faults: does every fault end in a named error, a resume, and
the state an uninterrupted run reaches?

    python benchmarks/soak.py --steps 500 --every 10 --faults 25 --out benchmarks/results

Runs `gtp-train` (CPU, 2 gloo ranks, its default model cut to 2 layers, batch 2 x 32 tokens) for
`--steps` steps with a checkpoint every `--every`, while faults planned from `--seed` hit chosen
steps, one at a time:
- kill_step: SIGKILL of one rank in the middle of a step (in the forward, the backward, or
  the optimizer step);
- kill_save: SIGKILL of one rank in the middle of a checkpoint save (half of its file written,
  or rank 0 just before the rename that publishes the checkpoint);
- enospc: one rank's checkpoint write fails as on a full disk (OSError ENOSPC, half written);
- corrupt: the job stops at a checkpoint (a preemption) and one byte of one file of that newest
  checkpoint is damaged before the resume (in a JSON file, a digit changed);
- nan: a NaN in one rank's embedded batch at one step, with trainer.on_nonfinite=skip: the step
  is skipped. It belongs to the data, so every run that takes that step (a replay after a
  resume, and the reference) gets it.
After every fault but nan the job is started again with resume=true. Each fault must be reported
by its named error (EXPECTED) in the job's output within DETECT_LIMIT_S; each resume must start
at the newest published checkpoint that is intact; no published checkpoint may be lost (but to
`checkpoint.keep`); every checkpoint the run leaves on disk must equal the reference run's of its
step; and the final weights, optimizer state and RNG states must be bitwise those of an
uninterrupted run of the same seed (with the same nan steps). Prints and writes to soak.json:
faults by kind, restarts, steps lost per fault, time to detect each, whether the state matched.

The faults are injected inside the job without touching gtp_wrap: each job runs
`python benchmarks/soak.py worker PLAN <gtp-train overrides>`, gtp-train's own `main()` (its
Hydra config, its launcher), with the launcher handed a rank entry that installs the plan's
hooks in each spawned rank before it calls gtp-train's `train`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save
from torch.optim.optimizer import register_optimizer_step_post_hook

from gtp_wrap.app import train
from gtp_wrap.app.data import TokenStream
from gtp_wrap.app.model import GPT
from gtp_wrap.io import checkpoint

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("kill_step", "kill_save", "enospc", "corrupt", "nan")
DETECT_LIMIT_S = 30.0
# A job that outlives its injected fault by this long (or, resuming past a damaged checkpoint,
# does not report it this long after it started) is killed and the fault counted undetected.
HANG_S = 2 * DETECT_LIMIT_S
WORLD = 2
CHECKPOINT_FILES = ("meta.json", "rank0.json", "rank1.json", "rank0.safetensors",
                    "rank1.safetensors")  # fmt: skip
# What may report each kind of fault in the job's output (stdout and stderr together): patterns
# whose group `name` is the reporting error's name (EXPECTED lists them). A killed rank ends the job
# through torch.multiprocessing, which terminates the surviving rank at once and raises
# ProcessExitedException naming the killed one; should the survivor fail first, its own error
# is reported instead (blaming its peer, or the save no rank finished). A nan is no error with
# on_nonfinite=skip: the step is skipped with a warning naming the weight.
_KILLED = r"(?P<name>ProcessExitedException): process (?P<rank>\d+) terminated with signal SIGKILL"
_SURVIVOR = (
    r"(?P<name>PeerLostError|CollectiveTimeoutError|PeerFailedError|CheckpointError): "
    r".*(closed its connection|rank \d+ failed|not every rank reached)"
)
_DETECTORS: dict[str, list[str]] = {
    "kill_step": [_KILLED, _SURVIVOR],
    "kill_save": [_KILLED, _SURVIVOR],
    # Every rank raises it; the cause (OSError ENOSPC) is in the failing rank's message only.
    "enospc": [r"(?P<name>CheckpointError): saving \S+ failed on rank\(s\) \[(?P<rank>\d+)\]"],
    "corrupt": [r"(?P<name>CheckpointError): (?P<file>\S+) is corrupted"],
    "nan": [r"step (?P<step>\d+) (?P<name>skipped): the gradient of '"],
}
EXPECTED: dict[str, list[str]] = {
    "kill_step": ["ProcessExitedException", "PeerLostError", "CollectiveTimeoutError",
                  "PeerFailedError"],
    "kill_save": ["ProcessExitedException", "PeerLostError", "CollectiveTimeoutError",
                  "PeerFailedError", "CheckpointError"],
    "enospc": ["CheckpointError"],
    "corrupt": ["CheckpointError"],
    "nan": ["skipped"],
}  # fmt: skip
_RESUMED = r"resumed from \S+ \(step (?P<step>\d+)\)"
# The default model cut to 2 layers (its weights still sharded) and a small batch: a 500-step
# soak with 25 restarts takes minutes on 2 CPU cores, most of it the jobs' start-up.
SMALL = ["model.layers=2", "trainer.batch=2", "trainer.seq=32", "trainer.warmup=10",
         "data.max_bytes=1048576"]  # fmt: skip


@dataclasses.dataclass
class Fault:
    """One planned fault. `step` is the 1-based training step it hits: the step being computed
    (kill_step, nan) or the checkpoint being saved (kill_save, enospc) or stopped at (corrupt).
    `phase` is where in it: forward, backward or optimizer (kill_step); write or publish
    (kill_save); write (enospc); the file damaged (corrupt); embedding (nan)."""

    id: int
    kind: str
    step: int
    rank: int
    phase: str

    @property
    def done(self) -> int:
        """The last step the job completed when the fault hit."""
        return self.step - 1 if self.kind == "kill_step" else self.step


def plan_faults(seed: int, steps: int, every: int, count: int) -> list[Fault]:
    """`count` faults, the kinds in turn (each as frequent as the others), at distinct steps
    drawn from `seed`, in step order. Save faults hit checkpoint steps; corrupt ones a checkpoint
    with one before it to fall back to."""
    rng = random.Random(seed)
    saves = list(range(every, steps + 1, every))
    taken: set[int] = set()
    faults = []
    for kind in [KINDS[i % len(KINDS)] for i in range(count)]:
        if kind in ("kill_save", "enospc", "corrupt"):
            pool = [s for s in saves if s not in taken and (kind != "corrupt" or s > every)]
        else:
            pool = [s for s in range(1, steps + 1) if s not in taken]
        if not pool:
            raise ValueError(f"{count} faults do not fit {steps} steps with a save every {every}")
        step = rng.choice(pool)
        taken.add(step)
        phase = {
            "kill_step": lambda: rng.choice(["forward", "backward", "optimizer"]),
            "kill_save": lambda: rng.choice(["write", "publish"]),
            "enospc": lambda: "write",
            "corrupt": lambda: rng.choice(CHECKPOINT_FILES),
            "nan": lambda: "embedding",
        }[kind]()
        if phase == "publish" or phase == "meta.json":  # rank 0's part
            rank = 0
        elif kind == "corrupt":
            rank = int(phase[4])  # rank<r>.*
        else:
            rank = rng.randrange(WORLD)
        faults.append(Fault(0, kind, step, rank, phase))
    faults.sort(key=lambda f: f.step)
    for i, f in enumerate(faults):
        f.id = i
    return faults


# ---- the worker: gtp-train with the plan's hooks in its ranks -------------------------------


def _record(events: str, **fields: Any) -> None:
    """Append one event line: one short O_APPEND write, so the ranks' lines never mix and a
    line written just before a SIGKILL is in the file."""
    line = json.dumps({**fields, "t": time.time()}) + "\n"
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _install(plan: dict[str, Any], rank: int) -> None:
    """Patch this rank's gtp-train for the plan: the armed fault (where it is this rank's) and
    the nan batches; record injections, and the checkpoints published, in the events file."""
    events = plan["events"]
    fault = plan["fault"] if plan["fault"] and plan["fault"]["rank"] == rank else None
    nans = {f["step"]: f["id"] for f in plan["nan"] if f["rank"] == rank}
    current = {"step": 0}  # the training step (1-based) whose batch this rank read last

    def armed(kind: str, phase: str, step: int) -> bool:
        return fault is not None and (fault["kind"], fault["phase"], fault["step"]) == (
            kind,
            phase,
            step,
        )

    def die(where: str) -> None:
        assert fault is not None
        _record(events, event="inject", fault=fault["id"], rank=rank, where=where)
        os.kill(os.getpid(), signal.SIGKILL)

    real_batch = TokenStream.batch

    def batch(
        self: TokenStream, split: str, step: int, rank: int, micro: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "train":
            current["step"] = step + 1
        return real_batch(self, split, step, rank, micro, batch)

    def poison(module: torch.nn.Module, args: tuple) -> tuple | None:
        """The first block's input (the embedded batch) with one NaN, at a nan step."""
        step = current["step"]
        if not module.training or step not in nans:
            return None
        _record(events, event="inject", fault=nans[step], rank=rank, where="embedding")
        nan = torch.zeros_like(args[0])
        nan[0, 0, 0] = float("nan")
        return (args[0] + nan, *args[1:])

    def middle(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        """After the middle block's forward: a kill there, or one in the backward through it."""
        if module.training and armed("kill_step", "forward", current["step"]):
            die("forward")
        if module.training and armed("kill_step", "backward", current["step"]):
            out.register_hook(lambda grad: die("backward"))

    real_forward = GPT.forward
    hooked: set[int] = set()

    def forward(self: GPT, idx: torch.Tensor) -> torch.Tensor:
        if id(self) not in hooked:  # the model's first forward: the hooks on its blocks
            hooked.add(id(self))
            self.blocks[0].register_forward_pre_hook(poison)
            self.blocks[len(self.blocks) // 2].register_forward_hook(middle)
        return real_forward(self, idx)

    def after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A load's own optimizer step (creating the state it fills) comes before any batch.
        if armed("kill_step", "optimizer", current["step"]):
            die("optimizer")

    real_save_file = checkpoint.save_file

    def save_file(
        tensors: dict[str, torch.Tensor],
        filename: str | os.PathLike,
        metadata: dict[str, str] | None = None,
    ) -> None:
        found = re.search(r"step_(\d+)", str(filename))
        step = int(found.group(1)) if found else -1
        if fault is None or not (
            armed("kill_save", "write", step) or armed("enospc", "write", step)
        ):
            real_save_file(tensors, filename, metadata)
            return
        data = save(tensors, metadata)
        with open(filename, "wb") as f:  # half the file, as a full disk or a crash leaves it
            f.write(data[: len(data) // 2])
        if fault["kind"] == "kill_save":
            die("write")
        _record(events, event="inject", fault=fault["id"], rank=rank, where="write")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    real_publish = checkpoint._publish

    def publish(tmp: Path, final: Path) -> None:
        if armed("kill_save", "publish", int(final.name.removeprefix("step_"))):
            die("publish")
        real_publish(tmp, final)

    real_save = checkpoint.save

    def save_checkpoint(path: Any, *args: Any, step: int | None = None, **kwargs: Any) -> Path:
        saved = real_save(path, *args, step=step, **kwargs)
        if rank == 0:  # save returned: the checkpoint is published (recorded once)
            _record(events, event="published", step=step)
        return saved

    TokenStream.batch = batch  # type: ignore[method-assign]
    GPT.forward = forward  # type: ignore[method-assign]
    register_optimizer_step_post_hook(after_optimizer_step)
    checkpoint.save_file = save_file
    checkpoint._publish = publish
    checkpoint.save = save_checkpoint


def _faulty_rank(device: torch.device, plan: dict[str, Any], *args: Any) -> None:
    """A rank of the job: the plan's hooks, then gtp-train's own training loop."""
    _install(plan, dist.get_rank())
    train.train(device, *args)


def worker(plan_file: str, overrides: list[str]) -> None:
    """gtp-train with `overrides` (its command line, Hydra config and launcher), its ranks
    running `_faulty_rank` with the plan in `plan_file`."""
    plan = json.loads(Path(plan_file).read_text())
    real_launch = train.launch

    def launch(fn: Callable, nproc: int, *args: Any, **kwargs: Any) -> None:
        assert fn is train.train
        real_launch(_faulty_rank, nproc, plan, *args, **kwargs)

    train.launch = launch
    sys.argv = ["gtp-train", *overrides]
    train.main()


# ---- the driver -----------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    """One gtp-train invocation: its exit status, its output lines (each with the time it was
    read), the events its ranks recorded, and whether it was killed as hung."""

    rc: int
    lines: list[tuple[float, str]]
    ended: float
    events: list[dict[str, Any]]
    hung: bool

    def resumed_from(self) -> int:
        """The step the job resumed from (0: it started afresh)."""
        for _, line in self.lines:
            if m := re.search(_RESUMED, line):
                return int(m["step"])
        return 0


def _events(path: Path) -> list[dict[str, Any]]:
    """The events recorded in `path`, but a line still being written."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def _run_job(
    work: Path,
    number: int,
    plan: dict[str, Any],
    overrides: list[str],
    timeout: float,
    expect: str | None = None,
) -> Job:
    """Run job `number`, keeping its plan and output under `work`. It is killed as hung when it
    outlives its armed fault's injection by HANG_S, when `expect` (a pattern) is not in its
    output HANG_S after it started, or after `timeout` seconds."""
    for sub in ("plans", "jobs"):
        (work / sub).mkdir(exist_ok=True)
    plan_file = work / "plans" / f"{number:03d}.json"
    plan_file.write_text(json.dumps(plan))
    events = Path(plan["events"])
    seen = len(_events(events))
    armed = plan["fault"]["id"] if plan["fault"] else None
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", str(plan_file), *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    began = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True,  # the job and its ranks: one process group to kill if it hangs
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hung = False
    while proc.poll() is None:
        time.sleep(0.2)
        now = time.time()
        injected = [
            e["t"]
            for e in _events(events)[seen:]
            if armed is not None and e["event"] == "inject" and e["fault"] == armed
        ]
        late = injected and now - min(injected) > HANG_S
        unreported = (
            expect is not None
            and now - began > HANG_S
            and not any(re.search(expect, line) for _, line in list(lines))
        )
        if late or unreported or now - began > timeout:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    with open(work / "jobs" / f"{number:03d}.log", "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.writelines(f"{t - began:8.3f} {line}\n" for t, line in lines)
    assert proc.returncode is not None
    return Job(proc.returncode, lines, time.time(), _events(events)[seen:], hung)


def _complete(root: Path) -> dict[int, Path]:
    """The published checkpoints under `root` by step (gtp_wrap's layout: a step_NNNNNN folder
    with its meta.json)."""
    if not root.is_dir():
        return {}
    found = {}
    for p in root.iterdir():
        if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "meta.json").is_file():
            found[int(m.group(1))] = p
    return found


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equality is bitwise (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def checkpoint_diff(got: Path, want: Path) -> list[str]:
    """How checkpoint `got` differs from `want`: every tensor of every rank file (weights,
    optimizer state, RNG states) bitwise, the optimizer's hyperparameters, the scheduler's
    state, the step and the training-loss history. Empty when they are the same."""
    diffs = []
    for file in sorted(p.name for p in want.glob("rank*.safetensors")):
        if not (got / file).is_file():
            diffs.append(f"{file}: missing")
            continue
        a, b = load_file(str(got / file)), load_file(str(want / file))
        if a.keys() != b.keys():
            diffs.append(f"{file}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
        for key in sorted(a.keys() & b.keys()):
            if a[key].dtype != b[key].dtype or a[key].shape != b[key].shape:
                diffs.append(f"{file}:{key}: {a[key].dtype}{list(a[key].shape)} vs "
                             f"{b[key].dtype}{list(b[key].shape)}")  # fmt: skip
            elif not torch.equal(_bits(a[key]), _bits(b[key])):
                diffs.append(f"{file}:{key}: values differ")
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (got, want))
    # As JSON text: a skipped step's NaN loss equals itself there.
    same = [
        ("optimizer param_groups", ma["param_groups"], mb["param_groups"]),
        ("extra.step", ma["extra"]["step"], mb["extra"]["step"]),
        ("extra.scheduler", ma["extra"]["scheduler"], mb["extra"]["scheduler"]),
        # Validation entries differ where a job stopped early (corrupt), so only training's.
        ("training steps", ma["extra"]["history"]["step"], mb["extra"]["history"]["step"]),
        ("training losses", ma["extra"]["history"]["loss"], mb["extra"]["history"]["loss"]),
    ]
    diffs += [f"meta.json: {what} differ" for what, x, y in same if json.dumps(x) != json.dumps(y)]
    return diffs


def _overrides(
    out_dir: Path, steps: int, every: int, keep: int, seed: int, extra: list[str]
) -> list[str]:
    return [
        "device=cpu", f"nproc={WORLD}", f"seed={seed}", f"trainer.steps={steps}",
        "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.on_nonfinite=skip",
        f"trainer.log_every={every}", f"checkpoint.every={every}", f"checkpoint.keep={keep}",
        *extra, f"out_dir={out_dir}",
    ]  # fmt: skip


class _FaultedRun:
    """The run under faults: its jobs, one per fault (but nan) and one to finish, and the
    checks after each (see the module doc)."""

    def __init__(
        self,
        work: Path,
        faults: list[Fault],
        want: dict[int, Path],
        overrides: list[str],
        keep: int,
        job_timeout: float,
    ) -> None:
        self.work, self.faults, self.want, self.keep = work, faults, want, keep
        self.overrides, self.job_timeout = overrides, job_timeout
        self.root = Path(overrides[-1].removeprefix("out_dir=")) / "checkpoints"
        self.events = str(work / "events.jsonl")
        self.nans = [dataclasses.asdict(f) for f in faults if f.kind == "nan"]
        self.entries = {
            f.id: {
                **dataclasses.asdict(f),
                "expected": EXPECTED[f.kind],
                "detected_by": None,
                "detect_s": None,
                "line": None,
                "restarts": 0,
                "resumed_from": None,
                "steps_lost": 0 if f.kind == "nan" else None,
            }
            for f in faults
        }
        self.problems: list[str] = []
        self.published: set[int] = set()
        self.damaged: set[int] = set()  # checkpoints the driver corrupted, not saved again yet
        self.compared: set[tuple[int, int]] = set()  # (step, its meta.json's st_mtime_ns)
        self.jobs = self.restarts = self.computed = 0

    def run(self, seed: int, steps: int) -> None:
        rng = random.Random(seed + 1)  # the corrupted bytes
        pending = collections.deque(f for f in self.faults if f.kind != "nan")
        after: tuple[Fault, float] | None = None  # the fault (and when) the next job resumes from
        while True:
            fault = pending[0] if pending else None
            corrupt = fault if fault is not None and fault.kind == "corrupt" else None
            overrides = [*self.overrides, *(["resume=true"] if self.jobs else [])]
            if corrupt is not None:  # stopped there, as a preemption would
                overrides.append(f"trainer.stop_at={corrupt.step}")
            plan = {
                "events": self.events,
                "fault": dataclasses.asdict(fault) if fault and not corrupt else None,
                "nan": self.nans,
            }
            expect = _DETECTORS["corrupt"][0] if after and after[0].kind == "corrupt" else None
            job = _run_job(self.work, self.jobs + 1, plan, overrides, self.job_timeout, expect)
            self.jobs += 1
            start = job.resumed_from()
            if after is not None:
                self._resumed(job, *after)
            self._note(job)
            log = f"jobs/{self.jobs:03d}.log"
            if fault is None:
                if job.rc != 0:
                    self.problems.append(f"job {self.jobs} (no fault) failed: {log}")
                self.computed += steps - start
                return
            entry = self.entries[fault.id]
            if corrupt is not None:
                if job.rc != 0:
                    self.problems.append(f"job {self.jobs} (stop_at) failed: {log}")
                    return
                damaged = self.root / f"step_{fault.step:06d}"
                entry["file"] = _corrupt(damaged / fault.phase, rng)
                self.damaged.add(fault.step)
                after = fault, time.time()
            else:
                injected = [e["t"] for e in job.events if e["event"] == "inject"]
                if not injected or job.rc == 0:
                    self.problems.append(
                        f"fault {fault.id} ({fault.kind} at step {fault.step}) "
                        + ("did not fire" if not injected else "did not stop the job")
                    )
                    return
                _detected(entry, job, fault, min(injected))
                after = fault, min(injected)
            self.computed += fault.done - start
            entry["restarts"] = 1
            self.restarts += 1
            pending.popleft()

    def _resumed(self, job: Job, fault: Fault, injected: float) -> None:
        """Check the job that restarted after `fault`: it resumed from the newest intact
        published checkpoint (and, after a corruption, reported it)."""
        entry = self.entries[fault.id]
        entry["resumed_from"] = job.resumed_from()
        entry["steps_lost"] = fault.done - entry["resumed_from"]
        if fault.kind == "corrupt":
            _detected(entry, job, fault, injected)
        newest = max(self.published - self.damaged, default=0)
        if entry["resumed_from"] != newest:
            self.problems.append(
                f"job {self.jobs} resumed from step {entry['resumed_from']}, after fault "
                f"{fault.id}; the newest intact published checkpoint is step {newest}"
            )

    def _note(self, job: Job) -> None:
        """After a job: its publications and nan reports; no published checkpoint lost; each
        checkpoint on disk (not damaged on purpose) the reference's of its step."""
        for e in job.events:
            if e["event"] == "published":
                self.published.add(e["step"])
                self.damaged.discard(e["step"])
            elif self.entries[e["fault"]]["kind"] == "nan":
                entry = self.entries[e["fault"]]
                if entry["detected_by"] is None:  # its first occurrence
                    _detected(entry, job, self.faults[e["fault"]], e["t"])
        on_disk = _complete(self.root)
        for step in sorted(self.published)[-self.keep :]:  # older ones are pruned
            if step not in on_disk:
                self.problems.append(f"published checkpoint step {step} lost by job {self.jobs}")
        for step, path in sorted(on_disk.items()):
            key = (step, (path / "meta.json").stat().st_mtime_ns)
            if step in self.damaged or key in self.compared:
                continue
            self.compared.add(key)
            if step not in self.want:
                self.problems.append(f"checkpoint step {step}: the reference has none")
            elif diff := checkpoint_diff(path, self.want[step]):
                self.problems.append(f"checkpoint step {step} is not the reference's: {diff[:5]}")


def _corrupt(file: Path, rng: random.Random) -> dict[str, Any]:
    """Damage one byte of `file`, drawn from `rng`: in a JSON file one digit turned into another
    (mostly still valid JSON, read silently wrong but for a checksum), elsewhere any byte
    XORed with a nonzero mask."""
    data = bytearray(file.read_bytes())
    if file.suffix == ".json":
        offset = rng.choice([i for i, b in enumerate(data) if chr(b).isdigit()])
        data[offset] = ord(rng.choice([d for d in "0123456789" if ord(d) != data[offset]]))
    else:
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randrange(1, 256)
    file.write_bytes(bytes(data))
    return {"file": f"{file.parent.name}/{file.name}", "offset": offset, "size": len(data)}


def _detected(entry: dict[str, Any], job: Job, fault: Fault, injected: float) -> None:
    """Fill in the named error that reported `fault` (injected at time `injected`) in `job`'s
    output, and how long after the injection it was read."""
    damaged = entry.get("file", {}).get("file", "")

    def right(m: re.Match[str]) -> bool:
        groups = {k: v for k, v in m.groupdict().items() if v is not None}
        return (
            ("rank" not in groups or int(groups["rank"]) == fault.rank)
            and ("step" not in groups or int(groups["step"]) == fault.step)
            and ("file" not in groups or groups["file"].endswith(damaged))
        )

    for t, line in job.lines:
        hits = [m for p in _DETECTORS[fault.kind] if (m := re.search(p, line)) and right(m)]
        if t >= injected - 1.0 and hits:
            entry["detected_by"] = hits[0]["name"]
            entry["detect_s"] = round(max(0.0, t - injected), 3)
            entry["line"] = line[hits[0].start() : hits[0].start() + 240]
            return
    entry["detected_by"] = "hang" if job.hung else "unrecognized"
    entry["detect_s"] = round(job.ended - injected, 3)


def soak(
    work: Path,
    steps: int,
    every: int,
    faults: list[Fault],
    seed: int = 0,
    keep: int = 2,
    extra: list[str] | None = None,
    job_timeout: float = 900.0,
) -> dict[str, Any]:
    """Run the reference and the faulted run under `work`, check them, and return the report
    (see the module doc). `extra`: gtp-train overrides of the model and batch (default SMALL)."""
    if keep < 2:
        raise ValueError(f"keep={keep}: a damaged newest checkpoint needs one before it (>= 2)")
    extra = SMALL if extra is None else extra
    nans = [dataclasses.asdict(f) for f in faults if f.kind == "nan"]
    began = time.time()
    # The reference keeps every checkpoint, so that each of the faulted run's is checked.
    reference = _overrides(work / "reference", steps, every, 0, seed, extra)
    plan = {"events": str(work / "reference-events.jsonl"), "fault": None, "nan": nans}
    if _run_job(work, 0, plan, reference, job_timeout).rc != 0:
        raise RuntimeError(f"the reference run failed: {work}/jobs/000.log")
    reference_s = time.time() - began
    want = _complete(work / "reference" / "checkpoints")

    began = time.time()
    overrides = _overrides(work / "run", steps, every, keep, seed, extra)
    run = _FaultedRun(work, faults, want, overrides, keep, job_timeout)
    run.run(seed, steps)
    soak_s = time.time() - began

    final = _complete(run.root).get(steps)
    final_diff = checkpoint_diff(final, want[steps]) if final else ["no last step's checkpoint"]
    entries = list(run.entries.values())
    for e in entries:
        if e["detected_by"] not in e["expected"]:
            run.problems.append(f"fault {e['id']} ({e['kind']} at step {e['step']}) reported as "
                                f"{e['detected_by']}, not {e['expected']}")  # fmt: skip
        elif e["detect_s"] > DETECT_LIMIT_S:
            run.problems.append(f"fault {e['id']} took {e['detect_s']}s to be reported")
    by_kind = {}
    for kind in KINDS:
        mine = [e for e in entries if e["kind"] == kind]
        times = [e["detect_s"] for e in mine if e["detect_s"] is not None]
        if mine:
            by_kind[kind] = {
                "injected": len(mine),
                "detected": sum(e["detected_by"] in e["expected"] for e in mine),
                "detect_s_max": max(times, default=None),
                "detect_s_mean": round(sum(times) / len(times), 3) if times else None,
                "steps_lost": sum(e["steps_lost"] or 0 for e in mine),
            }
    return {
        "steps": steps,
        "every": every,
        "keep": keep,
        "seed": seed,
        "gtp_train_overrides": _overrides(Path("<dir>"), steps, every, keep, seed, extra),
        "faults_injected": len(faults),
        "by_kind": by_kind,
        "faults": entries,
        "jobs": run.jobs,
        "restarts": run.restarts,
        "steps_lost": sum(e["steps_lost"] or 0 for e in entries),
        "steps_computed": run.computed,
        "checkpoints_published": len(run.published),
        "checkpoints_compared": len(run.compared),
        "final_match": not final_diff,
        "final_diff": final_diff,
        "problems": run.problems,
        "ok": not final_diff and not run.problems,
        "reference_s": round(reference_s, 1),
        "soak_s": round(soak_s, 1),
    }


def table(result: dict[str, Any]) -> str:
    """The report's figures as printed."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = [f"{'kind':10} {'injected':>8} {'detected':>8} {'max s':>7} {'mean s':>7} {'lost':>5}"]
    for kind, k in result["by_kind"].items():
        rows.append(f"{kind:10} {k['injected']:8d} {k['detected']:8d} "
                    f"{seconds(k['detect_s_max']):>7} {seconds(k['detect_s_mean']):>7} "
                    f"{k['steps_lost']:5d}")  # fmt: skip
    rows.append(
        f"{result['faults_injected']} faults, {result['restarts']} restarts, "
        f"{result['steps_lost']} steps lost, {result['steps_computed']} steps computed for "
        f"{result['steps']}, {result['checkpoints_compared']} checkpoints compared with the "
        f"reference; final state {'matches' if result['final_match'] else 'DIFFERS'}; "
        f"{result['soak_s']}s (reference {result['reference_s']}s)"
    )
    rows += [f"PROBLEM: {p}" for p in result["problems"]]
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":  # one job of a soak (see _run_job)
        worker(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (at least 2)")
    ap.add_argument("--faults", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help=f"gtp-train overrides (default: {SMALL})")
    args = ap.parse_args()
    faults = plan_faults(args.seed, args.steps, args.every, args.faults)
    with tempfile.TemporaryDirectory(prefix="gtp-soak-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = soak(work, args.steps, args.every, faults, args.seed, args.keep,
                      args.overrides or None)  # fmt: skip
    result["command"] = " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
