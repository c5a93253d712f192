"""What torch's subclass check costs GTP's optimizer step on a GPU host (issue 21): the fused
AdamW step of bench_step's 125M GPT at batch 1, plain (amp) and wrapped (gtp_blocks), and the
wrapped one inside torch's DisableTorchFunctionSubclass, interleaved, median of 400: the host's
time to return from each step. On CPU `optimizer_subclass_cpu.py` found the switch removes
the wrapped step's whole extra time (RESULTS.md, 2026-12-07, second session).

    python benchmarks/results/decompose_1207/optimizer_switch.py [--model 125M]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_cpu import interleaved_medians, tiny_gpt_optimizers  # noqa: E402


def switch_medians(model: str, device: torch.device) -> None:
    """Print the optimizer step's medians: plain, wrapped, and wrapped inside the switch."""
    optims = tiny_gpt_optimizers(model, device)

    def unchecked() -> None:
        with torch._C.DisableTorchFunctionSubclass():
            optims["gtp_blocks"].step()

    interleaved_medians({"amp": optims["amp"].step, "gtp_blocks": optims["gtp_blocks"].step,
                         "gtp_blocks, subclass check off": unchecked},
                        device=device if device.type == "cuda" else None)  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="125M")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    switch_medians(args.model, torch.device("cuda", 0) if cuda else torch.device("cpu"))
