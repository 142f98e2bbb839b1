"""CapyCTL hostd: the only component that starts, parks, wakes and stops engines on its host."""
