"""The per-weight objects: geometry, the sharded weight, flat storage, the registered parameter,
and the wrap-time build that makes them."""
