"""Do GEMMs slow down beside a copy-engine peer copy as they do beside NCCL all-gathers?

    python benchmarks/contention.py --out benchmarks/results    # one process, 2 GPUs

At batch 1 the graphed GTP step hides its collectives but its GEMMs run ~35 % slower beside the
NCCL kernels than alone (RESULTS.md). This isolates that effect: the forward GEMMs of one
1.36B layer (2048 tokens, bf16) run on GPU 0's default stream, first alone, then while a side
stream moves 32 MB groups from GPU 1 to GPU 0 either as peer copies (cudaMemcpy over NVLink:
copy engines, no SMs) or as NCCL all-gathers (a single-process communicator; SM kernels).
Enough transfers are queued to outlast the GEMMs. Reports the GEMM time in each case and each
transfer's bandwidth alone, and writes them to JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.cuda.nccl as nccl

GROUP = 16 << 20  # elements: one 16M-element gather group, 32 MB in bf16
ROUNDS = 60


def _timed(fn: Callable[[], None], devices: list[torch.device]) -> float:
    """Milliseconds of `fn`'s work on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    for d in devices:
        torch.cuda.synchronize(d)
    return start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs in this process")
    bf16, d0, d1 = torch.bfloat16, torch.device("cuda", 0), torch.device("cuda", 1)
    devices = [d0, d1]
    torch.cuda.set_device(d0)
    x = torch.randn(2048, 2048, device=d0, dtype=bf16)
    weights = [torch.randn(2048, n, device=d0, dtype=bf16) for n in (2048,) * 4 + (5632,) * 2]
    h = torch.randn(2048, 5632, device=d0, dtype=bf16)
    down = torch.randn(5632, 2048, device=d0, dtype=bf16)

    def gemms() -> None:
        for _ in range(ROUNDS):
            for w in weights:
                x @ w
            h @ down

    side0, side1 = torch.cuda.Stream(d0), torch.cuda.Stream(d1)
    src, dst = torch.randn(GROUP, device=d1, dtype=bf16), torch.empty(GROUP, device=d0, dtype=bf16)
    halves = [torch.randn(GROUP // 2, device=d, dtype=bf16) for d in devices]
    gathered = [torch.empty(GROUP, device=d, dtype=bf16) for d in devices]

    def peer_copies(n: int) -> None:
        with torch.cuda.stream(side0):
            for _ in range(n):
                dst.copy_(src, non_blocking=True)

    def all_gathers(n: int) -> None:
        for _ in range(n):
            nccl.all_gather(halves, gathered, streams=[side0, side1])

    gemms()
    alone = min(_timed(gemms, devices) for _ in range(3))
    result: dict = {"device": torch.cuda.get_device_name(d0), "torch": torch.__version__,
                    "gemm_alone_ms": alone}  # fmt: skip
    # Bytes each transfer brings into GPU 0: the whole group, or the peer's half of it.
    for name, transfer, received in (("copy_engine", peer_copies, GROUP * 2),
                                     ("nccl_all_gather", all_gathers, GROUP)):  # fmt: skip
        transfer(3)
        with torch.cuda.stream(side0):
            per = _timed(lambda t=transfer: t(20), devices) / 20  # type: ignore[misc]
        transfer(int(1.5 * alone / per) + 2)  # queued on the side stream, outlasting the GEMMs
        beside = _timed(gemms, devices)
        result[name] = {
            "ms_per_transfer": per,
            "GB_per_s_alone": received / per / 1e6,
            "gemm_ms_beside": beside,
            "gemm_slowdown": beside / alone,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "contention.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
