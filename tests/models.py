"""Small models covering the access patterns GTP must handle exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has an exactly zero grad
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """GPT with tied embedding / output head: the head reads the embedding's weight."""

    def __init__(self, vocab=48, d=32, layers=2, heads=4, ctx=16, ckpt=False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(self.norm(x))


class OutsideRead(nn.Module):
    """Reads weights outside their owning module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(12, 16), nn.Tanh())
        self.proj = nn.Linear(16, 12)
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h = torch.tanh(F.linear(h, self.proj.weight, self.proj.bias))
        side = (x @ self.inner[0].weight.t()).sum(-1, keepdim=True)
        return self.out(h) + side


class SameShapeReads(nn.Module):
    """Reads several same-shape weights (as live views) before using any of them."""

    def __init__(self, n=3, d=16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [layer.weight.t() for layer in self.layers]
        stacked = torch.stack([layer.weight for layer in self.layers]).sum(0)
        for w in weights:
            x = torch.tanh(x @ w)
        return self.out(x + x @ stacked)


class CalledTwice(nn.Module):
    def __init__(self, d=16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        x = torch.tanh(self.a(x))
        return self.out(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.convs(x).mean(dim=(2, 3)))


class DeepMLP(nn.Module):
    def __init__(self, layers: int, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def tiny_llama_config(**overrides):  # -> transformers.LlamaConfig (imported here: most tests
    # need none)
    """A small random Hugging Face Llama: 2 layers, width 32, grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **overrides,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
