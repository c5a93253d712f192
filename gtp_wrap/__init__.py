"""gtp_wrap: Generalized Tensor Parallelism for PyTorch, one call to wrap any nn.Module."""

from .api import GTPWrap, no_sync, reset_stats, stats
from .clip import clip_grad_norm_
from .errors import (
    ChainMismatchError,
    CollectiveError,
    CollectiveTimeoutError,
    GraphCaptureError,
    GTPError,
    PolicyError,
    WrapError,
)
from .graphs import graph_region, graph_step, release_graphs
from .policy import GTPPolicy, LayerRule
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "ChainMismatchError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "GTPError",
    "GraphCaptureError",
    "GTPPolicy",
    "GTPWrap",
    "LayerRule",
    "PolicyError",
    "WrapError",
    "clip_grad_norm_",
    "full_state_dict",
    "graph_region",
    "graph_step",
    "load_full_state_dict",
    "no_sync",
    "release_graphs",
    "reset_stats",
    "stats",
]
