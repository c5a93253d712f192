"""State dicts (DTensors, full exports) and sharded, reshardable checkpoints."""
