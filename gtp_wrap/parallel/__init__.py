"""Parallelism composed with GTP: torch's tensor parallelism (tensor.py)."""
