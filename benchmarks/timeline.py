"""Draw a window of a torch.profiler trace: GEMMs and other compute in one lane, the
collectives in another (NCCL all-gathers and reduce-scatters, or the copy-engine collectives'
memcpys and barriers), so their overlap can be seen.

    python benchmarks/timeline.py trace_rank0.json.gz --out benchmarks/results/timeline.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trace_events import is_barrier, is_copy, is_gemm, is_nccl, load_gpu_events


def _kind(event: dict) -> str | None:
    name = event["name"]
    if is_copy(event):
        return "memcpy"
    if is_barrier(name):
        return "barrier"
    if is_nccl(name):
        n = name.lower()
        return (
            "all-gather" if "allgather" in n else "reduce-scatter" if "reducescatter" in n else None
        )
    if is_gemm(name):
        return "GEMM"
    return "other compute"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--start-ms", type=float, default=None, help="window start (default: mid-step)")
    ap.add_argument("--width-ms", type=float, default=12.0)
    ap.add_argument("--out", type=Path, default=Path("timeline.png"))
    ap.add_argument("--title", default="GTP, 1.36B, batch 4x2048 per GPU, 2xH200: gathers and "
                    "reduce-scatters under GEMMs")  # fmt: skip
    args = ap.parse_args()
    events = load_gpu_events(args.trace)
    t0 = min(e["ts"] for e in events)
    span = (max(e["ts"] + e["dur"] for e in events) - t0) / 1e3
    start = args.start_ms if args.start_ms is not None else span / 4
    lo, hi = t0 + start * 1e3, t0 + (start + args.width_ms) * 1e3

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"GEMM": "tab:blue", "other compute": "tab:gray", "all-gather": "tab:orange",
              "reduce-scatter": "tab:red", "memcpy": "tab:green", "barrier": "black"}  # fmt: skip
    lanes = {"GEMM": 1, "other compute": 1, "all-gather": 0, "reduce-scatter": 0, "memcpy": 0,
             "barrier": 0}  # fmt: skip
    present = {_kind(e) for e in events}
    colors = {k: c for k, c in colors.items() if k in present}
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for e in events:
        kind = _kind(e)
        if kind is None or e["ts"] + e["dur"] < lo or e["ts"] > hi:
            continue
        ax.broken_barh([((e["ts"] - lo) / 1e3, e["dur"] / 1e3)], (lanes[kind] - 0.4, 0.8),
                       color=colors[kind])  # fmt: skip
    ax.set_yticks([0, 1], ["collectives", "compute"])
    ax.set_xlim(0, args.width_ms)
    ax.set_xlabel(f"ms (from {start:.1f} ms into the trace)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=len(colors), loc="upper right", fontsize=8)
    ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
