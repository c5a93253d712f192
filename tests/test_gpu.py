"""The parity cases on CUDA with NCCL (2 GPUs, and 4 or 8 where the machine has them, on one
axis and on ("dp", "gtp") meshes): gathers and reduce-scatters on NCCL's streams.

Each rank trains the wrapped model and, on its own GPU, the unsharded reference on the whole
batch; TF32 is off so both sides do the same fp32 arithmetic.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from harness import cached_ranks, mesh_2d, run_ranks
from linear_cases import MLP, TOL, compare, inputs, reference
from parity_cases import CASES, model_of, train_case
from precision_cases import (
    BF16,
    FP8_GEMM,
    check_weight_grads_are_rounded_once,
    linear_grads,
    packed_slots,
    train_gpt,
)

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.precision import fp8, fp8_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


# Meshes by name: a world of N on one gtp axis, or DPxGTP; those beyond this machine's GPUs skip.
NCCL_MESHES = {"2": (1, 2), "4": (1, 4), "8": (1, 8), "2x2": (2, 2), "2x4": (2, 4)}


def _nccl_cases(rank: int, world: int, collectives: str, dp: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", rank)
    mesh = mesh_2d(dp, world // dp, "cuda") if dp > 1 else None
    out = {}
    for name, case in CASES.items():
        try:
            ref_model = model_of(case).to(device)
            summed = case.policy.get("loss_reduction") == "sum"
            ref = train_case(
                case, ref_model, 0, 1, wrapped=False, loss_scale=world if summed else 1.0
            )
            policy = {**case.policy, "collectives": collectives}
            model = GTPWrap(model_of(case).to(device), policy, mesh=mesh)
            got = train_case(case, model, rank, world, wrapped=True)
            full = gtp_wrap.full_state_dict(model)
            param_diff = max(
                (full[k] - v.cpu()).abs().max().item() for k, v in ref_model.state_dict().items()
            )
            losses = torch.tensor(got["losses"], device=device)
            torch.distributed.all_reduce(losses)
            loss_diff = (losses.cpu() / world - torch.tensor(ref["losses"])).abs().max().item()
            out[name] = {"param_diff": param_diff, "loss_diff": loss_diff}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.mark.parametrize("collectives", ["process_group", "copy_engine"])
@pytest.mark.parametrize("name", list(CASES))
def test_nccl_parity(name: str, collectives: str) -> None:
    _check_parity(name, collectives, "2")


@pytest.mark.parametrize("mesh", [m for m in NCCL_MESHES if m != "2"])
@pytest.mark.parametrize("name", list(CASES))
def test_nccl_parity_on_more_gpus(name: str, mesh: str) -> None:
    """gtp4 and gtp8 on one axis, and dp x gtp meshes (the dp all-reduce after the gtp
    reduce-scatter), where the machine has the GPUs."""
    dp, gtp = NCCL_MESHES[mesh]
    if torch.cuda.device_count() < dp * gtp:
        pytest.skip(f"needs {dp * gtp} CUDA GPUs")
    _check_parity(name, "process_group", mesh)


def _check_parity(name: str, collectives: str, mesh: str) -> None:
    dp, gtp = NCCL_MESHES[mesh]
    results = cached_ranks(_nccl_cases, dp * gtp, collectives, dp, timeout=300, backend="nccl")
    for rank, per_case in enumerate(results):
        got = per_case[name]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        assert got["param_diff"] < 1e-4, got
        assert got["loss_diff"] < 1e-4, got


def test_weight_gradients_come_out_of_the_gemm_in_fp32() -> None:
    """On CUDA the weight-gradient GEMM writes fp32 itself (torch.mm's out_dtype)."""
    results = run_ranks(linear_grads, 2, BF16, True, backend="nccl")
    check_weight_grads_are_rounded_once(results, dx_tol=1e-2)


def _dtype_pairs(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    x = inputs(world)[rank].to(device)

    def loss_of(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().square().sum()

    ref, out = reference(world, loss_of), {}
    for param_dtype, reduce_dtype in (("float32", "bfloat16"), ("bfloat16", "float16")):
        torch.manual_seed(0)
        policy = {"min_shard_numel": 0, "param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        model = GTPWrap(MLP().to(device), policy)
        loss_of(model, x.clone().requires_grad_()).backward()
        out[f"{param_dtype}/{reduce_dtype}"] = max(compare(model, ref).values())
    return out


def test_other_dtype_pairs_keep_autograds_linear() -> None:
    """Only bf16/fp16 compute with fp32 reductions takes the engine's linear; other pairs the
    policy allows train through autograd's (the fp32-output GEMM takes no other pair)."""
    for errors in run_ranks(_dtype_pairs, 2, timeout=120, backend="nccl"):
        assert max(errors.values()) < TOL, errors


def test_fp8_gemm_on_hopper_trains_like_bf16() -> None:
    """fp8_matmul runs torch._scaled_mm on the GPU's FP8 tensor cores; 100 steps of the
    reference GPT end within 2 % of bf16 gathers, with every Linear an FP8 GEMM."""
    bf16 = run_ranks(train_gpt, 2, BF16, 176, 100, True, timeout=200, backend="nccl")
    low = run_ranks(train_gpt, 2, FP8_GEMM, 176, 100, True, timeout=200, backend="nccl")
    mean = [sum(r["loss"] for r in runs) / 2 for runs in (bf16, low)]
    assert abs(mean[1] - mean[0]) / mean[0] < 0.02, mean
    assert low[0]["stats"]["fp8_matmuls"] == 11


@pytest.mark.parametrize("numel, block", [(128 * 4096, 128), (1000, 128), (2048 * 64, 2048)])
def test_fused_fp8_dequantization_is_exact(numel: int, block: int) -> None:
    """The Triton kernel gives each element its FP8 value times its block's fp32 scale, rounded
    once to bf16: bitwise what fp32 arithmetic gives (padded and row-scaled slots included)."""
    packed, expected = packed_slots(numel, block)
    out = torch.empty(2 * numel, dtype=torch.bfloat16, device="cuda")
    assert fp8_triton.available(out.device, numel)
    fp8.dequantize_into(packed.cuda(), 2, numel, out, block, fused=True)
    assert torch.equal(out.cpu(), expected)
