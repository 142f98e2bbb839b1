"""The Redis layer: every key, and every read and write of the shared state, goes through here."""
