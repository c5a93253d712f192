"""Model shapes for the cost model: the weights a training step gathers, in the order it uses
them, and the FLOPs and activation bytes per token.

The shapes follow the reference GPT of `gtp_wrap.app.model` (fused q/k/v rows, separate gate
and up, an untied or tied head; a mixture of experts as stacked `gate_up` [E, 2f, d] and `down`
[E, d, f] per layer), so the weight list is the chain the engine records for it.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

WeightKind = Literal["embedding", "dense", "expert", "head"]


class ModelError(ValueError):
    """A model configuration the cost model cannot use."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """One gathered weight (or, for experts, one layer's stack of a role).

    `rows x cols` is one matrix; `experts` matrices are stacked in an expert weight (all of the
    model's experts: expert parallelism divides them). `layer` groups a layer's expert stacks,
    which the engine gathers as one collective."""

    name: str
    rows: int
    cols: int
    kind: WeightKind
    layer: int = -1
    experts: int = 1

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.experts


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: `layers` blocks of attention (grouped-query with `kv_heads`) and
    a SwiGLU MLP, or with `experts`, a top-`top_k` mixture of SwiGLU experts of width
    `moe_ffn` (and a dense shared expert of that width if `shared_expert`).

    `note` says what the configuration approximates (it is printed with every plan)."""

    name: str
    vocab: int
    d: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int = 0  # 0: as many as heads
    tie_embeddings: bool = False
    experts: int = 0
    top_k: int = 2
    moe_ffn: int = 0
    shared_expert: bool = False
    seq: int = 2048  # the default sequence length of plans
    note: str = ""

    def __post_init__(self) -> None:
        for field in ("vocab", "d", "layers", "heads", "ffn", "seq"):
            if getattr(self, field) < 1:
                raise ModelError(f"model {self.name!r}: {field} must be >= 1")
        for field in ("kv_heads", "experts", "moe_ffn"):
            if getattr(self, field) < 0:
                raise ModelError(f"model {self.name!r}: {field} must be >= 0")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ModelError(
                f"model {self.name!r}: heads={self.heads} must split into {self.kv_heads} kv_heads"
            )
        if self.d % self.heads:
            raise ModelError(f"model {self.name!r}: d={self.d} must divide into {self.heads} heads")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ModelError(f"model {self.name!r}: top_k must be between 1 and experts")

    @property
    def qkv_rows(self) -> int:
        kv = self.kv_heads or self.heads
        return self.d + 2 * kv * (self.d // self.heads)

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def weights(self) -> list[Weight]:
        """The gathered weights in forward order (the chain of a forward pass)."""
        out = [Weight("embed", self.vocab, self.d, "embedding")]
        for i in range(self.layers):
            out += [
                Weight(f"layers.{i}.qkv", self.qkv_rows, self.d, "dense", i),
                Weight(f"layers.{i}.o", self.d, self.d, "dense", i),
            ]
            if self.experts:
                f = self.expert_ffn
                out += [
                    Weight(f"layers.{i}.experts.gate_up", 2 * f, self.d, "expert", i, self.experts),
                    Weight(f"layers.{i}.experts.down", self.d, f, "expert", i, self.experts),
                ]
                if self.shared_expert:
                    out += self._swiglu(i, f, "shared")
            else:
                out += self._swiglu(i, self.ffn, "mlp")
        if not self.tie_embeddings:
            out.append(Weight("head", self.vocab, self.d, "head"))
        return out

    def _swiglu(self, layer: int, f: int, what: str) -> list[Weight]:
        return [
            Weight(f"layers.{layer}.{what}.gate", f, self.d, "dense", layer),
            Weight(f"layers.{layer}.{what}.up", f, self.d, "dense", layer),
            Weight(f"layers.{layer}.{what}.down", self.d, f, "dense", layer),
        ]

    @property
    def replicated_numel(self) -> int:
        """Parameters too small to shard: two norms per layer, the final norm, routers."""
        router = self.experts * self.d if self.experts else 0
        return self.layers * (2 * self.d + router) + self.d

    @property
    def n_params(self) -> int:
        return sum(w.numel for w in self.weights()) + self.replicated_numel

    @property
    def active_params(self) -> int:
        """Parameters a token runs through (top_k of the experts), the embedding included."""
        idle = sum(
            w.numel * (self.experts - self.top_k) // self.experts
            for w in self.weights()
            if w.kind == "expert"
        )
        return self.n_params - idle

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's attention scores and values at `seq`, as
        bench_step counts them (the full square; causal kernels skip half, which the
        calibrated attention rate absorbs)."""
        return 4.0 * self.seq * self.d

    def with_seq(self, seq: int) -> ModelConfig:
        return dataclasses.replace(self, seq=seq)


# The reference models of benchmarks/bench_step.py (MODELS there), for validation.
GPT_125M = ModelConfig(
    "gpt_125m",
    vocab=32000,
    d=768,
    layers=12,
    heads=12,
    ffn=2048,
    tie_embeddings=True,
    note="bench_step.py's 125M reference GPT",
)
GPT_1P36B = ModelConfig(
    "gpt_1p36b",
    vocab=32000,
    d=2048,
    layers=24,
    heads=16,
    ffn=5632,
    note="bench_step.py's 1.36B reference GPT (untied head)",
)
LLAMA70B = ModelConfig(
    "llama70b",
    vocab=128256,
    d=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    ffn=28672,
    seq=4096,
    note="Llama-3-70B shapes (GQA 8 KV heads, untied head); q/k/v counted as one fused weight",
)
SEED280B = ModelConfig(
    "seed280b",
    vocab=131072,
    d=5120,
    layers=56,
    heads=40,
    kv_heads=8,
    ffn=5120,
    experts=64,
    top_k=4,
    moe_ffn=5120,
    seq=4096,
    note="an approximation of the seed's ~280B hybrid Mamba-MoE as a MoE transformer: every "
    "layer attention + 64 routed experts (top 4), ~285B parameters, ~23B active per token. The "
    "Mamba layers' scans are modelled as attention of the same parameter count; the seed's "
    "exact widths are not in this repository",
)
MODELS: dict[str, ModelConfig] = {m.name: m for m in (GPT_125M, GPT_1P36B, LLAMA70B, SEED280B)}


def model_by_name(name: str) -> ModelConfig:
    """A built-in model; the error lists them."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    return MODELS[name]


# Keys of gtp-train's model configs that do not change what a step gathers or computes.
_TRAINING_ONLY = frozenset({"rope_base", "aux_loss_coef"})
# What gtp-train's GPTConfig takes for a key a model file leaves out (tests check they agree),
# so a file plans the model gtp-train builds from it.
TRAIN_DEFAULTS = {"tie_embeddings": True, "max_seq": 256, "experts": 0, "top_k": 2, "moe_ffn": 0,
                  "shared_expert": False}  # fmt: skip
_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("name", "note"))


def train_configs() -> list[str]:
    """The model configs gtp-train ships (configs/model/, as gtp_wrap.configs)."""
    folder = importlib.resources.files("gtp_wrap.configs") / "model"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_model(name_or_path: str) -> ModelConfig:
    """A model by name or file: a built-in (`MODELS`), a model config gtp-train ships
    (`gpt_small`, `moe_1b`: configs/model/), or the path of a YAML or JSON file of the same
    keys (gtp-train's `model` group: vocab, d, layers, heads, ffn, max_seq, tie_embeddings,
    experts, top_k, moe_ffn, shared_expert; and kv_heads or seq)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml", ".json"):
        shipped = importlib.resources.files("gtp_wrap.configs") / "model" / f"{name_or_path}.yaml"
        if not shipped.is_file():
            raise ModelError(
                f"unknown model {name_or_path!r}: give a built-in model ({', '.join(MODELS)}), "
                f"a gtp-train model config ({', '.join(train_configs())}), or the path of a "
                f"YAML or JSON file of its keys ({', '.join(_FIELDS)})"
            )
        note = f"gtp-train's model config {name_or_path}"
        return model_from_dict(_read(Path(str(shipped))), name_or_path, note)
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")
    return model_from_dict(_read(path), path.stem, f"from {path}")


def _read(path: Path) -> Any:
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ModelError(f"model file {path} is not valid JSON ({e})") from e
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException
        from yaml import YAMLError
    except ImportError as e:
        raise ModelError(
            f"reading {path} needs omegaconf (pip install omegaconf), or give the model as JSON"
        ) from e
    try:
        loaded = OmegaConf.create(text)
        raw = OmegaConf.to_container(loaded, resolve=True)
    except (YAMLError, OmegaConfBaseException, ValueError, AssertionError) as e:  # a scalar file
        detail = str(e) or "it holds a single value"
        raise ModelError(f"model file {path} is not a YAML mapping of model keys ({detail})") from e
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        return raw["model"]  # a whole gtp-train config (a run's .hydra/config.yaml)
    return raw


def model_from_dict(raw: Any, name: str, note: str = "") -> ModelConfig:
    """A model from the keys of a gtp-train model config (`max_seq` is the plans' default
    sequence length); a key left out takes gtp-train's default (`TRAIN_DEFAULTS`), and keys
    that only training uses (rope_base, aux_loss_coef) are ignored."""
    if not isinstance(raw, Mapping):
        raise ModelError(
            f"model {name!r} must be a mapping of model keys, got {type(raw).__name__}"
        )
    if "defaults" in raw:
        raise ModelError(
            f"model {name!r}: a defaults list is Hydra's; give the model's keys themselves "
            "(or the run's composed .hydra/config.yaml)"
        )
    fields: dict[str, Any] = {}
    for key, value in {**TRAIN_DEFAULTS, **raw}.items():
        field = "seq" if key == "max_seq" else str(key)
        if key in _TRAINING_ONLY:
            continue
        if field not in _FIELDS:
            raise ModelError(f"model {name!r}: unknown key {key!r}; keys: {', '.join(_FIELDS)}")
        kind = bool if field in ("tie_embeddings", "shared_expert") else int
        if type(value) is not kind:
            raise ModelError(f"model {name!r}: {key} must be {kind.__name__}, got {value!r}")
        fields[field] = value
    missing = [k for k in ("vocab", "d", "layers", "heads", "ffn") if k not in fields]
    if missing:
        raise ModelError(f"model {name!r} lacks {', '.join(missing)}")
    return ModelConfig(name, **fields, note=note)


def llama_like(d: int, seq: int = 4096) -> ModelConfig:
    """A Llama-shaped dense model of width `d` (for model-size sweeps): d/128 layers and
    heads, 8 KV heads, SwiGLU width 2.6875·d (Llama-2-7B's ratio) rounded to 256, Llama 3's
    vocabulary."""
    ffn = round(2.6875 * d / 256) * 256
    return ModelConfig(
        f"llama_d{d}",
        vocab=128256,
        d=d,
        layers=d // 128,
        heads=d // 128,
        kv_heads=8,
        ffn=ffn,
        seq=seq,
        note="Llama-shaped family member",
    )
