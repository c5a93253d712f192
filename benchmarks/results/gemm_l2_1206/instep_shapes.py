"""A floor step's GEMM kernels by shape, and its attention (issue 26, 2026-12-06):
bench_step.py's floor (bf16 model, fused AdamW) at 125M and 1.36B, batch 1 and 8, timed in
its own kernels as calibrate.py's `step_kernels` times them (two steps profiled with their
input shapes after three), so cold_parts.py's hot and cold timings of a shape can be set
beside what it took in the step, and a cluster's GEMM and attention rates fitted to steps of
both models.

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
from calibrate import step_kernels  # noqa: E402

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
out: dict = {"device": torch.cuda.get_device_name(), "gemms": [], "attention": []}
for name in ("125M", "1.36B"):
    for batch in (1, 8):
        cfg = MODELS[name]
        model, opt, autocast = _build("floor", cfg, device, 1, {}, fused_adamw=True)
        idx = batch_of(cfg, batch, 2048, device)
        step = method_step("floor", model, opt, autocast, idx, graph_warmup=0)
        gemms, attention_s = step_kernels(step, device)
        out["gemms"] += [{"model": name, "batch": batch, **g} for g in gemms]
        out["attention"].append({"model": name, "batch": batch, "seconds": attention_s})
        gemm_ms = sum(g["per_step"] * g["seconds"] for g in gemms) * 1e3
        print(f"{name} b{batch}: GEMMs {gemm_ms:.2f} ms, attention {attention_s * 1e3:.2f} ms "
              "a step", flush=True)  # fmt: skip
        del model, opt, step
        torch.cuda.empty_cache()
Path(sys.argv[1]).write_text(json.dumps(out, indent=1) + "\n")
dist.destroy_process_group()
