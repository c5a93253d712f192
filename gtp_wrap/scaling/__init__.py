"""A calibrated cost model of GTP training steps: step time (compute, exposed communication,
host), memory per GPU and throughput for a model, a cluster and a mesh, with FSDP2 and tensor
parallelism modelled beside it. `gtp-plan` (cli.py) is its command line.

Layers, each file one concept: `model` (model shapes, weights, FLOPs), `precision` (bytes per
element), `mesh` (the mesh and where its groups sit), `cluster` (a machine kind's calibration),
`collectives` (α-β times of one collective), `chain` (the overlap of a pass's gathers, compute
and reductions), `memory`, `predict` (a step), `baselines` (FSDP2, TP), `validate` (measured
runs against predictions), `scale` (scaling tables and plots), `cli`. Nothing here imports torch.
"""

from .cluster import Cluster, load_cluster
from .mesh import Mesh
from .model import MODELS, ModelConfig
from .precision import Precision
from .predict import Plan, Prediction, predict

__all__ = [
    "MODELS",
    "Cluster",
    "Mesh",
    "ModelConfig",
    "Plan",
    "Precision",
    "Prediction",
    "load_cluster",
    "predict",
]
