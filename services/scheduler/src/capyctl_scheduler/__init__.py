"""CapyCTL scheduler: the one place that decides, and the management API."""
