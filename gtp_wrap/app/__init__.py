"""The application layer: the reference model, the embedded data and the `gtp-train` Hydra app."""
