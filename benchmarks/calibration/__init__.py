"""Calibration JSONs of the cost model, one per machine kind; installed as
`gtp_wrap.scaling.calibration` (scripts/ makes them and is not installed)."""
