"""Exceptions a user of gtp_wrap can cause. Each message names the cause and the fix."""

from __future__ import annotations


class GTPError(Exception):
    """Base class of every error gtp_wrap raises on purpose."""


class PolicyError(GTPError, ValueError):
    """The sharding policy is invalid or does not fit the module (raised before any collective)."""


class PolicyWarning(UserWarning):
    """The policy does something the user likely did not mean (a rule that matches nothing, a
    wrap that shards no weight); `strict=True` turns it into a PolicyError."""


class WrapError(GTPError, RuntimeError):
    """The module or mesh cannot be wrapped as asked (raised before any collective)."""


class ChainMismatchError(GTPError, RuntimeError):
    """Ranks used their sharded weights in different orders, so their collectives would not pair."""


class CollectiveError(GTPError, RuntimeError):
    """A collective failed for a reason other than a timeout; the message carries the cause."""


class PeerFailedError(CollectiveError):
    """A peer rank failed (an exception ended one of its passes) while this rank waited for it;
    the message names the rank and its exception."""


class PeerLostError(CollectiveError):
    """A peer rank's connection closed while this rank waited for it: the peer exited or
    crashed without posting why (its own log says); the message carries the transport's cause."""


class CollectiveTimeoutError(GTPError, RuntimeError):
    """A collective did not complete in time: a peer rank is missing, crashed or diverged."""


class GraphCaptureError(GTPError, RuntimeError):
    """A step or region cannot be captured in a CUDA graph (or replayed with these inputs)."""


class CheckpointError(GTPError, RuntimeError):
    """A checkpoint cannot be written or read: missing, corrupted, or of another model."""


class NonFiniteError(GTPError, FloatingPointError):
    """A gradient holds NaN or Inf after its reduction (GTPPolicy.check_finite)."""
