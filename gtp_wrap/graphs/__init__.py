"""CUDA-graph capture of a GTP training step, whole (`graph_step`) or by regions
(`graph_region`); `release_graphs` frees them before the process group goes."""

from .capture import release_graphs
from .region import graph_region
from .step import GraphedStep, graph_step

__all__ = ["GraphedStep", "graph_region", "graph_step", "release_graphs"]
