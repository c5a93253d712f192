"""pytest wiring: tests import what they share from harness.py (spawned ranks, caching,
meshes, references)."""
