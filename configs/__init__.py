"""The built-in gtp-train configs (train.yaml, model/, policy/), shipped as gtp_wrap.configs."""
