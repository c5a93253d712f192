"""Training text every machine has: the Python standard library's own source, as bytes.

Samples are drawn at offsets that depend only on (seed, split, step, data rank, micro-batch), so
each rank reads different text, and a resumed run reads exactly what an uninterrupted one would.
A user's own data: `data.path` names a UTF-8/bytes text file (byte tokens), a directory of text
files (every regular file under it, in sorted path order, up to `data.max_bytes` bytes), or a
`.npy` array of token ids (loaded with allow_pickle=False).
"""

from __future__ import annotations

import dataclasses
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    max_bytes: int = 8 << 20
    val_fraction: float = 0.05


class DataError(ValueError):
    """The data source is missing or unusable."""


def _read_bytes(files: list[Path], max_bytes: int) -> np.ndarray:
    """The files' bytes, concatenated and cut at `max_bytes`, as int64 tokens."""
    chunks, total = [], 0
    for file in files:
        if total >= max_bytes:
            break
        with file.open("rb") as f:
            chunks.append(f.read(max_bytes - total))  # never more of a large file than is kept
        total += len(chunks[-1])
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64)


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """All tokens of the corpus as a 1-D integer array."""
    if cfg.path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return _read_bytes(
            sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")), cfg.max_bytes
        )
    path = Path(cfg.path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise DataError(
                f"data.path={cfg.path!r} is a directory with no files in it; give a directory "
                "of text files, a text file or a .npy file of token ids"
            )
        return _read_bytes(files, cfg.max_bytes)
    if not path.is_file():
        raise DataError(
            f"data.path={cfg.path!r} does not exist; give a text file (its bytes are the "
            "tokens), a directory of text files, or a .npy file of token ids"
        )
    if path.suffix == ".npy":
        tokens = np.load(path, allow_pickle=False)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{cfg.path} must hold a 1-D integer array of token ids")
        return tokens.astype(np.int64)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)


class TokenStream:
    """Random windows of `seq + 1` tokens from the train or validation split."""

    def __init__(self, cfg: DataConfig, seq: int, vocab: int, seed: int) -> None:
        tokens = load_tokens(cfg)
        if tokens.max(initial=0) >= vocab:
            raise DataError(f"the data has token id {tokens.max()} but model.vocab is {vocab}")
        split = int(len(tokens) * (1 - cfg.val_fraction))
        self.splits = {
            "train": torch.from_numpy(tokens[:split]),
            "val": torch.from_numpy(tokens[split:]),
        }
        for name, part in self.splits.items():
            if len(part) <= seq + 1:
                raise DataError(f"the {name} split has {len(part)} tokens, fewer than seq+1")
        self.seq = seq
        self.seed = seed
        self.source = cfg.path or f"Python {sys.version.split()[0]} standard library source"

    def batch(
        self, split: str, step: int, rank: int, micro: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        g = torch.Generator().manual_seed(
            hash((self.seed, split == "train", step, rank, micro)) & 0x7FFFFFFF
        )
        starts = torch.randint(0, len(data) - self.seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + self.seq + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]
