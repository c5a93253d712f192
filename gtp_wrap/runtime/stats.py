"""The counters `gtp_wrap.stats` reports, kept by the engine's parts as they work."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Stats:
    """Counters since the last reset (see gtp_wrap.stats)."""

    gathers: int = 0
    prefetched_gathers: int = 0
    blocking_gathers: int = 0
    bytes_gathered: int = 0
    bytes_reduced: int = 0
    reduce_scatters: int = 0
    peak_gathered_bytes: int = 0  # memory held by gather buffers (high-water mark)
    weight_casts: int = 0  # re-casts of a kept compute copy / FP8 re-quantizations (per step)
    fp8_matmuls: int = 0  # uses that ran as FP8 GEMMs (fp8_matmul)
    blocking_by_pass: dict[str, int] = dataclasses.field(default_factory=dict)
    expert_gathers: int = 0  # of `gathers`, those of expert stacks (over egtp)
    prefetched_expert_gathers: int = 0  # of those, the ones issued ahead of their use

    def reset(self, peak_gathered_bytes: int) -> None:
        """Zero every counter in place (the parts hold this object); the high-water mark
        starts from the memory held now."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, {} if field.name == "blocking_by_pass" else 0)
        self.peak_gathered_bytes = peak_gathered_bytes
