"""The engine of one wrapped module: a facade (engine.py) over its parts."""
