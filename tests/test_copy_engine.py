"""Copy-engine collectives (policy `collectives: copy_engine`).

On CPU: the round planner, and the refusal. On 2 GPUs: the collectives against NCCL's on
sizes that need many rounds of a small workspace, the parity cases trained through them, and a
graphed step through them equal to the eager one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import traceback
import types
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from graph_cases import CFG as GPT_CFG
from graph_cases import OPTIMIZERS, POLICY, RoutedGPT, regions_run
from graph_cases import train_graphed as _train_graphed
from harness import run_ranks

from gtp_wrap import GTPPolicy, GTPWrap, PolicyError
from gtp_wrap.comm import copy_kernels
from gtp_wrap.comm.copy_engine import CopyEngineCollectives, plan_rounds

gpu = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.parametrize(
    "sizes, capacity", [([1000, 4, 384, 70000], 1024), ([256] * 9, 512), ([6, 4000, 130], 300)]
)
def test_rounds_cover_every_byte_once_within_capacity(sizes: list[int], capacity: int) -> None:
    rounds = plan_rounds(sizes, capacity)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(sizes))}
    for pieces in rounds:
        for p in pieces:
            assert p.offset % 128 == 0 and p.start % 128 == 0
            assert p.offset + p.nbytes <= capacity
            covered[p.index].append((p.start, p.start + p.nbytes))
        spans = sorted((p.offset, p.offset + p.nbytes) for p in pieces)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "pieces overlap"
    for i, size in enumerate(sizes):
        assert sorted(covered[i]) == covered[i], "a tensor's pieces go in order"
        ends = [0] + [e for _, e in covered[i]]
        assert [s for s, _ in covered[i]] == ends[:-1] and ends[-1] == size
    for pieces in rounds[:-1]:  # a round closes only when less than one aligned piece fits
        assert max(p.offset + -(-p.nbytes // 128) * 128 for p in pieces) > capacity - 128


def test_a_round_smaller_than_one_aligned_piece_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 128 bytes"):
        plan_rounds([10], 100)


def test_unknown_collectives_is_a_policy_error() -> None:
    with pytest.raises(PolicyError, match="collectives='nvlink'.*'copy_engine'"):
        GTPPolicy(collectives="nvlink")  # type: ignore[arg-type]


def _wrap_on_cpu(rank: int, world: int) -> str:
    try:
        GTPWrap(torch.nn.Linear(64, 64), {"min_shard_numel": 0, "collectives": "copy_engine"})
    except PolicyError as e:
        return str(e)
    return "no error"


def test_refused_on_cpu() -> None:
    for message in run_ranks(_wrap_on_cpu, 2, timeout=120):
        assert "collectives: process_group" in message and "on cpu" in message, message


# ---- GPU -------------------------------------------------------------------------------------


def _against_nccl(rank: int, world: int) -> dict:
    """Both collectives with a 1 KiB workspace (many rounds, pieces cut mid-tensor) against
    NCCL's, on mixed sizes and dtypes, including an in-place gather."""
    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    ce = CopyEngineCollectives(group, device, nbytes=1024, timeout_s=60)  # type: ignore[arg-type]
    g = torch.Generator(device=device).manual_seed(rank)
    out = {}
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        numels = [3000, 64, 77, 1]
        sends = [torch.randint(0, 100, (n,), device=device, generator=g).to(dtype) for n in numels]
        outs = [torch.empty(world * n, device=device, dtype=dtype) for n in numels]
        inplace = torch.empty(world * 500, device=device, dtype=dtype)
        inplace.view(world, -1)[rank].random_(0, 100, generator=g)
        sends.append(inplace.view(world, -1)[rank])
        outs.append(inplace)
        ce.all_gather(outs, sends).wait()
        refs = [torch.empty_like(o) for o in outs]
        for ref, send in zip(refs, sends):
            dist.all_gather_into_tensor(ref, send.clone())
        out[f"gather {dtype}"] = all(torch.equal(o, r) for o, r in zip(outs, refs))
    # Mixed dtypes in one collective: pieces of different element sizes share each round.
    sends = [
        torch.randn(n, device=device, generator=g).to(dtype)
        for n, dtype in ((700, torch.bfloat16), (301, torch.float32), (999, torch.uint8))
    ]
    outs = [torch.empty(world * s.numel(), device=device, dtype=s.dtype) for s in sends]
    # and an fp32 send cast into a bf16 gather, as the engine's bf16 gathers of fp32 shards
    sends.append(torch.randn(1234, device=device, generator=g))
    outs.append(torch.empty(world * 1234, device=device, dtype=torch.bfloat16))
    ce.all_gather(outs, sends).wait()
    refs = [torch.empty_like(o) for o in outs]
    for ref, send in zip(refs, sends):
        dist.all_gather_into_tensor(ref, send.to(ref.dtype))
    out["gather mixed dtypes"] = all(torch.equal(o, r) for o, r in zip(outs, refs))
    for dtype in (torch.float32, torch.bfloat16):
        for average in (False, True):
            numels = [3000, 64, 77, 1]
            fulls = [torch.randn(world * n, device=device, generator=g).to(dtype) for n in numels]
            outs = [torch.empty(n, device=device, dtype=dtype) for n in numels]
            ce.reduce_scatter(outs, fulls, average).wait()
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            diffs = []
            for o, full in zip(outs, fulls):
                ref = torch.empty_like(o)
                dist.reduce_scatter_tensor(ref, full.clone(), op=op)
                diffs.append((o.float() - ref.float()).abs().max().item())
            out[f"reduce {dtype} average={average}"] = max(diffs)
    torch.cuda.synchronize()
    return out


@gpu
def test_collectives_match_nccl() -> None:
    """Gathers are bit-exact; two-rank sums are the same single addition NCCL does."""
    for got in run_ranks(_against_nccl, 2, timeout=120, backend="nccl"):
        for key, value in got.items():
            if key.startswith("gather"):
                assert value is True, key
            else:
                assert value == 0.0, (key, value)


COPY_ENGINE = {**POLICY, "collectives": "copy_engine"}


def _graphed_vs_eager(rank: int, world: int) -> dict:
    policy = COPY_ENGINE
    out = {}
    for optimizer in OPTIMIZERS[:2]:
        try:
            out[optimizer] = {
                "eager": _train_graphed(rank, False, optimizer, policy),
                "graphed": _train_graphed(rank, True, optimizer, policy),
            }
        except Exception:
            out[optimizer] = {"error": traceback.format_exc()}
    return out


@pytest.mark.skipif(
    not torch.cuda.is_available() or copy_kernels.triton is None, reason="needs Triton on a GPU"
)
@pytest.mark.parametrize("numel", [1, 4095, 4097, 100_003])
def test_fused_kernels_equal_pytorch_ops(numel: int) -> None:
    """The Triton kernels write what the PyTorch fallback writes, bit for bit, on views that
    start off any alignment, with fp32's special values too."""
    g = torch.Generator(device="cuda").manual_seed(numel)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        src = torch.randn(numel + 3, device="cuda", generator=g)[3:]
        a, b = torch.empty(2, numel + 1, device="cuda", dtype=dtype)[:, 1:]
        assert copy_kernels._fused(copy_kernels._MOVED, src, a, b)
        copy_kernels.write_twice(src, a, b)
        assert torch.equal(a, src.to(dtype)) and torch.equal(b, a), dtype
    special = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-45, -0.0, 0.0]
    for dtype in copy_kernels._SUMMED:
        x, y = (torch.randn(numel + 1, device="cuda", generator=g).to(dtype)[1:] for _ in "xy")
        if dtype == torch.float32:  # every pair of special values, where the size allows
            values = torch.tensor(special, device="cuda")
            n = min(numel, len(special) ** 2)
            x[:n] = values.repeat_interleave(len(special))[:n]
            y[:n] = values.repeat(len(special))[:n]
        for average in (False, True):
            out = torch.empty(numel, device="cuda", dtype=dtype)
            assert copy_kernels._fused(copy_kernels._SUMMED, out, x, y)
            copy_kernels.sum_into(out, x, y, average)
            ref = torch.add(x, y)
            ref = ref.div_(2) if average else ref
            torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


@gpu
def test_graphed_step_equals_eager() -> None:
    """The copy-engine collectives are captured with the step and replay bit for bit."""
    for rank, per_rank in enumerate(run_ranks(_graphed_vs_eager, 2, timeout=200, backend="nccl")):
        for optimizer, got in per_rank.items():
            assert "error" not in got, f"rank {rank} {optimizer}:\n{got.get('error')}"
            eager, graphed = got["eager"], got["graphed"]
            assert graphed["losses"] == eager["losses"], optimizer
            for k, v in eager["state"].items():
                assert torch.equal(graphed["state"][k], v), (optimizer, k)
            assert torch.equal(graphed["evals"], eager["evals"])
            # Gathers and reduce-scatters each hold a workspace: 2 and 4 x group_numel bytes.
            assert graphed["ws"] == 6 * GTPPolicy().group_numel, graphed["ws"]


def _partial(rank: int, world: int) -> dict:
    try:
        build = lambda: RoutedGPT(GPT_CFG)  # noqa: E731
        return {"runs": [regions_run(rank, build, g, COPY_ENGINE) for g in (None, 0)]}
    except Exception:
        return {"error": traceback.format_exc()}


@gpu
def test_partial_capture_equals_eager() -> None:
    """Graphed regions inside an eager step: the region's captured collectives and the eager
    ones around it share the workspace, kept apart by the engine's fence before each replay."""
    for rank, got in enumerate(run_ranks(_partial, 2, timeout=100, backend="nccl")):
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        eager, regions = got["runs"]
        assert regions["losses"] == eager["losses"]
        for k, v in eager["state"].items():
            assert torch.equal(regions["state"][k], v), k


# ---- CPU: the collectives' logic on simulated ranks ------------------------------------------


class _SimulatedHandle:
    """Symmetric memory on one host: ranks are threads, workspaces CPU tensors, a barrier a
    thread barrier (counting the barriers each rank queued)."""

    def __init__(self, buffers: list, rank: int, barrier: threading.Barrier) -> None:
        self.buffers, self.rank, self.world_size, self._barrier = (
            buffers,
            rank,
            len(buffers),
            barrier,
        )
        self.barriers = 0

    def get_buffer(self, rank: int, sizes: tuple, dtype: torch.dtype, offset: int = 0):
        flat = self.buffers[rank].view(dtype)
        numel = math.prod(sizes)
        assert offset + numel <= flat.numel(), "a view past the end of a workspace"
        return flat[offset : offset + numel].view(sizes)

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        self.barriers += 1
        self._barrier.wait(timeout=30)


class _NoStream:
    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _simulate(monkeypatch: pytest.MonkeyPatch, world: int, nbytes: int, fn: Callable) -> list:
    """Make `world` CopyEngineCollectives on CPU threads and run `fn(rank, collectives)` on
    each at once."""
    import torch.distributed._symmetric_memory as symm_mem

    buffers: list = [None] * world
    barrier, setup, local = threading.Barrier(world), threading.Barrier(world), threading.local()

    def empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers[local.rank] = torch.full((n,), 0xAB, dtype=dtype)
        return buffers[local.rank]

    def rendezvous(t: torch.Tensor, name: str) -> _SimulatedHandle:
        setup.wait(timeout=30)
        return _SimulatedHandle(buffers, local.rank, barrier)

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    for name in ("Stream", "current_stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: _NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)

    group = types.SimpleNamespace(size=lambda: world, group_name="simulated")
    results: list = [None] * world
    errors: list = []

    def rank_main(rank: int) -> None:
        local.rank = rank
        try:
            ce = CopyEngineCollectives(group, torch.device("cuda", rank), nbytes, 1.0)  # type: ignore[arg-type]
            results[rank] = fn(rank, ce)
        except Exception as e:  # noqa: BLE001 - reported below, after every thread stopped
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world, nbytes", [(2, 1024), (3, 1000), (4, 4096), (5, 300), (8, 1 << 16)])
def test_collectives_on_simulated_ranks(
    monkeypatch: pytest.MonkeyPatch, world: int, nbytes: int
) -> None:
    """Gathers (one in place, one cast) and reduce-scatters of mixed dtypes and sizes, over many
    rounds of a small workspace, equal a reference on 2 to 8 simulated ranks; every rank queues
    the same number of barriers."""
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.float16)
    numels = (1, 300, 77, 1500, 64)
    g = torch.Generator().manual_seed(world)
    sends = [[torch.randint(0, 50, (n,), generator=g).to(d) for n, d in zip(numels, dtypes)]
             for _ in range(world)]  # fmt: skip
    outs = [[torch.empty(world * s.numel(), dtype=s.dtype) for s in per] for per in sends]
    for r in range(world):  # the first gather is in place: the send is part of the output
        outs[r][0].view(world, -1)[r].copy_(sends[r][0])
        sends[r][0] = outs[r][0].view(world, -1)[r]
        # and the last is cast on the way (an fp32 shard into a bf16 gather)
        sends[r].append(torch.randint(-50, 50, (333,), generator=g).float())
        outs[r].append(torch.empty(world * 333, dtype=torch.bfloat16))
    floats = [d if d.is_floating_point else torch.float32 for d in dtypes]
    fulls = [[torch.randint(-8, 8, (world * n,), generator=g).to(d) for n, d in zip(numels, floats)]
             for _ in range(world)]  # fmt: skip
    sums = [[torch.empty(n, dtype=d) for n, d in zip(numels, floats)] for _ in range(world)]
    means = [[torch.empty(n, dtype=d) for n, d in zip(numels, floats)] for _ in range(world)]

    def run(rank: int, ce: CopyEngineCollectives) -> int:
        ce.all_gather(outs[rank], sends[rank]).wait()
        ce.reduce_scatter(sums[rank], fulls[rank], average=False).wait()
        ce.reduce_scatter(means[rank], fulls[rank], average=True).wait()
        return ce._handle.barriers

    barriers = _simulate(monkeypatch, world, nbytes, run)
    assert len(set(barriers)) == 1 and barriers[0] >= 6, barriers
    for r in range(world):
        for i in range(len(numels)):
            assert torch.equal(outs[r][i], torch.cat([sends[s][i] for s in range(world)]))
            # Small integers: every sum is exact in every dtype; means are exact where the
            # division by `world` is.
            total = sum(fulls[s][i].double().view(world, -1)[r] for s in range(world))
            assert torch.equal(sums[r][i].double(), total), (r, i)
            assert torch.allclose(means[r][i].double(), total / world, rtol=1e-2, atol=1e-2)
        cast = torch.cat([sends[s][-1] for s in range(world)]).bfloat16()
        assert torch.equal(outs[r][-1], cast), r


def test_a_send_of_the_wrong_size_raises_before_any_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run(rank: int, ce: CopyEngineCollectives) -> tuple[str, int]:
        outs = [torch.empty(2 * 300), torch.empty(2 * 100)]
        with pytest.raises(ValueError, match="send 1 has 99 elements") as e:
            ce.all_gather(outs, [torch.ones(300), torch.ones(99)])
        return str(e.value), ce._handle.barriers

    for message, barriers in _simulate(monkeypatch, 2, 1024, run):
        assert barriers == 0, message
