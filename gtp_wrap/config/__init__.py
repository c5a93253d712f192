"""Policies and rule matching: what to shard and how the engine runs."""
