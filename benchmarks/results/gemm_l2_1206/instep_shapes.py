"""A floor step's GEMM kernels by shape (issue 26, 2026-12-06): bench_step.py's floor (bf16
model, fused AdamW) at 125M and 1.36B, batch 1 and 8, two steps profiled with their input
shapes after three warm-up steps; each matmul op's device time per call, by (op, input
shapes), so cold_parts.py's hot and cold timings of a shape can be set beside what it took in
the step.

    torchrun --nproc_per_node 1 benchmarks/results/gemm_l2_1206/instep_shapes.py OUT.json
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_step import MODELS, _build, batch_of, method_step  # noqa: E402

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}
STEPS = 2

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
out: list[dict] = []
for name in ("125M", "1.36B"):
    for batch in (1, 8):
        cfg = MODELS[name]
        model, opt, autocast = _build("floor", cfg, device, 1, {}, fused_adamw=True)
        idx = batch_of(cfg, batch, 2048, device)
        step = method_step("floor", model, opt, autocast, idx, graph_warmup=0)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            record_shapes=True,
        ) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
        total_gemm = 0.0
        for e in prof.key_averages(group_by_input_shape=True):
            if e.key in ("aten::mm", "aten::addmm") and e.self_device_time_total > 0:
                out.append({"model": name, "batch": batch, "op": e.key,
                            "shapes": str(e.input_shapes), "calls_per_step": e.count / STEPS,
                            "device_us_per_step": e.self_device_time_total / STEPS})  # fmt: skip
                total_gemm += e.self_device_time_total / STEPS
        print(f"{name} b{batch}: mm/addmm device time {total_gemm / 1e3:.2f} ms a step", flush=True)
        del model, opt, step
        torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
dist.destroy_process_group()
