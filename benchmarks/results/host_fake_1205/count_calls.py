"""Python calls a tiny-GPT step makes, in a world of one or a faked world of two (rank 0's),
counted with sys.setprofile after 5 warm-up steps: the same count on every run. On CPU: on a
GPU the backward's Python runs on autograd's threads, which sys.setprofile does not see.

    python benchmarks/results/host_fake_1205/count_calls.py gtp_blocks [WORLD] [TOP]
"""

import collections
import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "..")]
import fake_world  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_step import _build, batch_of, clear_grads  # noqa: E402
from step_phases import MODELS  # noqa: E402


def count(rank: int, device: torch.device, method: str, world: int, top: int) -> None:
    torch.set_num_threads(1)
    cfg = MODELS["tiny"]
    model, optim, _ = _build(method, cfg, device, world, {}, False)
    idx = batch_of(cfg, 1, 16, device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step() -> None:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        clear_grads(method, model, optim)

    for _ in range(5):
        step()
    calls: collections.Counter[str] = collections.Counter()

    def prof(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        if event == "call":
            code = frame.f_code
            calls[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1

    n = 4
    gc.disable()
    sys.setprofile(prof)
    for _ in range(n):
        step()
    sys.setprofile(None)
    gc.enable()
    if rank == 0:
        print(f"{method} world {world}: {sum(calls.values()) / n:.0f} Python calls a step")
        for key, v in calls.most_common(top):
            print(f"  {v / n:8.1f} {key}")


if __name__ == "__main__":
    method, world = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    fake_world.spawn(count, world, method, world, int(sys.argv[3]) if len(sys.argv) > 3 else 0)
