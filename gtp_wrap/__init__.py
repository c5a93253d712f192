"""gtp_wrap: Generalized Tensor Parallelism for PyTorch, one call to wrap any nn.Module.

`GTPWrap(module, policy)` (api.py) plans every parameter (config/), builds one `ShardedWeight`
per sharded weight over flat storage and registers its `GTPParameter` in place (core/), and
hands the module to an engine (runtime/engine.py), a facade over its parts: the passes and
their chains, the gatherer (prefetch, decode per precision/, rematerialize in backward), the
uses and their autograd functions, the gradient reducer (reduce-scatter, dp all-reduce,
finalize into `.grad`), the replicated all-reduce and the compute-copy casts. Collectives and
cross-rank agreement live in comm/, mesh roles in mesh.py, CUDA graphs in graphs/, state dicts
and checkpoints in io/. Each layer imports only the ones below it.
"""

import sys

from .api import GTPWrap, no_sync, reset_stats, stats
from .clip import clip_grad_norm_, grad_norm
from .compilation import compile, gather_per_block
from .config.policy import GTPPolicy, LayerRule
from .describe import Description, ParameterRow, describe
from .errors import (
    ChainMismatchError,
    CheckpointError,
    CollectiveError,
    CollectiveTimeoutError,
    GraphCaptureError,
    GTPError,
    NonFiniteError,
    PeerFailedError,
    PeerLostError,
    PolicyError,
    PolicyWarning,
    WrapError,
)
from .finite import nonfinite_grads
from .graphs import graph_region, graph_step, release_graphs
from .io import checkpoint
from .io.pretrained import load_pretrained, save_pretrained
from .io.state_dict import full_state_dict, load_full_state_dict
from .mesh import make_mesh

# `gtp_wrap.checkpoint` is the documented name of io/checkpoint.py: importable under it too.
sys.modules.setdefault(f"{__name__}.checkpoint", checkpoint)

__all__ = [
    "ChainMismatchError",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Description",
    "GTPError",
    "GraphCaptureError",
    "GTPPolicy",
    "GTPWrap",
    "LayerRule",
    "NonFiniteError",
    "ParameterRow",
    "PeerFailedError",
    "PeerLostError",
    "PolicyError",
    "PolicyWarning",
    "WrapError",
    "checkpoint",
    "clip_grad_norm_",
    "grad_norm",
    "compile",
    "describe",
    "full_state_dict",
    "gather_per_block",
    "graph_region",
    "graph_step",
    "load_full_state_dict",
    "load_pretrained",
    "make_mesh",
    "nonfinite_grads",
    "no_sync",
    "release_graphs",
    "reset_stats",
    "save_pretrained",
    "stats",
]
