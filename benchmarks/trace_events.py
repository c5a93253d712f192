"""Reading torch.profiler Chrome traces: the GPU events, what each kernel is, merged intervals.

Shared by profile_gtp.py (kernel time by kind), idle_gaps.py (when the compute waits) and
timeline.py (a picture of a window). Kernels are told apart by name, since a replayed CUDA graph
runs them on streams of its own.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

_GEMMS = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul")
# Attention's kernels, which the GEMM names above also match: cuDNN's SDPA kernels are named
# "..._sdpa_sm90_flash_..." (counted as GEMMs until 2026-12-06: every "gemm" figure of a
# profile summary before then includes attention's kernels), FlashAttention's "...fmha...".
_ATTENTION = ("sdpa", "flash", "fmha", "attention", "cudnn::fusion")
# The copy-engine collectives' SM kernels on their side streams: the fused Triton kernels
# (copy_kernels.py: a gather's double write, a reduce-scatter's sum), or without Triton
# PyTorch's add of the peer's fp32 row and halving for the mean.
_COPY_ENGINE_KERNELS = (
    "_write_twice",
    "_sum_into",
    "CUDAFunctor_add<float>",
    "BUnaryFunctor<float",
)


def load_gpu_events(path: Path) -> list[dict]:
    """The kernels and memcpys of a trace (`.json` or `.json.gz`) that have a duration."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]


def is_gemm(name: str) -> bool:
    return gemm_named(name) and not is_attention(name)


def gemm_named(name: str) -> bool:
    """Whether the name matches a GEMM's: what profiles before 2026-12-06 counted as one."""
    n = name.lower()
    return any(k in n for k in _GEMMS)


def is_attention(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in _ATTENTION)


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def is_barrier(name: str) -> bool:
    """A symmetric-memory barrier of the copy-engine collectives."""
    return "barrier" in name.lower()


def is_copy(event: dict) -> bool:
    """A memcpy: on the copy engines, or run by the driver as a `memcpy128` kernel."""
    return event.get("cat") == "gpu_memcpy" or "memcpy128" in event["name"]


def is_collective_work(event: dict) -> bool:
    """Work of the collectives rather than of the model: NCCL kernels, or the copy-engine
    collectives' memcpys, barriers and SM kernels."""
    name = event["name"]
    return (
        is_copy(event)
        or is_nccl(name)
        or is_barrier(name)
        or any(k in name for k in _COPY_ENGINE_KERNELS)
    )


def intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The events' (start, end) in µs, sorted."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events)


def merge(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The union of `spans` as sorted, disjoint [start, end] intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
