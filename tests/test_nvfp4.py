"""NVFP4 gathers (gather_dtype: nvfp4): the encoding against a brute-force reference, its error
bound and size, and a wrapped model whose uses read exactly the decoded shards."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import textwrap

import pytest
import torch
from harness import run_ranks
from torch import nn

import gtp_wrap
from gtp_wrap import GTPPolicy, GTPWrap, PolicyError
from gtp_wrap.precision import nvfp4, nvfp4_triton

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _readme_policy() -> GTPPolicy:
    """The policy of the README's NVFP4 snippet, sharding this test's small weight too."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"```python\n([^`]*gather_dtype=\"nvfp4\"[^`]*)```", readme)
    assert block is not None, "the README's NVFP4 paragraph has no python block"
    scope: dict = {"GTPPolicy": GTPPolicy}
    exec(textwrap.dedent(block.group(1)), scope)  # noqa: S102 - the README's own code
    return dataclasses.replace(scope["policy"], min_shard_numel=0)


def _reference(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's values of `x` (1-D), computed another way: scales as the layout defines them,
    then each element the grid value nearest it, a tie going to the even code."""
    q = nvfp4.padded(x.numel())
    blocks = torch.zeros(q, dtype=torch.float32)
    blocks[: x.numel()] = x
    blocks = blocks.view(-1, 16)
    shard = max(blocks.abs().max().item() / (6 * 448), torch.finfo(torch.float32).tiny)
    shard = torch.tensor(shard, dtype=torch.float32)
    block = (blocks.abs().amax(1) / 6 / shard).clamp(max=448).to(torch.float8_e4m3fn).float()
    scale = block * shard  # fp32, as the decoder multiplies them
    out = torch.zeros_like(blocks)
    for i in range(blocks.shape[0]):
        for j in range(16):
            if scale[i] == 0:
                continue
            v = (blocks[i, j] / scale[i]).double()
            dist = (GRID - min(v.abs().item(), 6.0)).abs()
            best = torch.nonzero(dist == dist.min()).flatten()
            code = best[0] if len(best) == 1 else best[best % 2 == 0][0]  # tie: the even code
            out[i, j] = (GRID[code].float() * (-1 if v < 0 else 1)) * scale[i]
    return out.flatten()[: x.numel()]


@pytest.mark.parametrize("numel", [16, 37, 300])
def test_encoding_matches_a_brute_force_reference(numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)
    slot = torch.zeros(nvfp4.packed_bytes(numel), dtype=torch.uint8)
    nvfp4.quantize_into(x, slot)
    out = torch.empty(numel)
    nvfp4.dequantize_into(slot, 1, numel, out)
    assert torch.equal(out, _reference(x))


def test_ties_round_to_the_even_code_and_grid_values_are_exact() -> None:
    # One block whose amax is 6: block scale 1 (times the shard scale, a power of two here).
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0.0])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6, 0, 0, 0, 0, 0, 0, 0, 0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6, 0, 0, 0, 0, 0, 0, 0, 0])
    for x, expected in ((grid, grid), (ties, want)):
        slot = torch.zeros(nvfp4.packed_bytes(16), dtype=torch.uint8)
        nvfp4.quantize_into(x * 2.0**-5, slot)
        out = torch.empty(16)
        nvfp4.dequantize_into(slot, 1, 16, out)
        assert torch.equal(out, expected * 2.0**-5)


def test_error_is_within_half_a_grid_step_and_size_is_0_5625_bytes() -> None:
    """Blocks within 1e4 of the shard's largest (block scales E4M3 normals): each element is
    within half a grid step of its scaled value. A block 1e7 below the largest decodes to
    zeros: E4M3 block scales span 2**-9 to 448 (see [Note: NVFP4 layout])."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 16, generator=g) * torch.logspace(-4, 0, 64).repeat_interleave(16)
    slot = torch.zeros(nvfp4.packed_bytes(x.numel()), dtype=torch.uint8)
    nvfp4.quantize_into(x, slot)
    out = torch.empty(x.numel())
    nvfp4.dequantize_into(slot, 1, x.numel(), out)
    shard = slot[:4].view(torch.float32)
    scale = slot[4 : 4 + 64].view(torch.float8_e4m3fn).float() * shard
    scaled = (x.view(64, 16).abs() / scale[:, None]).clamp(max=6)
    half_step = torch.where(scaled < 2, 0.25, torch.where(scaled < 4, 0.5, 1.0))
    assert ((out - x).view(64, 16).abs() <= half_step * scale[:, None] * (1 + 1e-6)).all()
    assert nvfp4.packed_bytes(x.numel()) == 4 + 64 + x.numel() // 2  # 0.5625 B + 4 per shard
    x[:16] = 1e-7
    nvfp4.quantize_into(x, slot)
    nvfp4.dequantize_into(slot, 1, x.numel(), out)
    assert (out[:16] == 0).all()


class _Reads(nn.Module):
    """Returns its weight as a use reads it (times one: exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 48, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.weight * 1 + 0 * x.sum()


def _wrapped(rank: int, world: int, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    model = _Reads()
    full = model.lin.weight.detach().clone()
    GTPWrap(model.to(device), _readme_policy())
    gtp_wrap.reset_stats(model)
    used = [model(torch.ones(2, 64, device=device)).detach().cpu() for _ in range(2)]
    return {"full": full, "used": used, "stats": gtp_wrap.stats(model)}


def test_uses_read_the_decoded_shards_and_gathers_move_0_56_bytes_per_element() -> None:
    for r in run_ranks(_wrapped, 2):
        want = torch.cat([_reference(rows.flatten()).view_as(rows) for rows in r["full"].chunk(2)])
        for used in r["used"]:
            assert used.dtype == torch.bfloat16
            assert torch.equal(used.float(), want.bfloat16().float())
        stats = r["stats"]
        per_element = stats["bytes_gathered"] / stats["gathers"] / (48 * 64)
        assert 0.5625 <= per_element < 0.5625 + 16 / (48 * 64), per_element
        assert stats["weight_casts"] == 1  # quantized once: the shards did not change


def test_nvfp4_policy_is_checked() -> None:
    with pytest.raises(PolicyError, match="'nvfp4' or null"):
        GTPPolicy(gather_dtype="fp4")
    with pytest.raises(PolicyError, match="fp8_matmul"):
        GTPPolicy(gather_dtype="nvfp4", param_dtype="bfloat16", fp8_matmul=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("numel", [16 * 4096, 1000, 37])
def test_fused_decoding_on_cuda_is_bitwise_the_torch_path(numel: int) -> None:
    """The Triton kernel writes what PyTorch's kernels write: the E2M1 value times the fp32
    product of the two scales, rounded once to bf16 (padded slots included)."""
    g = torch.Generator().manual_seed(0)
    slots = torch.zeros(2, nvfp4.packed_bytes(numel), dtype=torch.uint8)
    for slot in slots:
        nvfp4.quantize_into(torch.randn(numel, generator=g) * 3, slot)
    want = torch.empty(2 * numel, dtype=torch.bfloat16)
    nvfp4.dequantize_into(slots.flatten(), 2, numel, want)
    out = torch.empty(2 * numel, dtype=torch.bfloat16, device="cuda")
    assert nvfp4_triton.available(out.device, numel)
    nvfp4.dequantize_into(slots.flatten().cuda(), 2, numel, out, fused=True)
    assert torch.equal(out.cpu(), want)


def _wrapped_cuda(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    return _wrapped(rank, world, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_uses_read_the_decoded_shards() -> None:
    for r in run_ranks(_wrapped_cuda, 2, backend="nccl"):
        want = torch.cat([_reference(rows.flatten()).view_as(rows) for rows in r["full"].chunk(2)])
        for used in r["used"]:
            assert torch.equal(used.float(), want.bfloat16().float())
