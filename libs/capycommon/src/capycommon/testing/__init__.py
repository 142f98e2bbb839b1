"""Test support that ships with CapyCTL: the engine simulator and simulated GPUs."""
