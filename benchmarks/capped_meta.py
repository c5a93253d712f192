"""A model that cannot be built whole on a rank under a per-rank memory cap, built on the meta
device, wrapped and trained on 4 CPU ranks under that cap.

    python benchmarks/capped_meta.py [--cap-mib 600] [--ranks 4]

The cap is on tensor memory: every storage torch makes on a rank counts while it is alive
(`LiveBytes` of wrap_memory.py), and one that takes the total past `--cap-mib` raises
MemoryError, as an allocator of that size would. Building the whole model (its fp32 weights
alone exceed the cap) must fail; building it on the meta device, wrapping it (each rank
allocates its quarter and stages one weight at a time) and taking SGD steps must not.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from wrap_memory import LiveBytes

from gtp_wrap import GTPWrap
from gtp_wrap.app.launch import launch
from gtp_wrap.app.model import GPT, GPTConfig

CFG = GPTConfig(vocab=16384, d=768, layers=24, heads=12, ffn=2048, max_seq=64)


class Capped(LiveBytes):
    """LiveBytes that refuses to go past `cap` bytes."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.now > self.cap:
            raise MemoryError(f"{self.now / 2**20:.0f} MiB of tensors past the cap")
        return out


def _rank(device: torch.device, args: argparse.Namespace) -> None:
    row: dict = {"rank": dist.get_rank(), "model_mib": round(CFG.n_params * 4 / 2**20),
                 "cap_mib": args.cap_mib}  # fmt: skip
    with Capped(args.cap_mib * 2**20) as whole_cap:
        try:
            GPT(CFG)
            row["whole"] = "built"
        except MemoryError as e:
            row["whole"] = f"MemoryError: {e}"
    del whole_cap
    with Capped(args.cap_mib * 2**20) as capped:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(CFG)
        GTPWrap(model, device="cpu")
        row["after_wrap_mib"] = round(capped.now / 2**20)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            idx = torch.randint(0, CFG.vocab, (2, 33), generator=g)
            loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 4))
        row["losses"] = losses
        row["peak_mib"] = round(capped.peak / 2**20)
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mib", type=int, default=600)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args()
    launch(_rank, args.ranks, args, cpu=True, oversubscribe=True)


if __name__ == "__main__":
    main()
