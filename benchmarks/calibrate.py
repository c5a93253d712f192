"""Measure a calibration JSON for the cost model (`gtp-plan`) on this machine, in one bounded run.

    python benchmarks/calibrate.py --out benchmarks/calibration/cpu_gloo.json     # CPU, gloo
    python benchmarks/calibrate.py --out h200_measured.json --model gpt_1p36b      # on a GPU

What it measures, each with a source line in the JSON:
- compute, in this process (world 1): GEMMs at the model's shapes (forward, input and weight
  gradients at each batch's token count; rate and per-GEMM cost fitted with the wave model)
  and attention (SDPA forward and backward; on a GPU its rate and fixed time per layer), on a
  GPU both timed inside the plain model's steps (see [Note: kernels timed in the step]), on a
  CPU each alone; the optimizer's memory rate (AdamW over a flat
  buffer, 28 bytes per element), and the plain model's forward and backward at two batches,
  whose time beyond GEMMs, attention and loss gives the elementwise bytes per token (slope) and
  the fixed cost per layer (intercept: host time on a CPU; on a GPU small kernels, fitted to
  steps captured in a CUDA graph, so that the host's launches are not in them: the eager
  steps are kept as held-out runs);
- host: on a GPU, the host's time per layer and per block on gathered weights, fitted to the
  125M model's floor and gtp_blocks steps at batch 1, which the host sets, taking turns with
  the host probe (see [Note: the host's time, fitted to host-bound steps]); GTP's time per
  weight use at world 1 (16 small Linears wrapped and not, as benchmarks/host_overhead.py),
  and at world 2: on gloo the rank's own CPU time, which leaves out its waits for the peer
  (the model's collectives take those); on 2+ GPUs on NCCL's ranks, on one GPU in a faked
  world of two (fake_world.py: collectives issued and waited for, moving nothing, without
  NCCL's own launch cost);
- collectives (gloo on CPU for worlds 2 and 4, NCCL for 2 up to all GPUs): flat all-gathers
  and reduce-scatters of several sizes, fitted to α + (n-2)·hop + (n-1)/n·bytes/GB/s; and the
  contention: a GEMM loop alone and beside an all-gather loop, each slowed by the other;
- unless `--no-steps`, training steps of the model at each world and batch, stored as
  held-out runs for `gtp-plan validate`: GTP's on CPU, per use and with its blocks on gathered
  weights (gtp_blocks); bench_step's floor, floor_graph, gtp, gtp_graph and gtp_blocks on GPUs.
  On a CPU the world-1 gtp_blocks step at the smallest batch fits the host time per block
  (`host.block_us`) and is marked a calibration run.

`--refit CALIBRATION.json` measures nothing: it fits the GEMM rate and cost per GEMM (to the
GEMM timings it stores), attention's rate and fixed time (to a GPU's attention timings), the
elementwise bytes, the fixed cost per layer and the host's (`host.layer_us` where a GPU's
host-bound steps fitted it, `host.block_us`) again to what the JSON stores,
after a change to the cost model's counts.

Bound: `--budget-s` (default 280) is checked between parts; whatever would overrun is left
out and said so. On a GPU machine: `PYTHONPATH=. timeout 300 python benchmarks/calibrate.py
--model gpt_1p36b --batches 1 8 --out /tmp/h200.json` (NCCL parts need 2+ GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_world  # noqa: E402
from trace_events import is_attention  # noqa: E402

from gtp_wrap import GTPWrap, gather_per_block  # noqa: E402
from gtp_wrap.app.launch import launch  # noqa: E402
from gtp_wrap.app.model import GPT, GPTConfig  # noqa: E402
from gtp_wrap.scaling.cluster import cluster_from_dict  # noqa: E402
from gtp_wrap.scaling.mesh import Mesh  # noqa: E402
from gtp_wrap.scaling.model import MODELS, ModelConfig  # noqa: E402
from gtp_wrap.scaling.predict import (  # noqa: E402
    ATTENTION_BACKWARD,
    Plan,
    attention_layer_s,
    gemm_s,
    loss_bytes,
    pass_order,
    weight_gemms_s,
)
from gtp_wrap.scaling.validate import predicted_ms, run_model  # noqa: E402

# The CPU validation model: configs/model/gpt_small's shapes.
CPU_MODEL = ModelConfig(
    "cpu_small",
    vocab=256,
    d=256,
    layers=6,
    heads=8,
    ffn=688,
    seq=256,
    tie_embeddings=True,
    note="configs/model/gpt_small shapes",
)
SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 22)  # elements per collective buffer


class Budget:
    """Seconds left of the run; parts ask before they start."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    def allows(self, part: str, needs_s: float) -> bool:
        if time.monotonic() + needs_s > self.end:
            self.skipped.append(part)
            print(f"calibrate: skipping {part} (the budget would run out)", flush=True)
            return False
        return True


def src(value: float, source: str) -> dict:
    return {"value": float(f"{float(value):.6g}"), "source": source}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object],
    device: torch.device,
    reps: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Fastest seconds of `fn` over `reps` calls after `warmup`, by `clock` (wall time by
    default): on a shared machine the slower calls measure the neighbours (as
    host_overhead.py keeps its fastest round)."""
    times = []
    for i in range(warmup + reps):
        _sync(device)
        t = clock()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(clock() - t)
    return min(times)


def timed_probed(
    fn: Callable[[], object], probe: Callable[[], object], device: torch.device, reps: int
) -> tuple[float, float]:
    """(fastest `fn`, fastest `probe`), each rep a probe then `fn`: on a shared machine both
    minima come from the window's quietest moments, so the probe against the calibration's
    says how much slower the ranks computed while `fn` was timed."""
    fn()
    fns, probes = [], []
    for _ in range(reps):
        probes.append(timed(probe, device, 1, 0))
        fns.append(timed(fn, device, 1, 0))
    return min(fns), min(probes)


def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients minimizing |rows·c - ys| (normal equations; a few unknowns)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    for i in range(k):  # Gauss-Jordan with partial pivoting
        p = max(range(i, k), key=lambda r: abs(a[r][i]))
        a[i], a[p], b[i], b[p] = a[p], a[i], b[p], b[i]
        for r in range(k):
            if r != i and a[i][i]:
                f = a[r][i] / a[i][i]
                a[r] = [x - f * y for x, y in zip(a[r], a[i])]
                b[r] -= f * b[i]
    return [b[i] / a[i][i] for i in range(k)]


def nonneg_least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a coefficient the fit drives negative (noise
    on a shared machine) is fixed at 0 and the rest refitted."""
    free = list(range(len(rows[0])))
    while True:
        coef = least_squares([[r[i] for i in free] for r in rows], ys)
        if min(coef) >= 0 or len(free) == 1:
            out = [0.0] * len(rows[0])
            for i, c in zip(free, coef):
                out[i] = max(0.0, c)
            return out
        free.pop(coef.index(min(coef)))


def gpt_config(model: ModelConfig) -> GPTConfig:
    if model.experts or (model.kv_heads and model.kv_heads != model.heads):
        sys.exit(
            f"calibrate: {model.name} is not a shape the reference GPT builds; pick a dense "
            "model without grouped-query attention (gpt_125m, gpt_1p36b)"
        )
    return GPTConfig(
        vocab=model.vocab,
        d=model.d,
        layers=model.layers,
        heads=model.heads,
        ffn=model.ffn,
        max_seq=model.seq,
        tie_embeddings=model.tie_embeddings,
    )


def skeleton(device: torch.device, tile: tuple[int, int], units: int) -> dict:
    """A calibration with unit rates: the model's FLOP and tile counts come out in seconds at
    1 TFLOP/s, which the fits below scale."""
    curve = {"alpha_us": 0.0, "gbs": 1.0, "hop_us": 0.0}
    link = {"all_gather": dict(curve), "reduce_scatter": dict(curve)}
    return {
        "name": "skeleton",
        "description": "",
        "nominal": False,
        "gpus_per_node": 1,
        "memory_gib": 0.0,
        "async_host": device.type == "cuda",
        "grouped_collectives": device.type == "cuda",
        "contention_compute": 1.0,
        "contention_comm": 1.0,
        "links": {"intra": link, "inter": link},
        "compute": {
            "gemm_tflops": 1.0,
            "gemm_overhead_us": 0.0,
            "gemm_units": units,
            "gemm_tile_m": tile[0],
            "gemm_tile_n": tile[1],
            "attention_tflops": 1.0,
            "hbm_gbs": 1.0,
            "elementwise_bytes": 0.0,
            "layer_overhead_us": 0.0,
        },
        "host": {
            "layer_us": 0.0,
            "step_us": 0.0,
            "use_us_local": 0.0,
            "use_us": 0.0,
            "graph_step_us": 0.0,
            "block_us": 0.0,
            "fsdp2_block_us": 0.0,
        },
    }


def measure_gemms(
    model: ModelConfig, batches: list[int], device: torch.device, dtype: torch.dtype
) -> list[dict]:
    """Seconds of each of the model's weight GEMM shapes (forward, input gradient, weight
    gradient) at each batch's token count, back to back as in a step: `{m, k, n, seconds}`."""
    shapes = set()
    for batch in batches:
        m = batch * model.seq
        for w, _ in pass_order(model, backward=False):
            if w.kind != "embedding":  # (M, K, N) of forward, input and weight gradients
                shapes |= {(m, w.cols, w.rows), (m, w.rows, w.cols), (w.rows, m, w.cols)}
    samples = []
    for mm, k, n in sorted(shapes):
        a = torch.randn(mm, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda a=a, b=b: a @ b, device, 5)
        samples.append({"m": mm, "k": k, "n": n, "seconds": seconds})
    return samples


def fit_gemms(raw: dict, samples: list[dict]) -> tuple[float, float]:
    """(TFLOP/s, µs per GEMM) fitted to GEMM timings with the wave model's FLOPs, in relative
    errors, so that small and large GEMMs weigh alike."""
    # At 1 TFLOP/s and no cost per GEMM the wave model's seconds are its TFLOPs.
    compute = dict(raw["compute"], gemm_tflops=1.0, gemm_overhead_us=0.0)
    unit = cluster_from_dict(dict(raw, compute=compute), "the GEMM fit")
    rows = [[gemm_s(unit, g["m"], g["n"], g["k"]) / g["seconds"], 1.0 / g["seconds"]]
            for g in samples]  # fmt: skip
    inv_rate, overhead = nonneg_least_squares(rows, [1.0] * len(samples))
    return 1 / inv_rate, overhead * 1e6


def measure_attention(model: ModelConfig, device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of SDPA forward and backward, in the FLOPs ModelConfig counts (on a CPU, where
    a call is not launch-bound; a GPU's is timed in its steps, `measure_step_kernels`)."""
    hd = model.d // model.heads
    q, k, v = (
        torch.randn(1, model.heads, model.seq, hd, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = timed(step, device, 5)
    flops = model.seq * model.attention_flops_per_token() * (1 + ATTENTION_BACKWARD)
    return flops / seconds / 1e12


_MATMULS = ("aten::mm", "aten::addmm")
_PROFILED_STEPS = 2


def step_kernels(step: Callable[[], object], device: torch.device) -> tuple[list[dict], float]:
    """(each matmul shape's `{m, k, n, per_step, seconds}`, attention's seconds) of one step, in
    the device time its kernels took inside it: `step` profiled over two calls after three.

    [Note: kernels timed in the step] A GEMM or an attention call timed on its own measures
    something else than the step runs: small ones are set by the host's launch and the sync
    after them (the 125M batch-1 GEMMs read 14-22 µs a call back to back on an H100, 7-15 in
    its step), and larger ones summed 4-14 % slower a step than in it (2026-12-06,
    `benchmarks/results/gemm_l2_1206`: not the L2, whose cold inputs changed nothing). What the
    cost model predicts is the step, so its GEMM and attention rates are fitted to the step's
    own kernels: the profiler's device time per op and input shapes."""
    for _ in range(3):
        step()
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(_PROFILED_STEPS):
            step()
        _sync(device)
    gemms, attention_us = [], 0.0
    cuda = device.type == "cuda"
    if cuda:  # attention's kernels by name: cuDNN's are not tied to the op that ran them
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        attention_us = sum(e.time_range.elapsed_us() for e in kernels if is_attention(e.name))
    for e in prof.key_averages(group_by_input_shape=True):
        # A CPU's ops run on the calling thread: their own time there is their kernels'.
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if not cuda and "scaled_dot_product" in e.key:
            attention_us += us
        elif e.key in _MATMULS and us > 0:
            (m, k), (_, n) = [s for s in e.input_shapes if len(s) == 2][-2:]
            gemms.append({"m": m, "k": k, "n": n, "per_step": e.count / _PROFILED_STEPS,
                          "seconds": us * 1e-6 / e.count})  # fmt: skip
    return gemms, attention_us * 1e-6 / _PROFILED_STEPS


def measure_step_kernels(
    model: ModelConfig, batches: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[list[dict], list[dict]]:
    """(GEMM samples, attention samples) of the plain model's step at each batch, in its own
    kernels (see [Note: kernels timed in the step]): each GEMM shape's seconds per call, with
    its batch and count per step, and `{batch, seconds}` of a step's attention, forward and
    backward, over every layer."""
    gemms, attention = [], []
    for batch in batches:
        net, _, step = _plain_model(model, batch, device, dtype)
        shapes, attention_s = step_kernels(step, device)
        gemms += [{"batch": batch, **g} for g in shapes]
        attention.append({"batch": batch, "seconds": attention_s})
        del net, step  # before the next batch's model is built
        torch.cuda.empty_cache()
    return gemms, attention


def fit_attention(model: ModelConfig, samples: list[dict]) -> tuple[float, float]:
    """(TFLOP/s, fixed µs per layer) of attention's forward and backward, fitted to a step's
    attention at two or more batches: its time grows with the FLOPs ModelConfig counts, from a
    fixed time per layer (the 125M model's heads of 64 took 47 µs a layer beyond their rate on
    H100 and H200, 2026-12-06)."""
    per_layer_flops = model.seq * model.attention_flops_per_token() * (1 + ATTENTION_BACKWARD)
    rows = [[s["batch"] * per_layer_flops * model.layers, model.layers] for s in samples]
    inv_rate, fixed = nonneg_least_squares(rows, [s["seconds"] for s in samples])
    if inv_rate <= 0:
        raise SystemExit(
            f"calibrate: attention did not take longer at larger batches ({samples}): the "
            "device's speed moved under the measurement; run again"
        )
    return 1 / inv_rate / 1e12, fixed * 1e6


def measure_hbm(device: torch.device) -> float:
    """GB/s of AdamW's step over a flat fp32 buffer (28 bytes per element), as the model
    counts the optimizer; fused on a GPU (as bench_step's --fused-adamw), foreach on CPU.

    On a GPU, the slope between 64M and 256M elements: one step also pays the host's launch
    of it and the sync, which the model charges to `host.step_us` (at 64M elements alone an
    H100 read 1884 GB/s while its graphed floor stepped 1.36B elements at 2.6 TB/s: about
    0.28 ms of each 1.0 ms step beyond the kernel's time at that rate). On CPU, one size, 4M
    elements: smaller ones run partly from the caches, faster per byte (20 GB/s at 1M
    elements against 16 at 4M on the development machine), so a slope would read them."""
    if device.type != "cuda":
        n = 1 << 22
        return n * 28 / _adamw_step_s(n, device) / 1e9
    small, large = 1 << 26, 1 << 28
    t_small, t_large = _adamw_step_s(small, device), _adamw_step_s(large, device)
    if t_large <= t_small:
        raise SystemExit(
            f"calibrate: AdamW over {large} elements ({t_large * 1e3:.3f} ms) was not slower "
            f"than over {small} ({t_small * 1e3:.3f} ms): the GPU's load moved under the "
            "measurement; run again"
        )
    return (large - small) * 28 / (t_large - t_small) / 1e9


def _adamw_step_s(n: int, device: torch.device) -> float:
    """Seconds of one AdamW step over `n` fp32 elements (fastest of 10)."""
    p = torch.zeros(n, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], fused=device.type == "cuda" or None)
    return timed(opt.step, device, 10)


def _plain_model(
    model: ModelConfig,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    seq: int | None = None,
) -> tuple[nn.Module, Callable[[], None], Callable[[], None]]:
    """(the plain model, its forward, loss and backward, the same then gradients cleared) at
    `batch` sequences of `seq` tokens (default the model's)."""
    torch.manual_seed(0)
    with torch.device(device):
        net = GPT(gpt_config(model)).to(dtype)
    idx = torch.randint(0, model.vocab, (batch, (seq or model.seq) + 1), device=device)

    def forward_backward() -> None:
        loss = F.cross_entropy(net(idx[:, :-1]).float().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()

    def step() -> None:
        forward_backward()
        for p in net.parameters():
            p.grad = None

    return net, forward_backward, step


def plain_step(
    model: ModelConfig,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    probe: Callable[[], object],
    graphed: bool = False,
    seq: int | None = None,
) -> tuple[float, float]:
    """(seconds, probe seconds) of the plain model's forward, loss and backward (fastest of
    the reps, see `timed_probed`) at `seq` tokens (default the model's); `graphed`: captured
    in one CUDA graph and replayed, so the device's time alone, without the host's."""
    _, forward_backward, step = _plain_model(model, batch, device, dtype, seq)

    if graphed:  # the replays write the gradients the capture allocated, in place
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward_backward()
        return timed_probed(graph.replay, probe, device, 10)
    return timed_probed(step, probe, device, 7 if device.type == "cpu" else 10)


# [Note: the host's time, fitted to host-bound steps] An eager step at batch 1 is host-bound:
# it takes as long as the host takes to launch it. The host's part of the model (its time per
# layer, `host.layer_us`, and per block on gathered weights, `host.block_us`) is fitted to such
# steps, the 125M model's floor and gtp_blocks at batch 1, with the gtp step beside them held
# out, all three taking turns a step at a time with the host probe (paired_steps.py), so that
# the fit and the probe that scales it to other hosts see the host at one speed. Before, the
# time per layer was a slope between the plain model and its half at 32 tokens, timed on its
# own: one H100 host read it at 3200 µs and, two minutes later, 2079 (2026-12-06 06:29 and
# 06:31), and its block time, fitted to the 1.36B step, which the device covers at batch 1,
# read 32 µs where the paired steps say some 500 (RESULTS.md, 2026-12-06).
# The per-use gtp step and FSDP2's fit the host's time per intercepted use at world 1
# (`host.use_us_local`) and per FSDP2 module group at world 1 (`host.fsdp2_block_us_local`:
# there FSDP2 gathers nothing, so its groups at larger worlds keep `fsdp2_block_us`) the same
# way. Before,
# a use's time came from 16 Linear(64, 64) (host_overhead.py's loop) and FSDP2's from
# GPU.md's rough 2 ms, and an H200 call's 125M batch-1 gtp and fsdp2 steps came out 25 and 26 %
# above their predictions (RESULTS.md, 2026-12-06 20:04): a real model's use costs more than a
# tiny Linear's. A use in a sharded group (`host.use_us`, timed at world 2 on the same Linears)
# moves with the world-1 fit by as much: what the group adds, its collectives' launches, is
# what the Linears measured (where `use_us` was timed on them: `USE_LINEARS` in its source).
# The fits run in this order: each step's model takes only the costs fitted before it
# (gtp_blocks' embedding and head are intercepted uses).
HOST_FIT = {  # method: what its step fits, in fitting order
    "floor": "layer_us",
    "gtp": "use_us_local",
    "gtp_blocks": "block_us",
    "fsdp2": "fsdp2_block_us_local",
}
USE_LINEARS = "16 Linear(64, 64)"  # what calibrate.py times a use on (`measure_use_us*`)
MOVED = "; moved with use_us_local's fit, "  # in use_us's source, then how far above it stays
HOST_CYCLES = 60


def measure_host_steps(device: torch.device, here: str) -> tuple[list[dict], float]:
    """(the runs, the host probe's median in their cycles, ms): the 125M model's floor,
    gtp, gtp_blocks and fsdp2 steps at batch 1 taking turns with the host probe, on a GPU (see
    [Note: the host's time, fitted to host-bound steps]), each marked with what it fits
    (`"fits"`). FSDP2 takes a process group: one of this process alone, for these steps."""
    import bench_step  # benchmarks/, beside this script
    from host_probe import HostProbe
    from paired_steps import paired

    methods = list(HOST_FIT)
    alone = not dist.is_initialized()
    if alone:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        measured = paired(device, bench_step.MODELS["125M"], batch=1, seq=2048,
                          methods=methods, cycles=HOST_CYCLES, probe=HostProbe(device))  # fmt: skip
    finally:
        if alone:
            dist.destroy_process_group()
    probe_ms = measured["host_probe_ms"]
    where = f"{here}: paired_steps.py, {HOST_CYCLES} cycles"
    runs = [
        {"model": "gpt_125m", "batch": 1, "seq": 2048, "mesh": "", "method": m,
         "measured_ms": round(measured["ms"][m]["step"], 3), "host_probe_ms": round(probe_ms, 3),
         "source": where, "calibration": False, "fits": HOST_FIT[m]}
        for m in methods
    ]  # fmt: skip
    return runs, probe_ms


def fit_layers(
    model: ModelConfig,
    batches: list[int],
    device: torch.device,
    dtype: torch.dtype,
    raw: dict,
    probe: Callable[[], object],
) -> tuple[float, float, list[dict]]:
    """(elementwise bytes per token per element of d + ffn, fixed µs per layer, the runs) from
    the plain model's steps at `batches` (`fit_elementwise`). On a GPU the fit takes the steps
    replayed from a CUDA graph (the device's time) and the runs hold the eager steps too."""
    runs: list[dict] = []
    graphed = device.type == "cuda"
    for batch in batches:
        seconds, now = plain_step(model, batch, device, dtype, probe, graphed=graphed)
        method = "plain_graph" if graphed else "plain"
        runs.append({"batch": batch, "seconds": seconds, "probe_s": now, "method": method,
                     "calibration": True})  # fmt: skip
        if graphed:  # held out: the fit's device time and the host's per layer, together
            eager, eager_probe = plain_step(model, batch, device, dtype, probe)
            runs.append({"batch": batch, "seconds": eager, "probe_s": eager_probe,
                         "method": "plain", "calibration": False})  # fmt: skip
    fitted = [(r["batch"], r["seconds"], r["probe_s"]) for r in runs if r["calibration"]]
    per_byte, per_layer = fit_elementwise(model, raw, fitted, dtype.itemsize)
    return per_byte, per_layer, runs


def fit_elementwise(
    model: ModelConfig, raw: dict, steps: list[tuple[int, float, float]], compute_bytes: int
) -> tuple[float, float]:
    """(elementwise bytes per token per element of d + ffn, fixed µs per layer) fitted to the
    plain model's steps, each (batch, seconds, probe seconds): what GEMMs, attention and the
    loss leave of each. Each step is scaled by the probe timed just before it against the
    calibration's (the machine's load moves)."""
    cluster = cluster_from_dict(raw, "rates")
    hbm = raw["compute"]["hbm_gbs"]["value"] * 1e9
    rows, ys = [], []
    for batch, seconds, probe_s in steps:
        seconds *= raw["probe_s"]["value"] / probe_s
        plan = Plan(model, cluster, Mesh(), batch=batch)
        gemm = sum(
            weight_gemms_s(plan, w, b)
            for b in (False, True)
            for w, _ in pass_order(model, b)
            if w.kind != "embedding"
        )
        m = batch * model.seq
        attn = model.layers * attention_layer_s(cluster, model, m)
        loss = m * model.vocab * loss_bytes(compute_bytes) / hbm
        ys.append(seconds - gemm - attn - loss)
        rows.append([m * model.layers * (model.d + model.ffn) / hbm, model.layers])
    per_byte, per_layer = nonneg_least_squares(rows, ys)
    return per_byte, per_layer * 1e6


def layer_fit_place(graphed: bool) -> tuple[str, str]:
    """Where the elementwise fit's fixed cost per layer goes: on a GPU, whose fit takes graphed
    steps, the device's small kernels; on a CPU the host's dispatch, which is the same cores."""
    return ("compute", "layer_overhead_us") if graphed else ("host", "layer_us")


REFITTED = "; refitted to its runs by "


def refit(raw: dict, by: str) -> None:
    """Fit again, to what a calibration stores, what calibrate.py fitted when it ran: the GEMM
    rate and cost per GEMM (to its `gemm_samples`, which calibrations since 2026-12-06 keep),
    the elementwise bytes and the fixed cost per layer (to its plain calibration steps, their
    times as stored, rounded to the µs), then the host's times `fit_host` fits (to the runs
    marked with what they fit, where it has them). What a change to how the cost model counts
    a step's parts needs (the GEMMs' waves, the loss's bytes per logit), without the machine,
    as does attention's rate and fixed time where a GPU's `attention_samples` are stored; the
    HBM rate needs the machine. `by` names the refit in each source."""
    plain = [
        r for r in raw["runs"] if r.get("calibration") and r["method"] in ("plain", "plain_graph")
    ]
    if not plain:
        raise SystemExit("calibrate --refit: no plain calibration runs in this JSON to fit to")
    if len({(json.dumps(r["model"]), r["method"]) for r in plain}) > 1:
        raise SystemExit("calibrate --refit: the plain calibration runs mix models or methods")
    if "probe_s" not in raw or any("probe_s" not in r for r in plain):
        raise SystemExit(
            "calibrate --refit: the calibration or its plain runs carry no probe_s (the GEMM "
            "probe the fit scales each step by): only calibrate.py's own JSONs can be refitted"
        )
    note = f"{REFITTED}{by}, {time.strftime('%Y-%m-%d')}"

    def store(part: str, key: str, value: float, source: str) -> None:
        raw[part][key] = src(value, source.split(REFITTED)[0] + note)

    c = raw["compute"]
    if "gemm_samples" in raw:  # first: the elementwise fit takes what the GEMMs leave
        tflops, overhead = fit_gemms(raw, raw["gemm_samples"])
        store("compute", "gemm_tflops", tflops, c["gemm_tflops"]["source"])
        store("compute", "gemm_overhead_us", overhead, c["gemm_overhead_us"]["source"])
    if "attention_samples" in raw:  # a GPU's, in its steps since 2026-12-06
        tflops, layer_us = fit_attention(run_model(plain[0]), raw["attention_samples"])
        store("compute", "attention_tflops", tflops, c["attention_tflops"]["source"])
        store("compute", "attention_layer_us", layer_us, c["attention_layer_us"]["source"])
    steps = [(r["batch"], r["measured_ms"] * 1e-3, r["probe_s"]) for r in plain]
    graphed = plain[0]["method"] == "plain_graph"  # a GPU's, in bf16; a CPU's steps are fp32
    per_byte, per_layer = fit_elementwise(run_model(plain[0]), raw, steps, 2 if graphed else 4)

    part, key = layer_fit_place(graphed)
    for where, value in ((("compute", "elementwise_bytes"), per_byte), ((part, key), per_layer)):
        store(*where, value, raw[where[0]][where[1]]["source"])
    sources = {key: raw["host"][key]["source"] for key in HOST_FIT.values() if key in raw["host"]}
    for key, (value, what) in fit_host(raw).items():
        store("host", key, value, sources.get(key, what))


def measure_use_us(device: torch.device, policy: dict | None = None) -> float:
    """GTP's extra host time per weight use: 16 Linear(64, 64), wrapped or not. On a GPU its
    wall time; on CPU the calling thread's CPU time, which leaves out its waits for gloo's
    collectives (at world 2 the peer's, which the model's collectives already take): the host
    work a use adds, as benchmarks/host_overhead.py measures it."""

    def build(wrap: bool) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(64, 64, bias=False, device=device) for _ in range(16)])
        if wrap:
            GTPWrap(net, {"min_shard_numel": 0, "group_numel": 0, **(policy or {})})
        return net

    x = torch.randn(8, 64, device=device)
    times = []
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Note: one intra-op thread. With more, an op's thread-pool barrier may spin on the
        # calling thread while a descheduled worker waits for a core, and thread_time counts
        # the spin: the likely reason a CI run on two loaded cores timed the plain step
        # 360 ms above the wrapped one, a negative time per use.
        torch.set_num_threads(1)
    try:
        for wrap in (False, True):
            net = build(wrap)

            def step(net=net) -> None:
                net(x).sum().backward()
                for p in net.parameters():
                    p.grad = None

            clock = time.perf_counter if device.type == "cuda" else time.thread_time
            times.append(timed(step, device, 50, warmup=5, clock=clock))
    finally:
        torch.set_num_threads(threads)
    return (times[1] - times[0]) / 32 * 1e6  # a forward use and a backward re-gather per weight


# ---- ranks (spawned) ---------------------------------------------------------------------------


def _comm_rank(device: torch.device, out: str, iters: int) -> None:
    """Flat all-gathers (bf16 on GPUs, fp32 on CPU) and fp32 reduce-scatters of SIZES; then
    the contention of a GEMM loop and an all-gather loop."""
    world, pg = dist.get_world_size(), dist.group.WORLD
    gdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for numel in SIZES:
        for kind, dtype in (("all_gather", gdtype), ("reduce_scatter", torch.float32)):
            full = torch.zeros(numel, device=device, dtype=dtype)
            part = torch.zeros(numel // world, device=device, dtype=dtype)

            def once(kind=kind, full=full, part=part) -> None:
                dist.barrier()
                if kind == "all_gather":
                    pg._allgather_base(full, part).wait()
                else:
                    pg._reduce_scatter_base(part, full).wait()

            seconds = timed(once, device, iters) - timed(dist.barrier, device, iters)
            rows.append(
                {
                    "kind": kind,
                    "world": world,
                    "bytes": numel * dtype.itemsize,
                    "seconds": max(seconds, 1e-7),
                }
            )
    contention = _contention(device, pg, gdtype) if world == 2 else None
    dist.barrier()
    together = timed(_gemm_loop(device, gdtype), device, 3, 1)  # every rank at once
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps({"rows": rows, "contention": contention, "gemm_loop_s": together})
        )


def _gemm_loop(device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """A fixed GEMM loop: timed alone and in every rank at once, it tells how many ranks
    compute in parallel (CPU cores shared with the rest of the machine's load)."""
    n = 512 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)

    def loop() -> None:
        for _ in range(10):
            a @ a

    return loop


def _contention(device: torch.device, pg, dtype: torch.dtype) -> dict:
    """GEMM time alone and beside a stream of all-gathers, and all-gather time alone and beside
    the GEMMs (each rank does both at once)."""
    n = 512 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    numel = 1 << (22 if device.type == "cpu" else 24)
    full = torch.zeros(numel, device=device, dtype=dtype)
    part = torch.zeros(numel // dist.get_world_size(), device=device, dtype=dtype)
    reps = 10 if device.type == "cpu" else 30
    side = torch.cuda.Stream() if device.type == "cuda" else None

    def gemms() -> None:
        for _ in range(reps):
            a @ a

    def gathers(count: int) -> None:
        for _ in range(count):
            pg._allgather_base(full, part).wait()

    dist.barrier()
    gemm_alone = timed(gemms, device, 3, 1)
    dist.barrier()
    gather_alone = timed(lambda: gathers(reps), device, 3, 1) / reps
    dist.barrier()
    result: dict[str, float] = {}

    def comm_side() -> None:  # gathers from another thread (gloo) or stream (NCCL)
        t = time.perf_counter()
        if side is not None:
            with torch.cuda.stream(side):
                gathers(reps * 4)
            side.synchronize()
        else:
            gathers(reps)
        result["gather"] = (time.perf_counter() - t) / (reps * (4 if side is not None else 1))

    thread = threading.Thread(target=comm_side)
    thread.start()
    gemm_beside = timed(gemms, device, 1, 0)
    thread.join()
    return {
        "gemm_slowdown": gemm_beside / gemm_alone,
        "comm_slowdown": max(1.0, result["gather"] / gather_alone),
    }


@dataclasses.dataclass(frozen=True)
class StepJob:
    model: ModelConfig
    batches: tuple[int, ...]
    out: str
    steps: int


def _step_rank(device: torch.device, job: StepJob) -> None:
    """Step times at each batch: on GPUs bench_step's floor, floor_graph, gtp, gtp_graph and
    gtp_blocks (fused AdamW, bf16 gathers over fp32 masters; their median step); on CPU the
    GTP step of the default (fp32) policy, per use and with its blocks on gathered weights
    (gtp_blocks), fastest of the timed steps."""
    rows = []
    if device.type == "cuda":
        import bench_step  # benchmarks/, beside this script
        from host_probe import HostProbe

        probe = HostProbe(device)
        for batch in job.batches:
            for method in ("floor", "floor_graph", "gtp", "gtp_graph", "gtp_blocks"):
                r = bench_step.measure(
                    method,
                    gpt_config(job.model),
                    batch,
                    job.model.seq,
                    3,
                    job.steps,
                    device,
                    {},
                    fused_adamw=True,
                    probe=probe,
                )
                rows.append({"batch": batch, "method": method, "seconds": r["step_ms"] / 1e3,
                             "host_probe_ms": r["host_probe_ms"]})  # fmt: skip
    else:
        loop = _gemm_loop(device, torch.float32)
        for method in ("gtp", "gtp_blocks"):
            torch.manual_seed(0)
            net = GPT(gpt_config(job.model))
            GTPWrap(net)
            if method == "gtp_blocks":
                gather_per_block(net)
            opt = torch.optim.AdamW(net.parameters())
            for batch in job.batches:
                g = torch.Generator().manual_seed(dist.get_rank())
                idx = torch.randint(0, job.model.vocab, (batch, job.model.seq + 1), generator=g)

                def step(idx=idx, net=net, opt=opt) -> None:
                    out = net(idx[:, :-1]).float().flatten(0, 1)
                    F.cross_entropy(out, idx[:, 1:].flatten()).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                step()  # a warm-up step beside timed_probed's own
                # the probe runs in every rank at once, as their steps do
                seconds, probe = timed_probed(
                    lambda step=step: (dist.barrier(), step()),
                    lambda: (dist.barrier(), loop()),
                    device,
                    job.steps,
                )
                rows.append(
                    {"batch": batch, "method": method, "seconds": seconds, "probe_s": probe}
                )
    if dist.get_rank() == 0:
        Path(job.out).write_text(json.dumps(rows))


def spawn(fn: Callable, world: int, cpu: bool, *args) -> None:
    # The ranks share the GPU with this process, whose allocator still caches the blocks of
    # the plain steps (46 GiB after 1.36B at batch 8): handed back first, or a rank runs out
    # of memory on an 80 GiB card.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    launch(fn, world, *args, cpu=cpu, oversubscribe=cpu)


# ---- the calibration ---------------------------------------------------------------------------


def fit_curves(rows: list[dict]) -> dict:
    """Per kind: α, hop and GB/s by least squares over every world and size."""
    out = {}
    for kind in ("all_gather", "reduce_scatter"):
        pts = [r for r in rows if r["kind"] == kind]
        worlds = {r["world"] for r in pts}
        feats = [[1.0, r["world"] - 2.0, (r["world"] - 1) / r["world"] * r["bytes"]] for r in pts]
        if len(worlds) == 1:  # one world: no hop term
            feats = [[f[0], 0.0, f[2]] for f in feats]
        alpha, hop, per_byte = nonneg_least_squares(feats, [r["seconds"] for r in pts])
        out[kind] = {
            "alpha_us": alpha * 1e6,
            "gbs": 1 / max(per_byte, 1e-15) / 1e9,
            "hop_us": hop * 1e6,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="required unless --refit")
    ap.add_argument(
        "--refit",
        type=Path,
        default=None,
        help="measure nothing (other options but --out are ignored): fit a calibration JSON "
        "again to its own stored runs (see `refit`), written to --out or back in place",
    )
    ap.add_argument("--name", default=None, help="cluster name (default: cpu_gloo / the GPU's)")
    ap.add_argument(
        "--model",
        default=None,
        help=f"one of {', '.join(MODELS)} (default: "
        "gpt_1p36b on GPUs; on CPU the gpt_small-shaped cpu_small)",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=None,
        help="collective and step worlds (default: 2 4 on CPU; 2..GPUs on GPUs)",
    )
    ap.add_argument("--no-steps", action="store_true", help="skip the GTP step runs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=280)
    args = ap.parse_args(argv)
    if args.refit:
        raw = json.loads(args.refit.read_text())
        refit(raw, "calibrate.py --refit")
        (args.out or args.refit).write_text(json.dumps(raw, indent=1) + "\n")
        print(f"calibrate: refitted {args.refit} into {args.out or args.refit}")
        return
    if args.out is None:
        ap.error("--out is required (unless --refit)")
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)  # as gtp-train's CPU ranks run
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.model and args.model not in MODELS:
        sys.exit(f"calibrate: unknown model {args.model}; one of {', '.join(MODELS)}")
    model = MODELS[args.model] if args.model else (MODELS["gpt_1p36b"] if cuda else CPU_MODEL)
    gpt_config(model)  # a shape the reference GPT builds, or exit now
    batches = args.batches or ([1, 8] if cuda else [1, 2, 4])
    gpus = torch.cuda.device_count() if cuda else 0
    worlds = args.worlds or ([w for w in (2, 4, 8) if w <= gpus] if cuda else [2, 4])
    name = args.name or (
        "cpu_gloo" if not cuda else torch.cuda.get_device_name().split()[-1].lower()
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1
    tile = (128, 256) if cuda else (1, 1)
    here = f"calibrate.py on {platform.node()} ({torch.cuda.get_device_name() if cuda else platform.processor() or 'cpu'}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"  # noqa: E501
    raw = skeleton(device, tile, sms)
    c = raw["compute"]

    loop = _gemm_loop(device, dtype)
    raw["probe_s"] = src(timed(loop, device, 5, 1), f"{here}: a fixed GEMM loop, alone")
    print("calibrate: GEMMs and attention", flush=True)
    if cuda:  # in the plain model's steps (see [Note: kernels timed in the step])
        raw["gemm_samples"], raw["attention_samples"] = measure_step_kernels(
            model, batches, device, dtype
        )
        tflops, layer_us = fit_attention(model, raw["attention_samples"])
        where = f"{here}: the plain {model.name} step's SDPA kernels at batches {batches}"
        c["attention_tflops"] = src(tflops, f"{where} (slope)")
        c["attention_layer_us"] = src(layer_us, f"{where} (intercept per layer)")
        gemms = f"{here}: the plain {model.name} step's GEMM kernels at batches {batches}"
    else:
        raw["gemm_samples"] = measure_gemms(model, batches, device, dtype)
        attention = measure_attention(model, device, dtype)
        c["attention_tflops"] = src(attention, f"{here}: SDPA fwd+bwd")
        gemms = f"{here}: GEMMs at {model.name}'s shapes, batches {batches}"
    tflops, overhead = fit_gemms(raw, raw["gemm_samples"])
    c["gemm_tflops"] = src(tflops, gemms)
    c["gemm_overhead_us"] = src(overhead, f"{here}: the same fit's intercept")
    c["hbm_gbs"] = src(measure_hbm(device), f"{here}: AdamW step, 28 B/element")
    print("calibrate: the plain model's steps", flush=True)
    per_byte, per_layer, plain_runs = fit_layers(model, batches, device, dtype, raw, loop)
    c["elementwise_bytes"] = src(
        per_byte,
        f"{here}: plain {model.name} steps at batches {batches}, "
        "beyond GEMMs, attention and loss (slope)",
    )
    part, key = layer_fit_place(graphed=cuda)
    raw[part][key] = src(per_layer, f"{here}: the same fit's intercept per layer")
    h = raw["host"]
    host_runs: list[dict] = []
    if cuda:  # [Note: the host's time, fitted to host-bound steps]
        print("calibrate: host-bound steps, taking turns with the host probe", flush=True)
        host_runs, probe_ms = measure_host_steps(device, here)
        raw["host_probe_ms"] = src(probe_ms, f"{here}: benchmarks/host_probe.py, in the "
                                   "host-bound steps' cycles")  # fmt: skip
    print("calibrate: host time per use", flush=True)
    local = measure_use_us(device, {} if not cuda else {"param_dtype": "bfloat16"})
    h["use_us_local"] = src(local, f"{here}: {USE_LINEARS} wrapped or not, world 1")
    h["step_us"] = src(0.0 if not cuda else 1000, "not measured: the loss and optimizer launch")
    h["graph_step_us"] = src(50, "estimate: one CUDA graph replay launch")
    h["fsdp2_block_us"] = src(2000, "../shared/GPU.md: FSDP2 adds ~2 ms per module group")
    h["block_us"] = src(0.0, "not measured (no world-1 gtp_blocks step)")
    comm_rows: list[dict] = []
    contention = None
    alone = raw["probe_s"]["value"]
    units: list[float] = []  # ranks computing in parallel, per world measured
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            if not budget.allows(f"collectives at world {world}", 40):
                continue
            print(f"calibrate: collectives at world {world}", flush=True)
            out = os.path.join(tmp, f"comm{world}.json")
            spawn(_comm_rank, world, not cuda, out, 5 if not cuda else 20)
            found = json.loads(Path(out).read_text())
            comm_rows += found["rows"]
            contention = contention or found["contention"]
            units.append(world * alone / found["gemm_loop_s"])
        step_runs = []
        if not args.no_steps:
            for world in [1] + worlds:
                if not budget.allows(f"steps at world {world}", 30 * world):
                    continue
                print(f"calibrate: GTP steps at world {world}", flush=True)
                out = os.path.join(tmp, f"steps{world}.json")
                spawn(_step_rank, world, not cuda, StepJob(model, tuple(batches), out, args.steps))
                step_runs += [dict(r, world=world) for r in json.loads(Path(out).read_text())]
    comm_src = f"{here}: flat collectives at worlds {sorted({r['world'] for r in comm_rows})}, sizes {list(SIZES)} elements (fit)"  # noqa: E501
    curves = fit_curves(comm_rows) if comm_rows else None
    link = {
        k: {f: src(v, comm_src) for f, v in curve.items()} for k, curve in (curves or {}).items()
    }
    use = 0.0
    bf16 = {"param_dtype": "bfloat16"}
    if cuda and gpus >= 2:
        use = measure_use_us_world2(budget, False, bf16)
        how = "(NCCL)"
    elif cuda:  # without NCCL's own launch cost per collective: see fake_world.py
        use = measure_use_us_faked(budget, bf16)
        how = "in a faked world (fake_world.py, no NCCL launch cost), rank 0 on the GPU"
    elif curves:
        use = measure_use_us_world2(budget, True)
        how = "(gloo), the rank's own CPU time"
    if use:
        h["use_us"] = src(use, f"{here}: {USE_LINEARS} at world 2 {how}")
    else:
        h["use_us"] = src(262, "results/profile_b1_final_gtp.json (2xH200): not measured here")
    raw.update(
        name=name,
        description=(
            f"measured by benchmarks/calibrate.py on {platform.node()}: "
            + (
                "CPU ranks on gloo, one thread each"
                if not cuda
                else f"{gpus} x {torch.cuda.get_device_name()}"
            )
        ),
        gpus_per_node=src(max(worlds + [1]) if not cuda else max(gpus, 1), here),
        compute_units_per_node=src(
            min(units),
            f"{here}: a GEMM loop in every rank at once against alone, at worlds {worlds}",
        )
        if not cuda and units
        else src(gpus, here),
        memory_gib=src(
            torch.cuda.get_device_properties(0).total_memory / 2**30
            if cuda
            else (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30,
            here,
        ),
        contention_compute=src(contention["gemm_slowdown"] if contention else 1.0, here),
        contention_comm=src(contention["comm_slowdown"] if contention else 1.0, here),
    )
    if link:
        raw["links"] = {"intra": link, "inter": link}
    raw["runs"] = runs_of(model, plain_runs, step_runs, cuda, here) + host_runs
    mark_block_fit(raw["runs"])
    for key, (value, what) in fit_host(raw).items():
        raw["host"][key] = src(value, what if key == "use_us" else f"{here}: {what}")
    raw["skipped"] = budget.skipped
    if hasattr(os, "getloadavg"):  # the neighbours' load while this ran (CPU figures move with it)
        raw["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"calibrate: wrote {args.out} ({len(raw['runs'])} runs; skipped: {budget.skipped})")


def fit_host(raw: dict) -> dict[str, tuple[float, str]]:
    """The host's time per layer, per intercepted use at world 1, per block on gathered
    weights and per FSDP2 module group at world 1 (`host.layer_us`, `use_us_local`,
    `block_us`, `fsdp2_block_us_local`), each bisected, in that order, to the run marked as
    fitting it (`"fits"`), which becomes a calibration run: {key: (µs, what it was fitted
    to)}, the values left in `raw["host"]` for the caller to give a source. A fitted
    `use_us_local` moves `use_us` by as much where both were timed on `USE_LINEARS` (see
    [Note: the host's time, fitted to host-bound steps]), and then `use_us` comes back too,
    its source followed by the shift. On a GPU all four fit the host-bound steps of
    `measure_host_steps` (calibrations before 2026-12-07 fitted the first and third); on a
    CPU, whose time per layer the elementwise fit gives, the block time fits the world-1
    gtp_blocks step at the smallest batch (`mark_block_fit`). A calibration made before
    2026-12-06 marked that step a calibration run instead."""
    fitted = {}
    host = raw["host"]
    for key in HOST_FIT.values():
        run = _host_fit_run(raw["runs"], key)
        if run is None:
            continue
        before = host.get(key)
        lo, hi = 0.0, 1e5
        for _ in range(40):
            mid = (lo + hi) / 2
            host[key] = mid
            predicted = predicted_ms(cluster_from_dict(raw, key), run)
            lo, hi = (mid, hi) if predicted < run["measured_ms"] else (lo, mid)
        # At the bound the step was shorter than the model has it with none of this cost:
        # the rest of the model overestimates it (the README's CPU validation says by how much).
        bound = " at its bound of 0" if lo < 1e-6 else ""
        model = run["model"] if isinstance(run["model"], str) else run["model"]["name"]
        fitted[key] = (
            lo,
            f"the world-1 batch-{run['batch']} {model} {run['method']} step (fit{bound})",
        )
        host[key] = lo
        run["calibration"] = True
        use = host.get("use_us")
        on_linears = isinstance(use, dict) and USE_LINEARS in use["source"]
        if key == "use_us_local" and isinstance(before, dict) and on_linears and not bound:
            above = use["value"] - before["value"]  # type: ignore[index]
            source = use["source"].split(MOVED)[0]  # type: ignore[index]
            host["use_us"] = lo + above
            fitted["use_us"] = (host["use_us"], f"{source}{MOVED}{above:.1f} µs above it")
    return fitted


def _host_fit_run(runs: list[dict], key: str) -> dict | None:
    """The run `host.<key>` is fitted to, or None (see `fit_host`)."""
    marked = [r for r in runs if r.get("fits") == key]
    if not marked and key == "block_us":  # a calibration made before 2026-12-06
        marked = [r for r in runs if r["method"] == "gtp_blocks" and r.get("calibration")]
    return marked[0] if marked else None


def mark_block_fit(runs: list[dict]) -> None:
    """Mark the world-1 gtp_blocks step at the smallest batch as the one `host.block_us`
    fits, where no run is marked for it yet."""
    blocks = [r for r in runs if r["method"] == "gtp_blocks" and not r["mesh"]]
    if blocks and _host_fit_run(runs, "block_us") is None:
        min(blocks, key=lambda r: r["batch"])["fits"] = "block_us"


def measure_use_us_world2(budget: Budget, cpu: bool, policy: dict | None = None) -> float:
    """GTP's extra host time per weight use at world 2 on spawned ranks: gloo's on CPU,
    NCCL's on two GPUs."""
    if not budget.allows("host time per use at world 2", 30):
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "use.json")
        spawn(_use_rank, 2, cpu, out, policy)
        return float(json.loads(Path(out).read_text())["use_us"])


def measure_use_us_faked(budget: Budget, policy: dict) -> float:
    """GTP's extra host time per weight use at world 2 with one GPU: the faked world of
    fake_world.py, rank 0 on the GPU, every collective issued and waited for as on NCCL but
    moving nothing (their device time is the links' part of the model)."""
    if not budget.allows("host time per use at world 2 (faked)", 30):
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "use.json")
        fake_world.spawn(_faked_use_rank, 2, out, policy)
        return float(json.loads(Path(out).read_text())["use_us"])


def _use_rank(device: torch.device, out: str, policy: dict | None = None) -> None:
    use_us = measure_use_us(device, policy)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"use_us": use_us}))


def _faked_use_rank(rank: int, device: torch.device, out: str, policy: dict) -> None:
    _use_rank(device, out, policy)


def runs_of(
    model: ModelConfig, plain: list[dict], steps: list[dict], cuda: bool, here: str
) -> list[dict]:
    """The measured steps as runs for `gtp-plan validate`: the plain model's (calibration:
    the elementwise and per-layer fit, as `fit_layers` marks them: on a GPU its graphed steps,
    the eager ones held out) and GTP's (held out; `fit_host` marks the ones it fits to)."""
    spec = dataclasses.asdict(model)
    gather = {} if cuda else {"gather": "fp32"}
    out = []
    for r in plain:
        out.append(
            {
                "model": spec,
                "batch": r["batch"],
                "seq": model.seq,
                "mesh": "",
                "method": r["method"],
                "probe_s": r["probe_s"],
                "measured_ms": round(r["seconds"] * 1e3, 3),
                "source": here,
                "calibration": r["calibration"],
            }
        )
    for r in steps:
        mesh = f"gtp={r['world']}" if r["world"] > 1 else ""
        out.append(
            {
                "model": spec,
                "batch": r["batch"],
                "seq": model.seq,
                "mesh": mesh,
                "method": r["method"],
                "policy": gather,
                **{k: r[k] for k in ("probe_s", "host_probe_ms") if k in r},
                "measured_ms": round(r["seconds"] * 1e3, 3),
                "source": here,
                "calibration": False,
            }
        )
    return out


if __name__ == "__main__":
    main()
