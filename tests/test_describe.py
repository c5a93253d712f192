"""gtp_wrap.describe: what the policy did to each parameter, read from the engine."""

from __future__ import annotations

import pytest
from harness import run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPWrap, WrapError

POLICY = {"min_shard_numel": 1000, "param_dtype": "bfloat16", "reduce_dtype": "float32"}


class Small(nn.Module):
    """A tied embedding / head, a weight of odd rows, one below the threshold, norms."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.fc = nn.Linear(32, 33)  # 33 rows: 17 on rank 0, 16 on rank 1
        self.bn = nn.BatchNorm1d(33)
        self.small = nn.Linear(33, 4)  # 132 elements, below min_shard_numel
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight


def _describe(rank: int, world: int) -> dict:
    model = GTPWrap(Small(), POLICY)
    d = gtp_wrap.describe(model)
    return {"rows": [r.__dict__ for r in d.rows], "table": str(d), "sizes": (d.gtp_size, d.dp_size),
            "bytes": (d.sharded_bytes, d.replicated_bytes)}  # fmt: skip


def test_describe_reports_the_policy_per_parameter() -> None:
    for rank, got in enumerate(run_ranks(_describe, 2)):
        rows = {r["fqn"]: r for r in got["rows"]}
        assert list(rows) == ["emb.weight", "fc.weight", "fc.bias", "bn.weight", "bn.bias",
                              "small.weight", "small.bias", "norm.weight", "norm.bias"]  # fmt: skip
        emb, fc = rows["emb.weight"], rows["fc.weight"]
        # Shared: decided by the first rule in order (Linear, through head.weight).
        assert emb["aliases"] == ("head.weight",) and emb["rule"] == "Linear"
        assert "also matched by rule 'Embedding' through 'emb.weight'" in emb["reason"]
        assert (emb["shape"], emb["shard_dim"], emb["group"], emb["group_size"]) == (
            (50, 32),
            0,
            "gtp",
            2,
        )
        assert emb["bytes_per_rank"] == 25 * 32 * 4  # its fp32 rows
        assert fc["bytes_per_rank"] == (17 if rank == 0 else 16) * 32 * 4
        assert (fc["dtype"], fc["compute_dtype"]) == ("float32", "bfloat16")
        assert fc["gathers"] == "bfloat16"  # cast on the way into its gather
        small = rows["small.weight"]
        assert small["shard_dim"] is None and small["rule"] == "Linear"
        assert small["gathers"] is None
        assert small["reason"] == "below min_shard_numel (132 < 1000)"
        assert (small["group"], small["group_size"], small["bytes_per_rank"]) == ("world", 2, 528)
        assert rows["fc.bias"]["reason"] == "no rule" and rows["fc.bias"]["rule"] is None
        # BatchNorm computes in fp32 (norm_in_fp32), LayerNorm in param_dtype.
        assert rows["bn.weight"]["compute_dtype"] == "float32"
        assert rows["norm.weight"]["compute_dtype"] == "bfloat16"
        assert got["sizes"] == (2, 1)
        replicated = sum(r["bytes_per_rank"] for r in got["rows"] if r["shard_dim"] is None)
        assert got["bytes"] == (emb["bytes_per_rank"] + fc["bytes_per_rank"], replicated)
        table = got["table"]
        assert "emb.weight = head.weight" in table and "shard(0)" in table
        assert f"{fc['bytes_per_rank']:,}" in table and "gtp=2 dp=1" in table


def test_describe_an_unwrapped_model_names_the_fix() -> None:
    with pytest.raises(WrapError, match="not wrapped; call GTPWrap"):
        gtp_wrap.describe(nn.Linear(2, 2))
