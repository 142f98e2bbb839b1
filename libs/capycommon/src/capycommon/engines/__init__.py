"""Engines: the families CapyCTL drives, their registration, and one adapter per family."""
