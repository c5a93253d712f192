"""pytest wiring: tests import what they share from harness.py (started ranks, caching,
meshes, references)."""
