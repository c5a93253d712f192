"""How fast this host launches eager torch work now: a number to store beside a measurement.

An eager step at batch 1 on a GPU is host-bound: it takes as long as the host takes to launch
it. Hosts of one kind ran the same code up to 1.8 x apart (the 125M eager floor read 15.6 to
32.4 ms on H200 hosts), so a host-bound step cannot be predicted without knowing the host's
speed at the time. The probe is a fixed host-bound workload: the forward, loss and backward of
the reference GPT at its smoke shape (d=64, 2 layers, 32 tokens), eager, in the compute dtype
(bf16 on a GPU), whose kernels are too small for the device to be what it waits for. Timed
just before and after a measurement, its ratio to the calibration's own probe says how much
slower this host launched than the calibration's host did; `gtp-plan validate` scales a run's
host time by it (`host_probe_ms` of a run, `host_probe_ms` of the calibration JSON).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from gtp_wrap.app.model import GPT, GPTConfig

SHAPE = GPTConfig(vocab=256, d=64, layers=2, heads=4, ffn=172, max_seq=64)
TOKENS = 32
REPS, STEPS = 5, 10


class HostProbe:
    """The probe's model and batch on `device`, built once; calling it times the workload."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # the caller's own seeding is left as it was
            torch.manual_seed(0)
            with torch.device(device):
                self.model = GPT(SHAPE).to(dtype)
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, SHAPE.vocab, (1, TOKENS + 1), generator=g).to(device)
        self.x, self.y = idx[:, :-1], idx[:, 1:]
        self()  # warm-up: first calls pay for kernel selection and allocation

    def _step(self) -> None:
        loss = F.cross_entropy(self.model(self.x).float().flatten(0, 1), self.y.flatten())
        loss.backward()
        self.model.zero_grad(set_to_none=True)

    def __call__(self) -> float:
        """Milliseconds per step of the workload: the median of `REPS` runs (`run`). A median,
        as bench_step's steps are: a host shared with busy neighbours slows every step it runs,
        and the fastest run would catch the moments the neighbours left it alone."""
        return statistics.median(self.run() for _ in range(REPS))

    def run(self) -> float:
        """Milliseconds per step of one run of `STEPS` steps, the device synchronized around
        it: what paired_steps.py times in each cycle, beside the methods' steps."""
        self._sync()
        began = time.perf_counter()
        for _ in range(STEPS):
            self._step()
        self._sync()
        return (time.perf_counter() - began) / STEPS * 1e3

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
