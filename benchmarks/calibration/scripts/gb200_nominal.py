"""Write benchmarks/calibration/gb200.json: a nominal GB200 NVL72 cluster.

    python benchmarks/calibration/scripts/gb200_nominal.py      # after h200_from_results.py

No GB200 was measured. Each rate is the published GB200 figure times the efficiency the H200
reached against its own published figure (h200.json over the H200 datasheet): GEMMs and
attention against dense bf16 peak, memory-bound kernels against HBM bandwidth, NVLink
collectives against NVLink bandwidth per direction. Latencies, contention, host costs and the
implementation's elementwise bytes are the H200's. Say "nominal" wherever these are quoted.
"""

from __future__ import annotations

import json
from pathlib import Path

CALIBRATION = Path(__file__).resolve().parents[1]

# Published figures per GPU (NVIDIA datasheets; GB200 NVL72 and HGX H200).
H200 = {"bf16_tflops": 989, "hbm_gbs": 4800, "nvlink_gbs": 450}
GB200 = {
    "bf16_tflops": 2500,
    "hbm_gbs": 8000,
    "nvlink_gbs": 900,
    "hbm_gb": 186,
    "sms": 148,
    "nic_gbs": 50,
    "domain": 72,
}
SHEET = "GB200 NVL72 datasheet (nominal)"


def value(node: dict | float) -> float:
    return node["value"] if isinstance(node, dict) else node


def scaled(h200_node: dict, ours: float, theirs: float, what: str) -> dict:
    """The H200's measured value scaled by GB200's published figure over H200's."""
    v = value(h200_node) * ours / theirs
    return {
        "value": float(f"{v:.6g}"),
        "source": f"nominal: {SHEET} {what} x the H200's measured "
        f"efficiency ({value(h200_node):.4g} of {theirs} in h200.json)",
    }


def main() -> None:
    h = json.loads((CALIBRATION / "h200.json").read_text())
    c = h["compute"]
    intra = h["links"]["intra"]
    nic = {
        "value": GB200["nic_gbs"] * 0.9,
        "source": "nominal: 400 Gb/s ConnectX-7 per GPU at 90 %",
    }
    inter = {
        k: {
            "alpha_us": {"value": 30, "source": "nominal"},
            "gbs": nic,
            "hop_us": {"value": 5, "source": "nominal"},
        }
        for k in ("all_gather", "reduce_scatter")
    }
    out = {
        "name": "gb200",
        "description": "NVIDIA GB200 NVL72 (72 GPUs per NVLink 5 domain, one 400 Gb/s NIC per "
        "GPU). NOMINAL: published figures times the H200's measured efficiency; not measured",
        "nominal": True,
        "gpus_per_node": {
            "value": GB200["domain"],
            "source": f"{SHEET}: 72 GPUs per NVLink domain",
        },
        "memory_gib": {
            "value": round(GB200["hbm_gb"] * 1e9 / 2**30, 1),
            "source": f"{SHEET}: 186 GB HBM3e",
        },
        "async_host": True,
        "grouped_collectives": True,
        "contention_compute": h["contention_compute"],
        "contention_comm": h["contention_comm"],
        "links": {
            "intra": {
                k: {
                    "alpha_us": intra[k]["alpha_us"],
                    "hop_us": intra[k]["hop_us"],
                    "gbs": scaled(
                        intra[k]["gbs"],
                        GB200["nvlink_gbs"],
                        H200["nvlink_gbs"],
                        "NVLink 5 per direction",
                    ),
                }
                for k in ("all_gather", "reduce_scatter")
            },
            "inter": inter,
        },
        "compute": {
            "gemm_tflops": scaled(
                c["gemm_tflops"], GB200["bf16_tflops"], H200["bf16_tflops"], "dense bf16"
            ),
            "gemm_overhead_us": c["gemm_overhead_us"],
            "gemm_units": {"value": GB200["sms"], "source": "nominal: 148 SMs per Blackwell GPU"},
            "gemm_tile_m": {"value": 256, "source": "nominal: Blackwell's 2-SM 256-row MMA tiles"},
            "gemm_tile_n": c["gemm_tile_n"],
            "attention_tflops": scaled(
                c["attention_tflops"], GB200["bf16_tflops"], H200["bf16_tflops"], "dense bf16"
            ),
            "hbm_gbs": scaled(c["hbm_gbs"], GB200["hbm_gbs"], H200["hbm_gbs"], "HBM3e bandwidth"),
            "elementwise_bytes": c["elementwise_bytes"],
            "layer_overhead_us": c["layer_overhead_us"],
            "attention_layer_us": c["attention_layer_us"],
            **{k: c[k] for k in ("fp8_decode_us", "nvfp4_decode_us")},
            **{
                k: {
                    "value": float(f"{value(c[k]) * H200['hbm_gbs'] / GB200['hbm_gbs']:.6g}"),
                    "source": f"nominal: the H200's (h200.json) times {H200['hbm_gbs']} / "
                    f"{GB200['hbm_gbs']} GB/s of HBM",
                }
                for k in ("fp8_decode_ns", "nvfp4_decode_ns")
            },
        },
        "host": h["host"],
        "runs": [],
    }
    (CALIBRATION / "gb200.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {CALIBRATION / 'gb200.json'}")


if __name__ == "__main__":
    main()
