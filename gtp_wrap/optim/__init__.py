"""Optimizers for wrapped models: Muon with one Newton–Schulz owner per matrix."""

from .muon import Muon, muon_param_groups

__all__ = ["Muon", "muon_param_groups"]
