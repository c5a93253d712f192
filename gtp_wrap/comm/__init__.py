"""Collectives (process group and copy engine) and cross-rank agreement."""
