"""CapyCTL memwatch: the only component that measures memory on its host."""
