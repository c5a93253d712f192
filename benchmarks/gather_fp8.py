"""Gather time of one weight in bf16 against FP8, on the 1.36B model's weight shapes.

    torchrun --nproc_per_node 2 benchmarks/gather_fp8.py

bf16: one all-gather of this rank's bf16 rows. FP8: one all-gather of the packed slot (FP8
payload and one fp32 scale per 128 elements, as GTP sends it) followed by the dequantization to
bf16 that the GEMM reads. Median of 50 timed repetitions after 5 warm-up ones (CUDA events);
rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from gtp_wrap.precision import fp8, fp8_triton

SHAPES = {"attention q/k/v/o": (2048, 2048), "mlp gate/up/down": (5632, 2048),
          "embedding / head": (32000, 2048)}  # fmt: skip


def _median_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_weight(name: str, r: int, c: int, world: int) -> dict:
    slot = r // world * c
    shard = torch.randn(slot, device="cuda")
    send = shard.bfloat16()
    full = torch.empty(world * slot, dtype=torch.bfloat16, device="cuda")
    payload, scale = fp8.quantize(shard.view(-1, fp8.BLOCK))
    packed = torch.cat([payload.reshape(-1), scale.view(torch.uint8)])
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device="cuda")

    def gather_fp8() -> None:
        dist.all_gather_into_tensor(gathered, packed)

    fused = fp8_triton.available(full.device, slot)

    def dequantize() -> None:
        fp8.dequantize_into(gathered, world, slot, full, fused=fused)

    return {
        "weight": name, "shape": [r, c], "bf16_bytes": full.numel() * 2,
        "fp8_bytes": gathered.numel(),
        "bf16_ms": _median_ms(lambda: dist.all_gather_into_tensor(full, send)),
        "fp8_gather_ms": _median_ms(gather_fp8), "fp8_dequant_ms": _median_ms(dequantize),
        "fp8_total_ms": _median_ms(lambda: (gather_fp8(), dequantize())),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    rows = [_time_weight(name, r, c, world) for name, (r, c) in SHAPES.items()]
    if dist.get_rank() == 0:
        print(f"{'weight':>20} {'bf16 ms':>8} {'fp8 wire':>9} {'dequant':>8} {'fp8 total':>9}")
        for x in rows:
            print(f"{x['weight']:>20} {x['bf16_ms']:8.3f} {x['fp8_gather_ms']:9.3f} "
                  f"{x['fp8_dequant_ms']:8.3f} {x['fp8_total_ms']:9.3f}")  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "world": world}
        (args.out / "gather_fp8.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=2)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
