"""A cluster description: one machine kind's links, compute rates and host costs, loaded from a
calibration JSON (`benchmarks/calibration/<kind>.json`, shipped as the package
`gtp_wrap.scaling.calibration`).

Every number in the JSON is either plain or `{"value": x, "source": "..."}`, the source naming
the measurement (a results file, a datasheet) it comes from. `calibrate.py` writes them for
the machine it runs on; nominal clusters (GB200) carry published figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

CALIBRATION_PACKAGE = "gtp_wrap.scaling.calibration"
# A source checkout reads benchmarks/calibration/ directly (an installed wheel carries a copy as
# the package above).
CHECKOUT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"


class ClusterError(ValueError):
    """A cluster name or calibration file that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Curve:
    """α-β time of one collective kind on one link: `alpha_us + (members - 2) * hop_us` of
    latency plus the bytes each member receives at `gbs` GB/s."""

    alpha_us: float
    gbs: float
    hop_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    """The collectives' curves on one link: inside a node (NVLink) or between nodes."""

    all_gather: Curve
    reduce_scatter: Curve

    def curve(self, kind: str) -> Curve:
        """All-reduce is a reduce-scatter then an all-gather; an all-to-all moves its bytes like
        an all-gather."""
        return self.reduce_scatter if kind in ("reduce_scatter", "all_reduce") else self.all_gather


@dataclasses.dataclass(frozen=True)
class Compute:
    """Device rates: GEMMs at `gemm_tflops` when every one of `gemm_units` (SMs; 1 on a CPU
    core) runs full output tiles of `gemm_tile_m x gemm_tile_n`, in whole waves of tiles (a
    GEMM with fewer tiles than units splits its sum among them, split-K), plus `gemm_overhead_us`
    each; attention at `attention_tflops` (of the FLOPs `ModelConfig` counts) plus
    `attention_layer_us` per layer, forward and backward (its kernels' fixed time); memory-bound
    kernels at `hbm_gbs`; a layer's elementwise work (norms, rotary, SwiGLU, residuals,
    forward and backward) moves `elementwise_bytes` per token per element of `d + ffn`, and
    pays `layer_overhead_us` of small-kernel time. Decoding an encoded gather to bf16 takes
    `<dtype>_decode_us` per use plus `<dtype>_decode_ns` per element (None: not calibrated)."""

    gemm_tflops: float
    gemm_overhead_us: float
    gemm_units: int
    gemm_tile_m: int
    gemm_tile_n: int
    attention_tflops: float
    hbm_gbs: float
    elementwise_bytes: float
    layer_overhead_us: float
    attention_layer_us: float = 0.0
    fp8_decode_us: float | None = None
    fp8_decode_ns: float | None = None
    nvfp4_decode_us: float | None = None
    nvfp4_decode_ns: float | None = None

    def decode_s(self, dtype: str, numel: float) -> float:
        """Seconds to decode one gathered weight of `numel` elements from `dtype`."""
        us, ns = getattr(self, f"{dtype}_decode_us"), getattr(self, f"{dtype}_decode_ns")
        if us is None or ns is None:
            raise ClusterError(
                f"this cluster has no calibration of {dtype} decoding; add {dtype}_decode_us and "
                f"{dtype}_decode_ns to its JSON's compute section (see h200.json), or gather bf16"
            )
        return us * 1e-6 + numel * ns * 1e-9


@dataclasses.dataclass(frozen=True)
class Host:
    """Host time an eager step spends (a graphed step replays with `graph_step_us`):
    `layer_us` per layer of the plain model (forward and backward), `step_us` per step
    (loss, optimizer, zero_grad), `use_us_local` per weight use of a GTP group of one,
    `use_us` per weight use of a sharded group (its collectives' launches included),
    `fsdp2_block_us` per FSDP2 module group per step, and `block_us` per block on gathered
    weights per step (a group of one: its gathers cost `use_us - use_us_local` each beside
    it; None in a calibration made before it was measured, which predicts every method but
    gtp_blocks). `fsdp2_block_us_local`: FSDP2's per group where it shards over one rank,
    where it gathers nothing (None: as `fsdp2_block_us`)."""

    layer_us: float
    step_us: float
    use_us_local: float
    use_us: float
    graph_step_us: float
    fsdp2_block_us: float
    block_us: float | None = None
    fsdp2_block_us_local: float | None = None


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A machine kind. `gpus_per_node` ranks share a node's fast link (an NVLink domain);
    `compute_units_per_node` of them compute at once (fewer on an oversubscribed CPU: ranks
    then share units). `async_host`: the host launches work ahead of the device (GPUs);
    otherwise host time adds to the step (CPU ranks run their own ops).
    `grouped_collectives`: a chain group's gathers go as one collective (NCCL), else one per
    weight (gloo). `contention_compute`: how much slower compute runs beside a collective;
    `contention_comm`: how much slower a collective runs beside compute."""

    name: str
    description: str
    nominal: bool
    gpus_per_node: int
    compute_units_per_node: float
    memory_gib: float
    async_host: bool
    grouped_collectives: bool
    intra: Link
    inter: Link
    compute: Compute
    host: Host
    contention_compute: float
    contention_comm: float
    runs: tuple[dict[str, Any], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()
    probe_s: float = 0.0  # calibrate.py's GEMM loop, alone, when it calibrated (0: none)
    # benchmarks/host_probe.py's workload on the host its host costs were measured on (0: none)
    host_probe_ms: float = 0.0

    def link(self, spans_nodes: bool) -> Link:
        return self.inter if spans_nodes else self.intra

    def share(self, world: int) -> float:
        """How many ranks share one compute unit (1 unless a node is oversubscribed)."""
        ranks = min(world, self.gpus_per_node)
        return max(1.0, ranks / self.compute_units_per_node)

    def without_comm(self) -> Cluster:
        """The same cluster with collectives that take no time and slow nothing beside them,
        as in a faked world of ranks (benchmarks/fake_world.py). Its host costs stay as
        calibrated: `use_us` and `fsdp2_block_us` still hold NCCL's own host work per
        collective, which a faked world does not do."""
        free = Curve(alpha_us=0.0, gbs=float("inf"), hop_us=0.0)
        link = Link(free, free)
        return dataclasses.replace(
            self, intra=link, inter=link, contention_compute=1.0, contention_comm=1.0
        )

    def with_inter_gbs(self, gbs: float) -> Cluster:
        """The same cluster with every inter-node curve at `gbs` GB/s per GPU."""
        inter = Link(
            dataclasses.replace(self.inter.all_gather, gbs=gbs),
            dataclasses.replace(self.inter.reduce_scatter, gbs=gbs),
        )
        return dataclasses.replace(self, inter=inter)


def _value(raw: Any, path: str, sources: dict[str, str]) -> Any:
    """A leaf's number; records its source under its dotted path."""
    if isinstance(raw, dict) and "value" in raw:
        if "source" in raw:
            sources[path] = str(raw["source"])
        return raw["value"]
    return raw


# Rates, sizes and counts a step divides by: a calibration must give them above zero.
_POSITIVE = ("gbs", "tflops", "gpus_per_node", "compute_units_per_node", "memory_gib",
             "gemm_units", "gemm_tile_m", "gemm_tile_n", "elementwise_bytes")  # fmt: skip


def _number(value: Any, path: str, where: str) -> Any:
    """A calibration's numeric leaf, checked: a finite number, above zero for the rates and
    sizes in `_POSITIVE`, else at least zero (times, overheads, contention)."""
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ClusterError(f"calibration {where}: {path}={value!r} is not a finite number")
    positive = path.rsplit(".", 1)[-1].endswith(_POSITIVE)
    if value < 0 or (positive and value == 0):
        need = "above 0" if positive else ">= 0"
        raise ClusterError(f"calibration {where}: {path}={value!r} must be {need}")
    return value


def _section(raw: dict, path: str, cls: type, sources: dict[str, str], where: str) -> Any:
    if not isinstance(raw, dict):
        raise ClusterError(f"calibration {where}: {path} must be an object, not {raw!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in raw and _has_no_default(cls, n)]
    if missing:
        raise ClusterError(f"calibration section {path!r} lacks {', '.join(missing)}")
    return cls(**{
        n: _number(_value(raw[n], f"{path}.{n}", sources), f"{path}.{n}", where)
        for n in names if n in raw
    })  # fmt: skip


def _has_no_default(cls: type, name: str) -> bool:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default is dataclasses.MISSING


def _link(raw: dict, path: str, sources: dict[str, str], where: str) -> Link:
    return Link(
        _section(raw["all_gather"], f"{path}.all_gather", Curve, sources, where),
        _section(raw["reduce_scatter"], f"{path}.reduce_scatter", Curve, sources, where),
    )


def cluster_from_dict(raw: dict, where: str) -> Cluster:
    """A Cluster from a calibration JSON's content; `where` names it in errors."""
    sources: dict[str, str] = {}
    if not isinstance(raw, dict):
        raise ClusterError(f"calibration {where} must hold a JSON object, not {type(raw).__name__}")
    numeric = ("gpus_per_node", "memory_gib", "contention_compute", "contention_comm")
    try:
        top = {
            k: _value(raw[k], k, sources)
            for k in (
                "name",
                "description",
                "nominal",
                "gpus_per_node",
                "memory_gib",
                "async_host",
                "grouped_collectives",
                "contention_compute",
                "contention_comm",
            )
        }
        for k in numeric:
            _number(top[k], k, where)
        units = _value(raw.get("compute_units_per_node", top["gpus_per_node"]), "units", sources)
        return Cluster(
            **top,
            compute_units_per_node=_number(units, "compute_units_per_node", where),
            intra=_link(raw["links"]["intra"], "links.intra", sources, where),
            inter=_link(raw["links"]["inter"], "links.inter", sources, where),
            compute=_section(raw["compute"], "compute", Compute, sources, where),
            host=_section(raw["host"], "host", Host, sources, where),
            runs=tuple(raw.get("runs", ())),
            probe_s=_value(raw.get("probe_s", 0.0), "probe_s", sources),
            host_probe_ms=_value(raw.get("host_probe_ms", 0.0), "host_probe_ms", sources),
            sources=tuple(sorted(sources.items())),
        )
    except KeyError as e:
        raise ClusterError(f"calibration {where} lacks the key {e}; see calibrate.py") from e
    except TypeError as e:  # a section that is not an object
        raise ClusterError(
            f"calibration {where} is not laid out as calibrate.py writes ({e})"
        ) from e


def calibration_dir() -> Path:
    """Where the calibration JSONs are: the installed package's copy, else the checkout's."""
    try:
        found = resources.files(CALIBRATION_PACKAGE)
        path = Path(str(found))
        if path.is_dir():
            return path
    except ModuleNotFoundError:
        pass
    return CHECKOUT_DIR


def available() -> list[str]:
    return sorted(p.stem for p in calibration_dir().glob("*.json"))


def load_cluster(name_or_path: str) -> Cluster:
    """A cluster by kind (`h200`, `gb200`, `cpu_gloo`) or by the path of a calibration JSON."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = calibration_dir() / f"{name_or_path}.json"
    if not path.is_file():
        raise ClusterError(
            f"no calibration {path}; clusters: {', '.join(available())}, or the path of a JSON "
            "written by benchmarks/calibrate.py"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ClusterError(f"{path} is not valid JSON ({e}); rewrite it with calibrate.py") from e
    return cluster_from_dict(raw, str(path))
