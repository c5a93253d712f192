"""Where the wrapped optimizer step's extra 6-10 % on CPU went (RESULTS.md, 2026-12-07, second
session): a subclass of nn.Parameter whose `__torch_function__` is torch's disabled
implementation, as GTPParameter's is during a step, against nn.Parameter (`.grad` and
`torch.is_complex` per call; fused and foreach AdamW over 86 parameters of 64x64), then the
fused AdamW step of the tiny GPT wrapped (gtp_blocks) against the plain model (amp) and
against itself inside torch's DisableTorchFunctionSubclass, interleaved, median of 400.

    python benchmarks/results/decompose_1207/optimizer_subclass_cpu.py
"""

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_cpu import adamw_us  # noqa: E402
from optimizer_switch import switch_medians  # noqa: E402


class Sub(torch.nn.Parameter):
    __torch_function__ = torch._C._disabled_torch_function_impl


def per_call_ns(fn: Callable[[], object], n: int = 100_000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e9


def subclass_against_parameter() -> None:
    for cls in (torch.nn.Parameter, Sub):
        p = cls(torch.zeros(4))
        p.grad = torch.zeros(4)
        print(f"{cls.__name__}: .grad {per_call_ns(lambda p=p: p.grad):.0f} ns,",
              f"is_complex {per_call_ns(lambda p=p: torch.is_complex(p)):.0f} ns")  # fmt: skip
    for fused in (True, False):
        rounds = [
            tuple(adamw_us([cls(torch.zeros(64, 64)) for _ in range(86)], fused)
                  for cls in (torch.nn.Parameter, Sub))
            for _ in range(5)
        ]  # fmt: skip
        print("fused" if fused else "foreach", "AdamW, 86 parameters, µs (Parameter, Sub):",
              [(round(a), round(b)) for a, b in rounds])  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    subclass_against_parameter()
    switch_medians("tiny", torch.device("cpu"))
