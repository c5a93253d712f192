"""When do the compute kernels of a profiled step wait, and for what?

    python benchmarks/idle_gaps.py prof/trace_rank0.json[.gz] [--top 20]

A replayed CUDA graph runs its kernels on streams of its own, so "the compute stream" cannot be
read off a stream id. Kernels are told apart by name instead (`trace_events.py`): the
collectives' work (NCCL kernels; the copy-engine collectives' memcpys, barriers and fp32
reduce-scatter kernels) against everything else (compute). Prints how long compute kernels were
busy and idle, split by phase (forward from the embedding lookup, backward from the first
attention backward kernel, optimizer from the first multi-tensor kernel), and the longest idle
gaps with the side work that ran during each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trace_events import is_collective_work, load_gpu_events, merge

_PHASE_STARTS = (("vectorized_gather_kernel", "forward"), ("bprop", "backward"),
                 ("multi_tensor_apply", "optimizer"))  # fmt: skip


def analyse(path: Path, top: int) -> None:
    events = load_gpu_events(path)
    compute = sorted((e for e in events if not is_collective_work(e)), key=lambda e: e["ts"])
    side = [e for e in events if is_collective_work(e)]
    marks: list[tuple[float, str]] = []
    for e in compute:
        for key, phase in _PHASE_STARTS:
            if key in e["name"] and (not marks or marks[-1][1] != phase):
                marks.append((e["ts"], phase))

    def phase_at(t: float) -> str:
        return next((p for s, p in reversed(marks) if s <= t), "before")

    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    t0 = busy[0][0]
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] > a[1]]
    by_phase: dict[str, list[float]] = {}
    for start, end in busy:
        by_phase.setdefault(phase_at(start), [0.0, 0.0])[0] += end - start
    for length, start, _ in gaps:
        by_phase.setdefault(phase_at(start), [0.0, 0.0])[1] += length
    print(f"span {(busy[-1][1] - t0) / 1e3:.1f} ms; compute busy / idle by phase (ms):")
    for phase, (b, i) in by_phase.items():
        print(f"  {phase:9s} {b / 1e3:8.2f} / {i / 1e3:6.2f}")
    for th in (2, 20, 50):
        sel = [g for g, *_ in gaps if g > th]
        print(f"gaps > {th} us: {len(sel)}, {sum(sel) / 1e3:.2f} ms")
    print(f"longest {top} gaps, with the side work during each (ms):")
    for length, start, end in sorted(gaps, reverse=True)[:top]:
        during: dict[str, float] = {}
        for e in side:
            overlap = min(e["ts"] + e["dur"], end) - max(e["ts"], start)
            if overlap > 0:
                kind = "memcpy" if e["cat"] == "gpu_memcpy" else e["name"][:40]
                during[kind] = during.get(kind, 0.0) + overlap
        detail = ", ".join(f"{k}: {v / 1e3:.3f}" for k, v in sorted(during.items()))
        print(f"  {length / 1e3:6.3f} at {(start - t0) / 1e3:7.2f} ({phase_at(start)}): {detail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    analyse(args.trace, args.top)


if __name__ == "__main__":
    main()
