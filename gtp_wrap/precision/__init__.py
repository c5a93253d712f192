"""Gather encodings (plain, cast, FP8) and their kernels."""
