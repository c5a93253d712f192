"""torch.compile on a wrapped model: `gtp_wrap.compile` runs each block compiled on its
gathered weights. Compiled training equals eager GTP training (losses to 1e-5 relative,
gradients and parameters to float rounding), compiles once per block class, and keeps the
engine's chain: the same gathers, prefetched, and weights re-gathered in backward.
"""

from __future__ import annotations

import collections
import copy
import functools
import pathlib
import re
from typing import Any

import pytest
import torch
from harness import cached_ranks, caught, local_rows, run_ranks
from models import TinyGPT, tiny_llama_config
from precision_cases import FP8_GEMM
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

import gtp_wrap
from gtp_wrap import GTPWrap
from gtp_wrap.app.model import GPT, GPTConfig
from gtp_wrap.errors import WrapError
from gtp_wrap.runtime.engine import engine_of

STEPS = 3
POLICY = {"min_shard_numel": 0, "collective_timeout_s": 60}


def _gpt() -> torch.nn.Module:
    return GPT(GPTConfig(d=64, layers=3, heads=4, ffn=96, max_seq=32))


def _llama() -> torch.nn.Module:
    # Training runs without a KV cache: HF's cache makes Dynamo guard on each layer's entry,
    # so every layer would compile a graph of its own.
    return LlamaForCausalLM(tiny_llama_config(use_cache=False))


MODELS = {  # name: (build, vocab, micro-batches per step)
    "gpt": (_gpt, 256, 1),
    "gpt_accumulate": (_gpt, 256, 2),
    "checkpointed": (functools.partial(TinyGPT, ckpt=True), 48, 1),
    "hf_llama": (_llama, 64, 1),
}


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(next(model.parameters()).device)
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _train(name: str, rank: int, mode: str, device: str = "cpu") -> dict:
    """STEPS AdamW steps of model `name`: eager, compiled, or eager with gather_per_block;
    what the tests compare."""
    build, vocab, micro = MODELS[name]
    torch.manual_seed(0)
    model = GTPWrap(build().to(device), POLICY)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if mode == "compiled":
        gtp_wrap.compile(model)
    elif mode == "per_block":
        gtp_wrap.gather_per_block(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)
    out: dict = {"losses": [], "graphs": []}
    for step in range(STEPS):
        for m in range(micro):
            ids = torch.randint(0, vocab, (2, 16), generator=data)
            with gtp_wrap.no_sync(model) if m < micro - 1 else torch.enable_grad():
                loss = _loss(model, ids)
                loss.backward()
            out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: p.grad.cpu() for n, p in model.named_parameters()}
            gtp_wrap.reset_stats(model)
        opt.step()
        opt.zero_grad()
        out["graphs"].append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    out["stats"] = gtp_wrap.stats(model)
    out["params"] = gtp_wrap.full_state_dict(model)
    out["persistent_with_history"] = _persistent_with_history(model)
    with torch.no_grad():
        out["eval"] = _loss(model, torch.randint(0, vocab, (2, 16), generator=data)).item()
    return out


def _persistent_with_history(model: torch.nn.Module) -> int:
    """How many of the engine's tensors that outlive a pass (the sharded weights' local copies,
    the replicated weights' compute-dtype casts) became part of an autograd graph: a block's
    node must hand out views of them, never the tensors themselves."""
    engine = engine_of(model)
    kept = [w.local for w in engine.weights] + [c.cast for c in engine.casts.cast_weights]
    return sum(t.grad_fn is not None or t.requires_grad for t in kept)


def _readme_snippet() -> str:
    """The code block of the README's torch.compile section."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## torch.compile\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's torch.compile section has no python block"
    return match.group(1)


def _run_readme(compiled: bool) -> list[float]:
    """The README's snippet (without its gtp_wrap.compile line for the eager run): the losses."""
    code = _readme_snippet()
    assert "gtp_wrap.compile(model)" in code
    code = code.replace('dist.init_process_group("gloo")', "pass")  # the ranks have their group
    if not compiled:
        code = code.replace("gtp_wrap.compile(model)", "pass")
    code = code.replace("loss.backward()", "loss.backward()\n    losses.append(loss.item())")
    scope: dict = {"losses": []}
    torch._dynamo.reset()
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    return scope["losses"]


class _ReadsOutside(torch.nn.Module):
    """A block that reads a weight of a module outside it (kept out of its submodules)."""

    def __init__(self, outside: torch.nn.Linear) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.__dict__["outside"] = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.outside.weight


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList([_ReadsOutside(self.first)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.first(x))


class _Experts(torch.nn.Module):
    """A block whose rank picks its expert: rank r runs expert r (as MoE routing may)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[torch.distributed.get_rank()](x)


class _Routed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Experts()])
        self.out = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks[0](x))


def _routed_grads(rank: int) -> dict:
    """Gradients of the routed model per block, against the unwrapped model on both ranks'
    inputs (each through its own expert), averaged as data-parallel training averages."""
    torch.manual_seed(0)
    ref = _Routed()
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    torch.manual_seed(0)
    model = gtp_wrap.gather_per_block(GTPWrap(_Routed(), POLICY))
    model(xs[rank]).square().mean().backward()
    loss = sum(ref.out(ref.blocks[0].experts[r](x)).square().mean() for r, x in enumerate(xs))
    (loss / 2).backward()
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "want": {n: p.grad.clone() for n, p in ref.named_parameters()},
    }


def _requested_grads(mode: str) -> dict:
    """backward(inputs=[a bias]) through a block: which parameters get a .grad."""
    torch.manual_seed(0)
    model = GTPWrap(TinyGPT(), {**POLICY, "param_dtype": "bfloat16"})
    if mode == "per_block":
        gtp_wrap.gather_per_block(model)
    bias = model.blocks[0].fc.bias
    _loss(model, torch.randint(0, 48, (2, 16))).backward(inputs=[bias])
    return {n: p.grad is not None for n, p in model.named_parameters()}


class _Scales(torch.nn.Module):
    """A block whose forward scales its weight in place (as an Embedding's max_norm renorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.5)
        return self.fc(x)


def _misuse() -> dict:
    torch.manual_seed(0)
    writer = GTPWrap(torch.nn.Sequential(_Scales()), POLICY)
    gtp_wrap.gather_per_block(writer, blocks=[writer[0]])
    with torch.no_grad():  # with grad, autograd itself refuses the write to a Function's view
        written = caught(lambda: writer(torch.randn(2, 32)))
    model = gtp_wrap.gather_per_block(GTPWrap(TinyGPT(), POLICY))
    alone = caught(lambda: model.blocks[0].fc(torch.randn(2, 32)))
    nested = GTPWrap(TinyGPT(), POLICY)
    gtp_wrap.gather_per_block(nested, blocks=[nested.blocks[0].fc])
    inner = caught(lambda: gtp_wrap.gather_per_block(nested, blocks=[nested.blocks[0].fc]))
    # A block around one already on gathered weights takes it over.
    outer = caught(lambda: gtp_wrap.gather_per_block(nested))
    released = "forward" not in vars(nested.blocks[0].fc)
    return {
        "alone": alone,
        "inner": inner,
        "outer": f"{outer} | released: {released}",
        "written": written,
    }


def _block_alone() -> dict:
    """A block on gathered weights called on its own, outside any pass of the model: its
    output and its weights' gradients are the unwrapped block's; a call that raises leaves no
    pass open (the model's next forward runs)."""
    torch.manual_seed(0)
    plain = TinyGPT()
    model = gtp_wrap.gather_per_block(GTPWrap(copy.deepcopy(plain), POLICY))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    out = model.blocks[0](x)
    out.square().sum().backward()
    want = plain.blocks[0](x)
    want.square().sum().backward()
    mine = dict(model.blocks[0].named_parameters())
    grads = {n: (mine[n].grad, local_rows(mine[n], p.grad))  # both ranks' inputs are x
             for n, p in plain.blocks[0].named_parameters()}  # fmt: skip
    engine = engine_of(model)

    def left_open() -> tuple[int, int]:  # passes and owner calls still open
        return len(engine.passes.stack), len(engine.owners._opened)

    raised = caught(lambda: model.blocks[0](torch.randn(2, 5, 7)))
    after_raise = left_open()
    opened = engine.open_forward

    def open_then_fail(*args: Any, **kwargs: Any) -> Any:  # as an input cast running out of memory
        opened(*args, **kwargs)
        raise RuntimeError("open failed")

    engine.open_forward = open_then_fail  # type: ignore[method-assign]
    failed_open = caught(lambda: model.blocks[0](x))
    del engine.open_forward
    after_failed_open = left_open()
    after = model(torch.randint(0, 48, (2, 5))).shape
    return {"out": (out.detach(), want.detach()), "raised": raised, "after": tuple(after),
            "grads": grads, "failed_open": failed_open,
            "left_open": [after_raise, after_failed_open, left_open()]}  # fmt: skip


class _Looped(torch.nn.Module):
    """One block called twice a forward: the same weights at two depths."""

    def __init__(self) -> None:
        super().__init__()
        block = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)
        )
        self.blocks = torch.nn.ModuleList([block])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.blocks[0](x)
        return self.head(x)


def _groups(model: torch.nn.Module) -> dict[str, list[list[str]]]:
    """Per pass kind, the recorded chain's groups as lists of weight names."""
    engine = engine_of(model)
    chains = {}
    for (kind, _, _), chain in engine.passes.chains.items():
        groups: dict[int, list[str]] = {}
        for position, index in enumerate(chain.order):
            groups.setdefault(chain.group_of[position], []).append(engine.weights[index].fqn)
        chains[kind.value] = list(groups.values())
    return chains


def _block_chains() -> dict:
    """group_numel=0 (a collective per weight), per use and with blocks on gathered weights:
    the chains' groups (weight names per group, per pass kind) and the losses of 3 steps; and
    the groups of a block called twice a pass."""
    torch.manual_seed(0)
    looped = gtp_wrap.gather_per_block(GTPWrap(_Looped(), {**POLICY, "group_numel": 0}))
    for _ in range(2):
        looped(torch.randn(3, 16)).sum().backward()
    out: dict = {"looped": _groups(looped)}
    for mode in ("eager", "per_block"):
        torch.manual_seed(0)
        model = GTPWrap(_gpt(), {**POLICY, "group_numel": 0})
        if mode == "per_block":
            gtp_wrap.gather_per_block(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(STEPS):
            loss = _loss(model, torch.randint(0, 256, (2, 16), generator=data))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[mode] = {"losses": losses, "chains": _groups(model)}
    return out


def _block_casts(group_numel: int) -> dict:
    """bf16 over fp32 masters, blocks on gathered weights, two ranks: in a step after the
    first, what the forward and the backward cast, by kind (see `_Casts`)."""
    torch.manual_seed(0)
    policy = {**POLICY, "param_dtype": "bfloat16", "reduce_dtype": "float32",
              "group_numel": group_numel}  # fmt: skip
    model = GTPWrap(_gpt(), policy)
    gtp_wrap.gather_per_block(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    _loss(model, ids).backward()
    model.zero_grad(set_to_none=True)
    with torch._C.DisableTorchFunctionSubclass():  # the full weights' shapes in blocks
        shapes = {tuple(p.gtp_weight.geometry.shape) for n, p in model.named_parameters()
                  if n.startswith("blocks.") and p.dim() == 2}  # fmt: skip
    with _Casts() as forward:
        loss = _loss(model, ids)
    with _Casts() as backward:
        loss.backward()
    fp32, bf16 = torch.float32, torch.bfloat16

    def copies(casts: _Casts, src: torch.dtype, dst: torch.dtype) -> list[tuple[int, int]]:
        """(tensors, how many) of its multi-tensor copies from `src` to `dst`."""
        return sorted((n, c) for (n, a, b), c in casts.foreach.items() if (a, b) == (src, dst))

    return {
        "forward": {"downcasts": forward.downcasts, "shard_casts": copies(forward, fp32, bf16)},
        "backward": {
            "downcasts": backward.downcasts,
            "shard_casts": copies(backward, fp32, bf16),
            "grad_casts": copies(backward, bf16, fp32),
        },
        "block_upcasts": sum(backward.upcasts[s] for s in shapes),
    }


def _cases(rank: int, world: int) -> dict:
    results: dict = {"readme": {"eager": _run_readme(False), "compiled": _run_readme(True)}}
    results |= {
        name: {mode: _train(name, rank, mode) for mode in ("eager", "compiled", "per_block")}
        for name in MODELS
    }
    model = GTPWrap(_gpt(), POLICY)
    ids = torch.randint(0, 256, (2, 16))
    results["whole_model"] = caught(lambda: torch.compile(model)(ids))
    results["twice"] = caught(lambda: gtp_wrap.compile(gtp_wrap.compile(model)))
    results["routed"] = _routed_grads(rank)
    results["requested"] = {mode: _requested_grads(mode) for mode in ("eager", "per_block")}
    results["misuse"] = _misuse()
    results["block_alone"] = _block_alone()
    results["block_chains"] = _block_chains()
    results["block_casts"] = {n: _block_casts(n) for n in (0, 20000, 1 << 30)}
    outer = gtp_wrap.compile(GTPWrap(_Outer(), POLICY))
    results["outside"] = caught(lambda: outer(torch.randn(2, 16)))
    return results


def _ranks() -> list[dict]:
    return cached_ranks(_cases, 2, timeout=300)


def _cuda_cases(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # eager and Inductor: the same fp32 GEMMs
    torch.backends.cudnn.allow_tf32 = False
    return {"gpt": {mode: _train("gpt", rank, mode, "cuda") for mode in ("eager", "compiled")}}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_parity(name: str, ranks: list[dict] | None = None, mode: str = "compiled") -> None:
    ranks = ranks or _ranks()
    for rank in ranks:
        eager, compiled = rank[name]["eager"], rank[name][mode]
        for e, c in zip(eager["losses"], compiled["losses"], strict=True):
            assert abs(c / e - 1) < 1e-5, (name, eager["losses"], compiled["losses"])
        for n, g in eager["grads"].items():
            _close(compiled["grads"][n], g, f"{name} grad of {n}")
        for n, p in eager["params"].items():
            # AdamW turns a rounding difference in a near-zero gradient into a step of up to
            # lr (1e-3): parameters are held to a tenth of one step.
            _close(compiled["params"][n], p, f"{name} parameter {n}", atol=1e-4)
        assert abs(compiled["eval"] / eager["eval"] - 1) < 1e-5
        # The engine ran as in eager mode: every gather after step 1 prefetched but the chain
        # heads, the weights re-gathered in backward.
        for key in ("gathers", "prefetched_gathers", "blocking_gathers", "bytes_reduced"):
            assert compiled["stats"][key] == eager["stats"][key], (name, key)
        assert compiled["stats"]["gathers"] > 0 or len(ranks) == 1  # one rank gathers nothing


@pytest.mark.parametrize("name", MODELS)
def test_compiled_equals_eager(name: str) -> None:
    """The reference GPT, with gradient accumulation, with checkpointed blocks (whose recompute
    in backward runs the same graph) and HF Llama: one graph for all blocks (one class),
    compiled in step 1, no recompile after."""
    _check_parity(name)
    for rank in _ranks():
        assert rank[name]["compiled"]["graphs"] == [1, 1, 1]


def test_gather_per_block_equals_eager() -> None:
    """The blocks run eagerly on weights gathered once per block call: the same training."""
    for name in MODELS:
        _check_parity(name, mode="per_block")
        for rank in _ranks():
            assert rank[name]["per_block"]["graphs"] == [0, 0, 0]  # nothing was compiled
            assert rank[name]["per_block"]["persistent_with_history"] == 0


def test_a_blocks_weights_are_gathered_as_one_group() -> None:
    """A chain never cuts a block on gathered weights into groups by size (runtime/chain.py,
    [Note: a block's weights in one group]): with group_numel=0, per-use chains gather one
    weight per group, and with blocks each block's weights are one group, in both passes;
    training is the same. A block called twice a pass is two groups, one per call."""
    for rank in _ranks():
        chains = rank["block_chains"]
        for mode in ("eager", "per_block"):
            assert set(chains[mode]["chains"]) == {"forward", "backward"}
        calls = ["blocks.0.0.weight", "blocks.0.2.weight"]
        assert chains["looped"]["forward"] == [calls, calls, ["head.weight"]]
        assert chains["looped"]["backward"] == [["head.weight"], calls, calls]
        for kind, groups in chains["eager"]["chains"].items():
            assert all(len(g) == 1 for g in groups), (kind, groups)
        for kind, groups in chains["per_block"]["chains"].items():
            for g in groups:  # one block's weights, or one weight outside blocks
                owners = {f.split(".")[1] if f.startswith("blocks.") else f for f in g}
                assert len(owners) == 1, (kind, groups)
            in_blocks = [g for g in groups if g[0].startswith("blocks.")]
            assert len(in_blocks) == 3 and all(len(g) > 1 for g in in_blocks), (kind, groups)
        assert chains["per_block"]["losses"] == pytest.approx(chains["eager"]["losses"], rel=1e-5)


def test_a_groups_shards_and_a_blocks_gradients_are_cast_together_over_two_ranks() -> None:
    """bf16 over fp32 masters on two ranks, blocks on gathered weights (the GPT's 3 blocks of
    5 sharded weights, its embedding and head): every gather casts its group's fp32 shards into
    the gather buffers with one multi-tensor copy, none one by one in either pass; the bf16
    weight gradients of a reduce group are cast to the fp32 reduce dtype with one as the group
    is issued, none one at a time but a group of one's. So no fp32 copy waits for its group to
    fill: with a group per weight (group_numel 0) they are cast one by one, each as it goes."""
    for rank in _ranks():
        cases = rank["block_casts"]
        one_group, per_weight, mixed = cases[1 << 30], cases[0], cases[20000]
        for case in cases.values():
            assert case["forward"]["downcasts"] == case["backward"]["downcasts"] == 0, case
        # Everything one group: a gather of all 17 weights (16 in backward, without the
        # embedding), and the 16 gradients cast together as their one reduce-scatter is
        # issued (the 2s: each block call's norms', cast by its node).
        assert one_group["forward"]["shard_casts"] == [(17, 1)], one_group
        assert one_group["backward"]["shard_casts"] == [(16, 1)], one_group
        assert one_group["backward"]["grad_casts"] == [(2, 3), (16, 1)], one_group
        assert one_group["block_upcasts"] == 0, one_group
        # A group per block call (a block is never cut), the embedding and head alone.
        assert per_weight["forward"]["shard_casts"] == [(1, 2), (5, 3)], per_weight
        assert per_weight["backward"]["shard_casts"] == [(1, 1), (5, 3)], per_weight
        assert per_weight["backward"]["grad_casts"] == [(2, 3)], per_weight
        assert per_weight["block_upcasts"] == 15, per_weight
        # Reduce groups of 20000 elements (a block holds 34816) span block calls: copies of
        # 3, 3, 4 and 4 gradients, and one block gradient alone in its group.
        assert mixed["backward"]["grad_casts"] == [(2, 3), (3, 2), (4, 2)], mixed
        assert mixed["block_upcasts"] == 1, mixed


def test_ranks_using_different_weights_of_a_block_train_exactly() -> None:
    """Rank r runs expert r of a block: each expert's gradient is what the ranks that used it
    contributed (a zero from the other), as for the unwrapped model on both ranks' inputs."""
    for rank in _ranks():
        routed = rank["routed"]
        for name, want in routed["want"].items():
            got = routed["grads"][name]
            full = torch.cat([r["routed"]["grads"][name] for r in _ranks()])
            _close(full if got.shape != want.shape else got, want, f"routed {name}")


def test_a_block_on_gathered_weights_called_on_its_own_opens_its_pass() -> None:
    """Outside the model's forward, a block's call gathers its weights in a pass of its own:
    the unwrapped block's output and gradients; a call that raises closes its pass, also where
    opening it raised."""
    for rank in _ranks():
        alone = rank["block_alone"]
        _close(*alone["out"], "block output")
        for name, (got, want) in alone["grads"].items():
            _close(got, want, f"block grad {name}")
        assert alone["raised"].startswith("RuntimeError"), alone["raised"]
        assert alone["failed_open"] == "RuntimeError: open failed"
        assert alone["left_open"] == [(0, 0)] * 3  # after each failure, and after the model
        assert alone["after"] == (2, 5, 48)


def test_only_requested_gradients_are_computed() -> None:
    """backward(inputs=[bias]) leaves every other parameter's .grad unset, per block as eager."""
    for rank in _ranks():
        requested = rank["requested"]
        assert requested["per_block"] == requested["eager"]
        assert sum(requested["eager"].values()) == 1


def test_misuse_of_blocks_is_refused_naming_the_fix() -> None:
    for rank in _ranks():
        misuse = rank["misuse"]
        assert misuse["alone"].startswith("WrapError: linear used 'blocks.0.fc.weight' outside")
        assert "gtp_wrap.gather_per_block: the block)" in misuse["alone"]
        assert "runs on gathered weights already" in misuse["inner"]
        assert misuse["outer"] == "no error | released: True"
        # An in-place write inside a block would change the gathered copy only.
        assert misuse["written"].startswith("WrapError: block '0' wrote in place to its weight")
        assert "'0.fc.weight'" in misuse["written"]


def test_no_default_blocks_and_fp8_gemms_on_gathered_blocks_are_named() -> None:
    """A model without default blocks is refused with what the default looked for; blocks on
    gathered weights, compiled or eager, warn that they run bf16 GEMMs under fp8_matmul (found
    by a new user: 7 FP8 GEMMs in 6 compiled steps against 63 eager, nothing said)."""
    whole = GTPWrap(_gpt(), {})  # d=64: every weight under the default min_shard_numel
    with pytest.raises(WrapError, match="that hold a sharded weight, and the policy left theirs"):
        gtp_wrap.compile(whole)
    no_list = GTPWrap(torch.nn.Sequential(torch.nn.Linear(64, 64)), POLICY)
    with pytest.raises(WrapError, match="the items of its nn.ModuleLists, and it has none"):
        gtp_wrap.gather_per_block(no_list)
    listed = GTPWrap(_gpt(), POLICY)  # a container given as a block took no effect, silently
    with pytest.raises(WrapError, match="a ModuleList passed in blocks is a container"):
        gtp_wrap.gather_per_block(listed, blocks=[listed.blocks])
    for run_blocks in (gtp_wrap.compile, gtp_wrap.gather_per_block):
        with pytest.warns(UserWarning, match="fp8_matmul runs FP8 GEMMs for per-use gathers only"):
            run_blocks(GTPWrap(_gpt(), FP8_GEMM))


def test_readme_snippet_trains_as_eager() -> None:
    for rank in _ranks():
        eager, compiled = rank["readme"]["eager"], rank["readme"]["compiled"]
        assert len(compiled) == 3
        for e, c in zip(eager, compiled, strict=True):
            assert abs(c / e - 1) < 1e-5, (eager, compiled)


def test_whole_model_compile_is_refused_naming_the_fix() -> None:
    for rank in _ranks():
        assert rank["whole_model"].startswith("WrapError: torch.compile traced into")
        assert "gtp_wrap.compile(model)" in rank["whole_model"]
        assert "runs on gathered weights already" in rank["twice"]
        # Dynamo's internal error on a weight from outside the block, named for what it is.
        assert rank["outside"].startswith("WrapError: torch.compile failed inside block")
        assert "holds every weight it reads" in rank["outside"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_gpt_on_cuda_equals_eager() -> None:
    """Inductor's CUDA code on NCCL ranks (one per GPU, up to two)."""
    ranks = run_ranks(_cuda_cases, min(2, torch.cuda.device_count()), backend="nccl")
    _check_parity("gpt", ranks)
    for rank in ranks:
        assert rank["gpt"]["compiled"]["graphs"] == [1, 1, 1]


def test_a_blocks_gradients_in_a_group_of_one_accumulate_through_autograd() -> None:
    """World of one, bf16 over fp32 masters: autograd accumulates a block's weight gradients
    itself (see [Note: a block's gradients in a group of one]), equal to the unwrapped bf16
    model's gradients cast to fp32; a second backward accumulates into them."""
    torch.manual_seed(0)
    ref = _gpt()
    model = GTPWrap(_gpt(), {**POLICY, "param_dtype": "bfloat16", "reduce_dtype": "float32"})
    model.load_state_dict(ref.state_dict())
    gtp_wrap.gather_per_block(model)
    ref = ref.to(torch.bfloat16)
    landed_by_reducer: list[str] = []  # the reducer's own landing, per weight it lands
    reducer = engine_of(model).reducer
    own_landing = reducer._land_unreduced

    def counted(w, *args):
        landed_by_reducer.append(w.fqn)
        return own_landing(w, *args)

    reducer._land_unreduced = counted
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want: dict[str, torch.Tensor] = {}
    for _ in range(2):  # the second accumulates (in fp32, as the reference's sum here)
        _loss(model, ids).backward()
        _loss(ref, ids).backward()
        for n, p in ref.named_parameters():
            if n.startswith("blocks."):  # outside blocks, uses take the fp32-GEMM route
                want[n] = want.get(n, 0) + p.grad.float()
        ref.zero_grad()
    got = dict(model.named_parameters())
    assert "blocks.0.attn.qkv.weight" in want and "blocks.2.mlp.down.weight" in want
    for n, g in want.items():
        assert torch.equal(got[n].grad, g), n
    # Autograd accumulated the blocks' weights; the reducer landed only the uses outside them.
    assert landed_by_reducer and not [n for n in landed_by_reducer if n.startswith("blocks.")]
    # A differentiable backward (create_graph) lands each gradient on its own route (its values
    # as before this change: autograd's create_graph backward rounds a little differently).
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    _loss(model, ids).backward(create_graph=True)
    _loss(ref, ids).backward()
    torch.testing.assert_close(
        got["blocks.1.mlp.up.weight"].grad.detach(),
        ref.blocks[1].mlp.up.weight.grad.float(),
        rtol=1e-2,
        atol=1e-4,
    )


class _Casts(TorchDispatchMode):
    """Counts the multi-tensor copies and the bf16 -> fp32 casts (by input shape) it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.foreach_copies = 0
        # (tensors, source dtype, target dtype) of each multi-tensor copy
        self.foreach: collections.Counter[tuple[int, torch.dtype, torch.dtype]] = (
            collections.Counter()
        )
        self.copied: set[int] = set()  # where the multi-tensor copies wrote
        self.upcasts: collections.Counter[tuple[int, ...]] = collections.Counter()
        self.downcasts = 0  # fp32 -> bf16 copies into existing tensors, one at a time

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._foreach_copy_.default:
            self.foreach_copies += 1
            self.foreach[len(args[0]), args[1][0].dtype, args[0][0].dtype] += 1
            self.copied.update(t.data_ptr() for t in args[0])
        elif func is torch.ops.aten._to_copy.default and (args[0].dtype, out.dtype) == (
            torch.bfloat16,
            torch.float32,
        ):
            self.upcasts[tuple(args[0].shape)] += 1
        elif func is torch.ops.aten.copy_.default and (args[1].dtype, args[0].dtype) == (
            torch.float32,
            torch.bfloat16,
        ):
            self.downcasts += 1
        return out


def test_a_blocks_gradients_are_cast_by_one_multi_tensor_copy() -> None:
    """bf16 over fp32 masters in a group of one: a backward casts each block's weight
    gradients (sharded and replicated) to fp32 with one multi-tensor copy per block call, none
    on its own (see [Note: a block's gradients are cast together]), into the tensors that
    autograd then takes as the `.grad`s, with no copy of its own; only the parameters outside
    blocks that share a block weight's shape (the final norm) may be cast alone."""
    torch.manual_seed(0)
    model = GTPWrap(_gpt(), {**POLICY, "param_dtype": "bfloat16", "reduce_dtype": "float32"})
    gtp_wrap.gather_per_block(model)
    with torch._C.DisableTorchFunctionSubclass():  # the shards' shapes: the full weights'
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = {shape for n, shape in named if n.startswith("blocks.")}
    outside = sum(not n.startswith("blocks.") and shape in shapes for n, shape in named)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = _loss(model, ids)
    with _Casts() as seen:
        loss.backward()
    assert seen.foreach_copies == len(model.blocks) == 3
    assert sum(seen.upcasts[s] for s in shapes) <= outside == 1, seen.upcasts
    with torch._C.DisableTorchFunctionSubclass():
        grads = [p.grad for n, p in model.named_parameters() if n.startswith("blocks.")]
    assert all(g is not None and g.data_ptr() in seen.copied for g in grads)
    assert _persistent_with_history(model) == 0  # the local copies were viewed, not handed out


class _TiedOutside(torch.nn.Module):
    """Two blocks of a Linear each; the first one's weight is read again outside every block,
    by the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.GELU())
            for _ in range(2)
        )
        self.out = torch.nn.Linear(16, 16, bias=False)
        self.out.weight = self.blocks[0][0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _tied_grads(accumulate: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Two backwards of `_TiedOutside` on blocks over gathered weights (world of one, bf16 over
    fp32 masters), autograd accumulating the blocks' gradients or the reducer landing them;
    the gradients, and what a hook on the tied weight saw after each backward."""
    torch.manual_seed(0)
    model = GTPWrap(
        _TiedOutside(), {**POLICY, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    )
    gtp_wrap.gather_per_block(model)
    engine = engine_of(model)
    if not accumulate:  # every block gradient through `reduce_grad`, the reducer's own route
        engine.accumulated = frozenset()
    seen: list[torch.Tensor] = []
    model.out.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).float().square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, seen


def test_a_weight_of_a_block_read_outside_it_too_sums_both_gradients() -> None:
    """A block weight's gradient accumulated by autograd meets its other use's, landed by the
    reducer, in one `.grad`: the same, bit for bit, as when the reducer lands both; its hook
    runs once per backward, on the whole sum."""
    got, seen = _tied_grads(accumulate=True)
    want, want_seen = _tied_grads(accumulate=False)
    assert got.keys() == want.keys() == {"blocks.0.0.weight", "blocks.1.0.weight"}
    for n, g in want.items():
        assert torch.equal(got[n], g), n
    assert len(seen) == len(want_seen) == 2
    for a, b in zip(seen, want_seen):
        assert torch.equal(a, b)
    assert torch.equal(seen[-1], got["blocks.0.0.weight"])
    assert not torch.equal(seen[0], seen[1])  # the second backward added to the first


class _TiedAcross(torch.nn.Module):
    """Three blocks, the first and the last sharing one Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.GELU())
            for _ in range(3)
        )
        self.blocks[2][0] = self.blocks[0][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_weight_shared_by_blocks_accumulates_as_in_plain_torch() -> None:
    """A weight two blocks share, in a group of one: autograd sums its two uses and
    accumulates them, as for the unwrapped model, bit for bit over two backwards."""
    torch.manual_seed(0)
    ref = _TiedAcross()
    model = GTPWrap(copy.deepcopy(ref), POLICY)
    gtp_wrap.gather_per_block(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(got[n].grad, p.grad), n
