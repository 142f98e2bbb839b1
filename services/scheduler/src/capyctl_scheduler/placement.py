"""Placement: one GPU per model. A parked instance wakes where it parked; a pinned one goes
where it is pinned; otherwise the GPU with the most headroom in the ledger."""

from __future__ import annotations

from capycommon.errors import DeviceUnobserved
from capyctl_scheduler.ledger import Ledger


def headroom(ledger: Ledger, domain: str) -> int:
    """What the domain can still take before its managed limit or its free reserve."""
    return ledger.headroom(domain)


def place(
    ledger: Ledger, gpus: list[str], *, pinned: str | None = None, parked_on: str | None = None
) -> str:
    """The GPU (domain name) for one instance; admission decides whether it fits there."""
    if parked_on is not None:
        return parked_on
    if pinned is not None:
        if pinned not in gpus or pinned not in ledger.domains:
            raise DeviceUnobserved(f"devices[0].id: {pinned} has no fresh reading on this host")
        return pinned
    observed = [gpu for gpu in gpus if gpu in ledger.domains]
    if not observed:
        raise DeviceUnobserved("no GPU of this host has a fresh reading: admission is closed")
    # Most headroom first; on a tie, the lowest index (gpu0 before gpu1).
    return max(observed, key=lambda gpu: (headroom(ledger, gpu), -int(gpu.removeprefix("gpu"))))
