"""A Llama-style GPT: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention (SDPA)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


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

    def __post_init__(self) -> None:
        if self.d % self.heads or (self.d // self.heads) % 2:
            raise ValueError(
                f"model.d={self.d} must split into {self.heads} heads of even size; "
                "pick d divisible by 2 * heads"
            )

    @property
    def n_params(self) -> int:
        per_layer = 4 * self.d * self.d + 3 * self.d * self.ffn + 2 * self.d
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
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.d, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d)
        self.mlp = SwiGLU(cfg)

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
        half = cfg.d // cfg.heads // 2
        freqs = cfg.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), freqs)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        cos, sin = (c[: idx.shape[1]].to(x.dtype) for c in (self.cos, self.sin))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))
