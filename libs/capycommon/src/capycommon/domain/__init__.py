"""CapyCTL's records: what the services write and read, as pure data.

No module here reaches Redis, the network or the filesystem (`tests/unit/test_domain.py`
holds it so): the state layer (`capycommon.state`) stores and reads these records, and the
services' pure code (the scheduler's plan, the router's table, the CLI's views) imports them
from here, never from the I/O layer.
"""
