"""A Llama-style GPT: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention (SDPA); with
`experts`, a mixture of experts in place of each MLP (top-k routing, stacked expert weights, an
optional shared expert, a load-balancing loss)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 344
    max_seq: int = 256
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    experts: int = 0  # routed experts per block (0: a dense MLP)
    top_k: int = 2  # experts per token
    moe_ffn: int = 0  # each expert's hidden width (0: ffn)
    shared_expert: bool = False  # a dense SwiGLU of moe_ffn beside the routed experts
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss

    def __post_init__(self) -> None:
        if self.d % self.heads or (self.d // self.heads) % 2:
            raise ValueError(
                f"model.d={self.d} must split into {self.heads} heads of even size; "
                "pick d divisible by 2 * heads"
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and experts")

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    @property
    def n_params(self) -> int:
        mlp = 3 * self.d * self.ffn
        if self.experts:  # all experts (the parameters held, not those a token uses)
            mlp = self.experts * (3 * self.d * self.expert_ffn + self.d)
            mlp += 3 * self.d * self.expert_ffn if self.shared_expert else 0
        per_layer = 4 * self.d * self.d + mlp + 2 * self.d
        head = 0 if self.tie_embeddings else self.vocab * self.d
        return self.vocab * self.d + self.layers * per_layer + self.d + head


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d // cfg.heads
        # Each head's q, k and v rows together, so that splitting the rows by whole heads
        # (tensor parallelism's ColwiseParallel) gives each rank whole heads.
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False)
        self.o = nn.Linear(cfg.d, cfg.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = rearrange(self.qkv(x), "b t (h three e) -> three b h t e", three=3, e=self.head_dim)
        q, k, v = qkv.unbind(0)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(rearrange(y, "b h t e -> b t (h e)"))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: int | None = None) -> None:
        super().__init__()
        ffn = ffn or cfg.ffn
        self.gate = nn.Linear(cfg.d, ffn, bias=False)
        self.up = nn.Linear(cfg.d, ffn, bias=False)
        self.down = nn.Linear(ffn, cfg.d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Experts(nn.Module):
    """`n` SwiGLU experts as stacked weights, the layout of Hugging Face transformers 5.x and of
    torchtitan: `gate_up` [n, 2·ffn, d] (each expert's gate rows, then its up rows) and `down`
    [n, d, ffn]. Each stack is read once per call, whatever the routing, so a sharded stack
    is gathered once per pass."""

    def __init__(self, n: int, d: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n, 2 * ffn, d))
        self.down = nn.Parameter(torch.empty(n, d, ffn))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.gate_up, self.down):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x`: tokens sorted by expert, `counts[e]` of them for expert e."""
        h = grouped_mm(x, self.gate_up.transpose(1, 2), counts)
        gate, up = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), counts)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row block e of `x` (counts[e] rows, in order) times `w[e]`: one grouped GEMM on GPUs
    that have it (`torch._grouped_mm`, bf16 on Hopper), else a loop over the experts with
    tokens. Either way autograd saves `w` once, whatever the routing (a sharded stack is then
    re-gathered once in backward)."""
    if x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 9:
        return torch._grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
    return _loop_grouped_mm(x, w, counts)


@torch.compiler.disable
def _loop_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # Eager under torch.compile: the loop's trip count and slices follow the routing, which
    # Dynamo would guard on, compiling the block again for every new routing until its
    # recompile limit sends it back to eager for good. Disabled, it is one graph break.
    return _LoopGroupedMM.apply(x, w, counts)


class _LoopGroupedMM(torch.autograd.Function):
    """The grouped GEMM as a loop over the experts with tokens, saving the stack whole (indexing
    it per expert inside autograd would save one slice per routed expert)."""

    @staticmethod
    def forward(ctx, x, w, counts):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.counts = counts.tolist()
        return _loop_mm(x, w, ctx.counts)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = _loop_mm(grad, w.transpose(1, 2), ctx.counts)
        dw = torch.zeros_like(w)  # an expert without tokens has a zero gradient
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                dw[e] = x[start : start + n].t() @ grad[start : start + n]
                start += n
        return dx, dw, None


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts = [x.new_empty(0, w.shape[-1])]
    start = 0
    for e, n in enumerate(counts):
        if n:
            parts.append(x[start : start + n] @ w[e])
            start += n
    return torch.cat(parts)


class MoE(nn.Module):
    """Top-k routed experts (and an optional shared expert) with a load-balancing loss.

    The router's softmax picks `top_k` experts per token, their weights renormalized (with one
    expert, as in the Switch Transformer, its probability itself); tokens
    are sorted by expert, run through the stacked experts, and summed back weighted. The
    Switch Transformer's load-balancing loss, `experts · Σ_e f_e · P_e` (f: the share of
    routed slots, P: the mean router probability of expert e), is kept in `aux_loss` for the
    training loss, and the slots each expert got in `tokens_per_expert`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n, self.top_k, self.coef = cfg.experts, cfg.top_k, cfg.aux_loss_coef
        self.router = nn.Linear(cfg.d, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.d, cfg.expert_ffn)
        self.shared = SwiGLU(cfg, cfg.expert_ffn) if cfg.shared_expert else None
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(cfg.experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:  # renormalized among the chosen; one expert keeps its probability,
            weights = weights / weights.sum(dim=-1, keepdim=True)  # else the router learns nothing
        weights = weights.to(x.dtype)
        order = chosen.flatten().argsort(stable=True)  # the token slots, sorted by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.n)
        tokens = order // self.top_k
        routed = self.experts(flat[tokens], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(flat).index_add_(0, tokens, routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        share = counts.float() / chosen.numel()
        self.aux_loss = self.coef * self.n * (share * probs.mean(dim=0)).sum()
        self.tokens_per_expert = counts.detach()
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d)
        self.mlp = MoE(cfg) if cfg.experts else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer(
            "cos", torch.empty(cfg.max_seq, cfg.d // cfg.heads // 2), persistent=False
        )
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)
        self.reset_parameters()
        self.apply(self._init_weights)

    def reset_parameters(self) -> None:
        """The RoPE tables (the model's own buffers; its weights are its modules'): what a
        meta-device build (GTPWrap of a model built under torch.device("meta")) calls again."""
        half = self.cfg.d // self.cfg.heads // 2
        freqs = self.cfg.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(self.cfg.max_seq, dtype=torch.float32), freqs)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def _init_weights(self, m: nn.Module) -> None:
        """Each module's init after its own (Hugging Face's hook name, which a meta-device
        build calls per module)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward's MoE blocks (zero without experts):
        add it to the training loss."""
        losses = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE)]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def tokens_per_expert(self) -> torch.Tensor:
        """Routed token slots per expert in the last forward: [MoE blocks, experts] (no rows
        without experts)."""
        counts = [b.mlp.tokens_per_expert for b in self.blocks if isinstance(b.mlp, MoE)]
        return torch.stack(counts) if counts else torch.zeros(0, 0, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        cos, sin = (c[: idx.shape[1]].to(x.dtype) for c in (self.cos, self.sin))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def tensor_parallel_plan(model: GPT, sequence: bool = False) -> dict[str, ParallelStyle]:
    """torch's tensor parallelism for the dense GPT by hand, for `parallelize_module(model,
    mesh["tp"], plan)` before GTPWrap (configs/policy/tp.yaml's rules apply the same with
    `sequence`): attention and MLP column-then-row (each tp rank keeps whole heads); with
    `sequence`, the norms sequence-parallel and the residual stream split over the sequence
    between the embedding and the head."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {
            f"{b}.attn.qkv": ColwiseParallel(),
            f"{b}.attn.o": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
            f"{b}.mlp.gate": ColwiseParallel(),
            f"{b}.mlp.up": ColwiseParallel(),
            f"{b}.mlp.down": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
        }
        if sequence:
            plan |= {
                f"{b}.attn_norm": SequenceParallel(),
                f"{b}.mlp_norm": SequenceParallel(),
                f"{b}.attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                f"{b}.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
    if sequence:  # the stream enters split over the sequence and leaves whole
        plan |= {
            "embed": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            ),
            "norm": SequenceParallel(),
            "head": PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,  # the head is GTP's alone
            ),
        }
    return plan
