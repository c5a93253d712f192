"""How each sharded weight travels in its gathers, and the dtypes an engine computes in.

`Precision` resolves a policy's dtype fields once, at wrap time. Each weight then gets one
`Encoding`: what its gathers send (its slot of the flat storage, or its packed FP8 slot), in
what dtype the gather buffer is, and how the gathered buffer becomes the weight a use reads. A
send of another dtype than its gather buffer is cast on its way by the transport (Comm).

[Note: no compute copy] By default no param_dtype copy of the shards is kept: each gather casts
1/N of its weight into its own part of the gather buffer (Comm does, on the stream that moves
the gather: copy-engine collectives thus keep the casts off the compute stream, whose critical
path they lengthened by 2.6 ms per graphed 1.36B step). On 2xH200 (1.36B, batch 1-8) that moved
step time only within run-to-run noise, while the copy (compute_copy, cast once per step) held
1.27 GiB per GPU and put peak memory above FSDP2's. FP8 gathers read packed FP8 slots instead,
and a weight sharded over a group of one, which gathers nothing, keeps the copy its local uses
read: decided per weight, so expert stacks over egtp = 1 keep theirs while the dense weights
beside them, over gtp > 1, cast on the way or gather packed slots.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ..config.policy import GTPPolicy, policy_dtype
from ..errors import PolicyError
from ..geometry import ShardGeometry
from . import fp8, fp8_triton, nvfp4, nvfp4_triton


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of one engine (see GTPPolicy's fields of the same names)."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    # What gathers move instead of the compute dtype: "fp8" or "nvfp4" packed slots (for the
    # weights sharded over more than one rank: a group of one gathers nothing), or None.
    packed: str | None
    fp8_matmul: bool  # FP8 gathers, and F.linear uses of weights that fit run as FP8 GEMMs
    # Every weight not gathered packed keeps a compute-dtype copy (see [Note: no compute copy]).
    compute_copy: bool

    @classmethod
    def resolve(cls, policy: GTPPolicy, gathers: bool, device: torch.device) -> Precision:
        """`gathers`: whether any weight is sharded over more than one rank."""
        if policy.gather_dtype is not None:
            try:
                fp8.fp8_dtype()
            except TypeError as e:
                raise PolicyError(str(e)) from e
        packed = None
        if policy.gather_dtype is not None and gathers:
            packed = "nvfp4" if policy.gather_dtype == "nvfp4" else "fp8"
        fp8_matmul = packed == "fp8" and policy.fp8_matmul
        if fp8_matmul:
            fp8.check_gemm_device(device)
        return cls(
            param_dtype=policy_dtype(policy.param_dtype),
            reduce_dtype=policy_dtype(policy.reduce_dtype),
            packed=packed,
            fp8_matmul=fp8_matmul,
            compute_copy=policy.compute_copy,
        )

    def packs(self, geo: ShardGeometry) -> bool:
        """Whether the gathers of this weight move its packed slot (FP8 or NVFP4)."""
        return self.packed is not None and geo.world > 1

    def keeps_copy(self, geo: ShardGeometry) -> bool:
        """Whether this weight keeps a copy of its shard in the compute dtype: with
        `compute_copy`, or sharded over a group of one (which has no gather to cast it on the
        way), unless its gathers are packed (see [Note: no compute copy])."""
        return not self.packs(geo) and (self.compute_copy or geo.world == 1)

    @property
    def own_linear(self) -> bool:
        """Whether F.linear uses run through the engine's own linear (runtime/uses.py):
        FP8 GEMMs; half-precision compute meeting fp32 reductions (the GEMM then writes fp32
        weight gradients, see [Note: fp32 weight gradients]); and compute in the weights' own
        dtype (it saves the input only, not a view of the weight: no saved-tensor round trip
        per use)."""
        half = self.param_dtype in (torch.bfloat16, torch.float16)
        return (
            self.fp8_matmul
            or self.param_dtype is None
            or (half and self.reduce_dtype == torch.float32)
        )

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype uses of a weight stored in `dtype` compute in."""
        return self.param_dtype or dtype


class Encoding:
    """A gather of one weight sends `send` into a buffer of `dtype`, `world` sends long."""

    __slots__ = ("send", "dtype", "feeds_gemm")
    decodes = False  # whether the gathered buffer must be decoded before a use reads it

    def __init__(self, send: torch.Tensor, dtype: torch.dtype, feeds_gemm: bool = False) -> None:
        self.send = send
        self.dtype = dtype
        self.feeds_gemm = feeds_gemm  # F.linear uses take the gathered buffer as it came

    def decode_into(self, gathered: torch.Tensor, out: torch.Tensor, geo: ShardGeometry) -> None:
        raise NotImplementedError(f"{type(self).__name__} gathers the weight itself")

    @property
    def wire(self) -> str:
        """What a gather moves, in words: the dtype of the weight itself, or the packing."""
        return str(self.dtype).removeprefix("torch.")


class PlainEncoding(Encoding):
    """The slot itself, or cast on its way into a gather buffer of the compute dtype: the
    gathered buffer is the padded full weight."""

    __slots__ = ()


class FP8Encoding(Encoding):
    """The packed FP8 slot (payload, then one fp32 scale per `block` elements), dequantized
    into the compute dtype for each use, or fed as it is to the FP8 GEMM (`feeds_gemm`)."""

    __slots__ = ("block", "fused")
    decodes = True
    wire = "fp8"  # type: ignore[assignment]

    def __init__(self, send: torch.Tensor, block: int, fused: bool, by_row: bool) -> None:
        super().__init__(send, torch.uint8, feeds_gemm=by_row)
        self.block = block
        self.fused = fused  # the Triton dequantization runs here (fp8_triton.available)

    def decode_into(self, gathered: torch.Tensor, out: torch.Tensor, geo: ShardGeometry) -> None:
        fp8.dequantize_into(gathered, geo.world, geo.slot_numel, out, self.block, fused=self.fused)


class NVFP4Encoding(Encoding):
    """The packed NVFP4 slot (see [Note: NVFP4 layout] in precision/nvfp4.py), decoded into
    the compute dtype for each use."""

    __slots__ = ("fused",)
    decodes = True
    wire = "nvfp4"  # type: ignore[assignment]

    def __init__(self, send: torch.Tensor, fused: bool) -> None:
        super().__init__(send, torch.uint8)
        self.fused = fused  # the Triton decoding runs here (nvfp4_triton.available)

    def decode_into(self, gathered: torch.Tensor, out: torch.Tensor, geo: ShardGeometry) -> None:
        nvfp4.dequantize_into(gathered, geo.world, geo.slot_numel, out, fused=self.fused)


class Packing(Protocol):
    """The packed slots gathers send from, re-quantized from the shards once per step when
    they changed (see [Note: one version counter] in core/storage.py)."""

    slots: list[torch.Tensor]

    def refresh(self) -> int:
        """Re-quantize the flat tensors whose shards changed; return how many were."""
        ...

    def invalidate(self) -> None:
        """Make the next `refresh` re-quantize everything (the shards changed unseen)."""
        ...


def _packed_slots(
    geometries: list[ShardGeometry], sizes: list[int], params: dict[torch.dtype, torch.Tensor]
) -> list[torch.Tensor]:
    """One slot of `sizes[i]` bytes per weight, in one zeroed byte buffer per flat dtype, each
    slot starting on 16 bytes (its scales stay 4-byte aligned)."""
    ends: dict[torch.dtype, int] = {}
    starts = []
    for geo, size in zip(geometries, sizes):
        start = -(-ends.get(geo.dtype, 0) // 16) * 16
        ends[geo.dtype] = start + size
        starts.append(start)
    packed = {
        dtype: torch.zeros(n, dtype=torch.uint8, device=params[dtype].device)
        for dtype, n in ends.items()
    }
    return [
        packed[geo.dtype][start : start + size]
        for geo, size, start in zip(geometries, sizes, starts)
    ]


class NVFP4Packing:
    """The NVFP4 slots of every sharded weight: each shard quantized on its own (its own
    shard scale), once per step when its flat tensor changed."""

    def __init__(
        self, geometries: list[ShardGeometry], params: dict[torch.dtype, torch.Tensor]
    ) -> None:
        self.params = params
        self.slots = _packed_slots(
            geometries, [nvfp4.packed_bytes(g.slot_numel) for g in geometries], params
        )
        self._shards: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for geo, slot in zip(geometries, self.slots):
            shard = params[geo.dtype][geo.offset : geo.offset + geo.slot_numel]
            self._shards.setdefault(geo.dtype, []).append((shard, slot))
        self._version: dict[torch.dtype, int] = {}

    def refresh(self) -> int:
        done = 0
        for dtype, shards in self._shards.items():
            flat = self.params[dtype]
            if self._version.get(dtype) == flat._version:
                continue
            with torch.no_grad():
                for shard, slot in shards:
                    nvfp4.quantize_into(shard, slot)
            self._version[dtype] = flat._version
            done += 1
        return done

    def invalidate(self) -> None:
        self._version.clear()


class FP8Packing:
    """The packed FP8 slots of every sharded weight, re-quantized from the shards once per
    step when they changed (see [Note: one version counter] in core/storage.py).

    Block-scaled slots come from one quantization of each whole flat tensor; row-scaled slots
    (FP8 GEMMs) each from their own rows.
    """

    def __init__(
        self,
        geometries: list[ShardGeometry],
        by_row: list[bool],
        params: dict[torch.dtype, torch.Tensor],
    ) -> None:
        self.params = params
        self.blocks = [g.row_numel if row else fp8.BLOCK for g, row in zip(geometries, by_row)]
        self.slots = _packed_slots(
            geometries,
            [fp8.packed_bytes(g.slot_numel, block) for g, block in zip(geometries, self.blocks)],
            params,
        )
        self._version: dict[torch.dtype, int] = {}
        # Per dtype: the block-scaled targets (payloads, scales, block ranges of the flat) and
        # the row-scaled ones (rows of the flat, payload, scale).
        self._blocks: dict[torch.dtype, tuple[list, list, list]] = {}
        self._rows: dict[torch.dtype, list[tuple[torch.Tensor, ...]]] = {}
        for geo in geometries:
            self._blocks.setdefault(geo.dtype, ([], [], []))
            self._rows.setdefault(geo.dtype, [])
        for geo, block, row_scaled, slot in zip(geometries, self.blocks, by_row, self.slots):
            q = fp8.padded(geo.slot_numel, block)
            payload, scale = slot[:q], slot[q:].view(torch.float32)
            if row_scaled:
                rows = params[geo.dtype][geo.offset : geo.offset + q].view(-1, block)
                self._rows[geo.dtype].append((rows, payload, scale))
                continue
            first, nblocks = geo.offset // fp8.BLOCK, q // fp8.BLOCK
            payloads, scales, ranges = self._blocks[geo.dtype]
            payloads.append(payload)
            scales.append(scale)
            ranges.append((first, first + nblocks))
        # Each flat's block-scaled span: its gathered weights come first (geometry.lay_out), so
        # the quantization stops at the last of them, short of the weights of groups of one.
        self._ends = {
            dtype: max((b for _, b in ranges), default=0) * fp8.BLOCK
            for dtype, (_, _, ranges) in self._blocks.items()
        }

    def refresh(self) -> int:
        done = 0
        for dtype, flat in self.params.items():
            if dtype not in self._rows or self._version.get(dtype) == flat._version:
                continue
            with torch.no_grad():
                payloads, scales, ranges = self._blocks[dtype]
                if payloads:
                    payload, scale = fp8.quantize(flat[: self._ends[dtype]].view(-1, fp8.BLOCK))
                    torch._foreach_copy_(
                        payloads + scales,
                        [payload[a:b].reshape(-1) for a, b in ranges]
                        + [scale[a:b] for a, b in ranges],
                    )
                for rows, row_payload, row_scale in self._rows[dtype]:
                    q, s = fp8.quantize(rows)
                    row_payload.copy_(q.reshape(-1))
                    row_scale.copy_(s)
            self._version[dtype] = flat._version
            done += 1
        return done

    def invalidate(self) -> None:
        self._version.clear()


def make_encodings(
    precision: Precision,
    geometries: list[ShardGeometry],
    names: list[str],
    slots: list[torch.Tensor],
    params: dict[torch.dtype, torch.Tensor],
    device: torch.device,
) -> tuple[list[Encoding], Packing | None]:
    """Each weight's encoding, and the packing the packed ones send from (FP8 and NVFP4
    gathers only). `slots`: each weight's compute slot (core/storage.py), which a plain
    encoding sends."""
    packed = [i for i, geo in enumerate(geometries) if precision.packs(geo)]
    geos = [geometries[i] for i in packed]
    packing: Packing | None = None
    encodings: dict[int, Encoding] = {}
    if precision.packed == "nvfp4" and packed:
        packing = NVFP4Packing(geos, params)
        for i, geo, slot in zip(packed, geos, packing.slots):
            encodings[i] = NVFP4Encoding(slot, nvfp4_triton.available(device, geo.slot_numel))
    elif packed:
        by_row = [precision.fp8_matmul and fp8.fits_gemm(geo) for geo in geos]
        if precision.fp8_matmul:
            fp8.warn_unfit([names[i] for i in packed], geos, by_row)
            fp8.warn_local(names, geometries)
        fp8_packing = FP8Packing(geos, by_row, params)
        for i, geo, slot, block, row in zip(
            packed, geos, fp8_packing.slots, fp8_packing.blocks, by_row
        ):
            encodings[i] = FP8Encoding(
                slot, block, fp8_triton.available(device, geo.slot_numel), row
            )
        packing = fp8_packing
    return [
        encodings[i] if i in encodings else PlainEncoding(slot, precision.compute_dtype(geo.dtype))
        for i, (geo, slot) in enumerate(zip(geometries, slots))
    ], packing
