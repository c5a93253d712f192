"""The cost model's device parts against parts.py's timings of them on one GPU: each weight GEMM
shape (summed per model and batch, as a step runs them), SDPA forward and backward, and the
loss, measured beside what `gtp_wrap.scaling.predict` gives for them on a cluster.

    python benchmarks/results/kernels_1206/compare.py h100_parts.json h100
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

from gtp_wrap.scaling.cluster import load_cluster
from gtp_wrap.scaling.model import GPT_1P36B, GPT_125M
from gtp_wrap.scaling.precision import COMPUTE_BYTES
from gtp_wrap.scaling.predict import attention_layer_s, gemm_s, hbm_s, loss_bytes

MODELS = {m.name: m for m in (GPT_125M, GPT_1P36B)}


def main() -> None:
    parts = json.loads(Path(sys.argv[1]).read_text())
    cluster = load_cluster(sys.argv[2])
    steps: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for g in parts["gemms"]:
        row = steps[(g["model"], g["batch"])]
        row[0] += g["per_step"] * g["seconds"]
        row[1] += g["per_step"] * gemm_s(cluster, g["m"], g["n"], g["k"])
        row[2] += g["per_step"]
    print(f"{parts['device']} against {sys.argv[2]}.json (ms)")
    print("| part | measured | model | model / measured |\n|---|---|---|---|")
    for (name, batch), (measured, model, n) in steps.items():
        print(
            f"| a step's {n} weight GEMMs, {name} batch {batch} | {measured * 1e3:.3f} "
            f"| {model * 1e3:.3f} | {model / measured:.2f} |"
        )
    for a in parts["attention"]:
        m = MODELS[a["model"]]
        model = attention_layer_s(cluster, m, a["batch"] * m.seq)
        print(
            f"| SDPA fwd+bwd, {a['heads']} heads of {a['head_dim']}, batch {a['batch']} "
            f"| {a['seconds'] * 1e3:.3f} | {model * 1e3:.3f} | {model / a['seconds']:.2f} |"
        )
    for loss in parts["loss"]:
        model = hbm_s(cluster, loss["logits"] * loss_bytes(COMPUTE_BYTES))
        print(f"| loss over {loss['logits'] / 1e6:.1f}M bf16 logits | {loss['seconds'] * 1e3:.3f} "
              f"| {model * 1e3:.3f} | {model / loss['seconds']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
