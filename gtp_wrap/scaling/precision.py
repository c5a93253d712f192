"""Precision policy of a plan: bytes per element on the wire and in memory.

Gathers carry `gather` encoded elements (bf16, FP8 with its block scales, NVFP4 with its
scales); GEMMs compute in bf16, so an encoded gather is decoded per use (at the cluster's
measured decode rate) and the shards encoded once per step. Gradients are reduced in
`reduce` and kept with fp32 masters and AdamW's two fp32 moments, as `gtp-train`'s bf16/fp8
policies do.
"""

from __future__ import annotations

import dataclasses

# Bytes per element: FP8 is 1 byte plus one fp32 scale per 128 elements (1.031, measured by
# `gtp_wrap.stats` on CPU, RESULTS.md "FP8 gathers"); NVFP4 is 4 bits plus one FP8 scale per
# 16 elements (0.5 + 1/16 = 0.5625).
GATHER_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.03125, "nvfp4": 0.5625}
REDUCE_BYTES = {"fp32": 4.0, "bf16": 2.0}
COMPUTE_BYTES = 2.0  # bf16 GEMM operands


class PrecisionError(ValueError):
    """A dtype the cost model does not know."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """`gather`: the dtype weights travel in (fp32 computes in fp32: no cast, 4-byte GEMM
    operands); `reduce`: the gradients' reduce-scatter dtype; `master`, `grad`, `optimizer`:
    bytes per shard element kept between steps (fp32 masters, fp32 grads, AdamW's m and v)."""

    gather: str = "bf16"
    reduce: str = "fp32"
    master: float = 4.0
    grad: float = 4.0
    optimizer: float = 8.0

    def __post_init__(self) -> None:
        if self.gather not in GATHER_BYTES:
            raise PrecisionError(
                f"gather dtype {self.gather!r} is unknown; use one of {', '.join(GATHER_BYTES)}"
            )
        if self.reduce not in REDUCE_BYTES:
            raise PrecisionError(
                f"reduce dtype {self.reduce!r} is unknown; use one of {', '.join(REDUCE_BYTES)}"
            )

    @property
    def gather_bytes(self) -> float:
        return GATHER_BYTES[self.gather]

    @property
    def reduce_bytes(self) -> float:
        return REDUCE_BYTES[self.reduce]

    @property
    def compute_bytes(self) -> float:
        """Bytes per element of a gathered weight as the GEMM reads it."""
        return 4.0 if self.gather == "fp32" else COMPUTE_BYTES

    @property
    def encoded(self) -> bool:
        """Whether gathers travel in a format GEMMs cannot read (decoded per use)."""
        return self.gather in ("fp8", "nvfp4")

    def cast_bytes_per_shard_element(self) -> float:
        """HBM bytes per shard element that a gather's cast (or a step's encode) moves: read
        the fp32 master, write the gathered dtype. fp32 gathers cast nothing."""
        return 0.0 if self.gather == "fp32" else self.master + self.gather_bytes
