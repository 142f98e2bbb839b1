"""Helper modules CapyCTL places on an engine's PYTHONPATH (stdlib only: they run in the
engine's own environment)."""
