"""What FP8 and NVFP4 gathers cost in accuracy, bytes and decode time, against bf16 gathers.

    python benchmarks/low_precision_gathers.py error [--model gpt_small] [--ranks 2]
    python benchmarks/low_precision_gathers.py loss [--steps 300] [--nproc 2]
    python benchmarks/low_precision_gathers.py decode       # on a CUDA GPU

`error`: every weight of the app's GPT as built (its init), split into `--ranks` shards as GTP
shards it (rows), each shard encoded as its gathers send it and decoded to bf16, against the
weight rounded to bf16 (what a bf16 gather moves). Per weight: bytes per element on the wire,
the RMS error relative to the weight's RMS, and the largest error relative to its largest
magnitude (an element-wise relative error is unbounded near zero).

`loss`: `gtp-train` (its defaults: the embedded data, the tiny GPT) once per gather precision,
policies `bf16`, `fp8` and `nvfp4`, the same seed and `--steps`, on `--nproc` CPU ranks; the
final loss (mean of the last 10 logged steps) of each against bf16's, and the curves as a PNG.

`decode`: on a CUDA GPU, the time to decode one gathered weight of the 1.36B model's shapes
over 2 ranks (the fused Triton kernels), median of 50 after 5 warm-up.

Writes JSON (and the PNG) under `--out`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.precision import fp8, nvfp4

_MODELS = Path(__file__).resolve().parent.parent / "configs" / "model"
SHAPES = {"attention q/k/v/o": (2048, 2048), "mlp gate/up/down": (5632, 2048),
          "embedding / head": (32000, 2048)}  # fmt: skip


def _fp8_round_trip(shard: torch.Tensor) -> tuple[torch.Tensor, int]:
    q = fp8.padded(shard.numel())
    flat = torch.zeros(q)
    flat[: shard.numel()] = shard.flatten()
    payload, scale = fp8.quantize(flat.view(-1, fp8.BLOCK))
    packed = torch.cat([payload.reshape(-1), scale.view(torch.uint8)])
    out = torch.empty(shard.numel(), dtype=torch.bfloat16)
    fp8.dequantize_into(packed, 1, shard.numel(), out)
    return out.view_as(shard), packed.numel()


def _nvfp4_round_trip(shard: torch.Tensor) -> tuple[torch.Tensor, int]:
    slot = torch.zeros(nvfp4.packed_bytes(shard.numel()), dtype=torch.uint8)
    nvfp4.quantize_into(shard.flatten(), slot)
    out = torch.empty(shard.numel(), dtype=torch.bfloat16)
    nvfp4.dequantize_into(slot, 1, shard.numel(), out)
    return out.view_as(shard), slot.numel()


def error(args: argparse.Namespace) -> dict:
    """Per 2-D weight and encoding: bytes per element, RMS and max error relative to bf16."""
    import yaml  # the app's dependency (Hydra's configs)

    cfg = yaml.safe_load((_MODELS / f"{args.model}.yaml").read_text())
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in cfg.items() if k in GPTConfig.__annotations__}))
    rows = []
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        w = p.detach().float()
        ref = w.bfloat16().float()
        row: dict = {"weight": name, "shape": list(w.shape)}
        for label, round_trip in (("fp8", _fp8_round_trip), ("nvfp4", _nvfp4_round_trip)):
            parts = [round_trip(shard) for shard in w.chunk(args.ranks)]
            got = torch.cat([d for d, _ in parts]).float()
            diff = got - ref
            row[label] = {
                "bytes_per_element": sum(b for _, b in parts) / w.numel(),
                "rms_rel": (diff.norm() / ref.norm()).item(),
                "max_rel": (diff.abs().max() / ref.abs().max()).item(),
            }
        rows.append(row)
        print(f"{name:<28} {str(tuple(w.shape)):<14}"
              + "".join(f" {k} {row[k]['bytes_per_element']:.4f} B {row[k]['rms_rel']:.2e} rms "
                        f"{row[k]['max_rel']:.2e} max" for k in ("fp8", "nvfp4")))  # fmt: skip
    return {"model": args.model, "ranks": args.ranks, "weights": rows}


def loss(args: argparse.Namespace) -> dict:
    """gtp-train once per gather precision; final losses and the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("bf16", "fp8", "nvfp4"):
            out = Path(tmp) / policy
            cmd = [sys.executable, "-m", "gtp_wrap.app.train", f"policy={policy}",
                   "device=cpu", f"nproc={args.nproc}", f"trainer.steps={args.steps}",
                   "trainer.log_every=1", "trainer.eval_every=0", "checkpoint.every=0",
                   f"out_dir={out}"]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, timeout=args.timeout)
            curves[policy] = json.loads((out / "metrics.json").read_text())["history"]["loss"]
            print(policy, "final", statistics.fmean(curves[policy][-10:]))
    final = {k: statistics.fmean(v[-10:]) for k, v in curves.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=f"{policy} gathers (final {final[policy]:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"gtp-train, {args.nproc} CPU ranks, the same seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "low_precision_gathers_loss.png", dpi=120)
    return {
        "steps": args.steps,
        "nproc": args.nproc,
        "final_loss": final,
        "relative_to_bf16": {k: v / final["bf16"] - 1 for k, v in final.items()},
        "curves": curves,
    }


def _median_ms(fn, reps: int = 50, warmup: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def decode(args: argparse.Namespace) -> dict:
    """Decode time of one gathered weight (2 ranks' slots) per shape and encoding."""
    rows = []
    for name, (r, c) in SHAPES.items():
        numel = r * c // 2
        shard = torch.randn(numel, device="cuda")
        out = torch.empty(2 * numel, dtype=torch.bfloat16, device="cuda")
        fp8_slots = torch.zeros(2 * fp8.packed_bytes(numel), dtype=torch.uint8, device="cuda")
        nv_slots = torch.zeros(2 * nvfp4.packed_bytes(numel), dtype=torch.uint8, device="cuda")
        for i in range(2):
            nvfp4.quantize_into(shard, nv_slots.view(2, -1)[i])
        runs = {
            "fp8_ms": functools.partial(fp8.dequantize_into, fp8_slots, 2, numel, out, fused=True),
            "nvfp4_ms": functools.partial(nvfp4.dequantize_into, nv_slots, 2, numel, out, True),
            "nvfp4_unfused_ms": functools.partial(nvfp4.dequantize_into, nv_slots, 2, numel, out),
        }
        row = {"weight": name, "shape": [r, c]} | {k: _median_ms(fn) for k, fn in runs.items()}
        rows.append(row)
        print(row)
    return {"device": torch.cuda.get_device_name(), "weights": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["error", "loss", "decode"])
    ap.add_argument("--model", default="gpt_small", help="a configs/model name (error)")
    ap.add_argument("--ranks", type=int, default=2, help="shards per weight (error)")
    ap.add_argument("--steps", type=int, default=300, help="training steps (loss)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks (loss)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per gtp-train run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"error": error, "loss": loss, "decode": decode}[args.what](args)
    path = args.out / f"low_precision_gathers_{args.what}.json"
    path.write_text(json.dumps(result | {"torch": torch.__version__}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
