"""Does a GTP step slow the floor's next step (the host's caches), on this host?
floor steps alone, then floor and gtp_blocks alternated step by step; host time per phase."""

import collections
import json
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import torch
import torch.nn.functional as F
from bench_step import MODELS, _build, batch_of, clear_grads

from gtp_wrap.app.launch import launch


def rank(device, out, model, seq):
    cfg = MODELS[model]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fl = _build("floor", cfg, device, 1, {}, True)[:2]
    gb = _build("gtp_blocks", cfg, device, 1, {}, True)[:2]
    idx = batch_of(cfg, 1, seq, device)
    x, y = idx[:, :-1], idx[:, 1:]

    def step(meth, m, o):
        sync()
        t0 = time.perf_counter()
        loss = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        o.step()
        clear_grads(meth, m, o)
        sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t0

    res = collections.defaultdict(list)
    for _r in range(4):
        for mode in ("alone", "alternated"):
            for s in range(30):
                seq = [("floor", fl)] if mode == "alone" else [("floor", fl), ("gtp_blocks", gb)]
                if mode == "alone" and s >= 15:
                    seq = [("gtp_blocks", gb)]
                for meth, (m, o) in seq:
                    f, b, st = step(meth, m, o)
                    if s % 15 >= 5:
                        for k, v in (("fwd", f), ("bwd", b), ("step", st)):
                            res[f"{mode} {meth} {k}"].append(v * 1e3)
    if device.type == "cuda":  # any host-device synchronization inside a step, by name
        import warnings

        for meth, (m, o) in (("floor", fl), ("gtp_blocks", gb)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode(1)
                for _ in range(2):
                    loss = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
                    loss.backward()
                    o.step()
                    clear_grads(meth, m, o)
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
            msgs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]
            res[f"sync warnings {meth}"] = [len(msgs)]
            print(meth, "sync warnings:", len(msgs), msgs[:3])
    med = {k: round(statistics.median(v), 2) for k, v in sorted(res.items())}
    for k, v in med.items():
        print(f"{k:30s} {v} ms")
    json.dump(med, open(out, "w"), indent=1)


if __name__ == "__main__":
    launch(rank, 1, sys.argv[1], sys.argv[2], int(sys.argv[3]), cpu=not torch.cuda.is_available())
