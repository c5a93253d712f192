"""tests/test_parity.py's cases on 8 gloo ranks, one gtp axis and a ("dp", "gtp") mesh of 2 x 4:
what tests/test_gpu.py asks of an 8-GPU machine, checked on CPU first (too slow for CI's 2
cores). From tests/: `python ../benchmarks/results/decompose_1207/parity_8_ranks.py`.
"""

import sys
import time

sys.path.insert(0, ".")
import test_parity as tp  # noqa: E402
import torch  # noqa: E402
from harness import cached_ranks, mesh_2d  # noqa: E402
from parity_cases import CASES  # noqa: E402


def cases(rank: int, world: int, dp: int) -> dict:
    tp._mesh = (lambda kind: mesh_2d(dp, world // dp)) if dp > 1 else (lambda kind: None)
    return tp._all_cases(rank, world, "x")


if __name__ == "__main__":
    failed = False
    for world, dp in ((8, 1), (8, 2)):
        start = time.time()
        results = cached_ranks(cases, world, dp, timeout=600)
        bad = []
        for name in CASES:
            ref = tp._reference(name, world)
            for got in (r[name] for r in results):
                try:
                    assert "error" not in got, got.get("error", "")[-300:]
                    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
                    for key, value in ref["params"].items():
                        torch.testing.assert_close(got["params"][key], value, rtol=1e-4, atol=1e-5)
                except AssertionError as e:
                    bad.append((name, str(e)[:300]))
                    break
        took = time.time() - start
        print(f"world {world}, dp {dp}: {len(CASES)} cases, {took:.0f} s, failed: {bad}")
        failed = failed or bool(bad)
    sys.exit(1 if failed else 0)
