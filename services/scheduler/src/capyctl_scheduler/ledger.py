"""The memory ledger: domains, what each instance is charged per phase, and admission.

Pure functions over figures; nothing here reads Redis or the clock. Reservations use the
declared, measured or derived figures, never sampled use, and an uncertain instance keeps its
charge until its processes are proven gone (the caller keeps charging it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from capycommon.errors import CapyError
from capycommon.memory import MemoryReading
from capycommon.units import format_size

GiB = 1 << 30
SYSTEM = "system"
UNIFIED = "unified"

Phase = Literal["cold", "starting", "ready", "parked", "waking"]
Provenance = Literal["declared", "measured", "derived"]


class InsufficientResources(CapyError):
    code = "insufficient_resources"


class DeviceUnobserved(CapyError):
    code = "device_unobserved"


@dataclass(frozen=True)
class Domain:
    """One memory pool: a GPU, the host's RAM (`system`), or the one `unified` pool."""

    name: str
    capacity: int
    managed_limit: int
    free_reserve: int
    parked_limit: int


def derive_domains(reading: MemoryReading) -> list[Domain]:
    """The standalone-derived policy: 50% managed, 20% reserve, 25% parked of RAM (or of the
    unified pool); a card keeps max(1 GiB, 8%) in reserve and parks min(8 GiB, 25%)."""
    ram = reading.ram.total_bytes
    if any(gpu.unified for gpu in reading.gpus):
        total = max(ram, *(gpu.total_bytes for gpu in reading.gpus))
        return [Domain(UNIFIED, total, total // 2, total // 5, total // 4)]
    domains = [Domain(SYSTEM, ram, ram // 2, ram // 5, ram // 4)]
    for gpu in reading.gpus:
        reserve = max(GiB, gpu.total_bytes * 8 // 100)
        parked = min(8 * GiB, gpu.total_bytes // 4)
        domains.append(
            Domain(f"gpu{gpu.index}", gpu.total_bytes, gpu.total_bytes - reserve, reserve, parked)
        )
    return domains


@dataclass(frozen=True)
class Footprint:
    """Bytes per domain in each phase, and where the startup figure came from."""

    phases: Mapping[Phase, Mapping[str, int]]
    startup_provenance: Provenance

    def charge(self, phase: Phase) -> Mapping[str, int]:
        return self.phases.get(phase, {})


def derive_discrete(
    *,
    gpu: str,
    weights: int,
    device_limit: int,
    host_backed: bool,
    kv_cache: int | None = None,
    startup: tuple[int, Provenance] | None = None,
) -> Footprint:
    """A discrete-GPU deployment: device request = weights x 1.10 + KV, plus 1.25 GiB of CUDA
    context and graphs; 4 GiB of engine host overhead; a host_backed copy is 1.5 x weights of
    host RAM for the engine's whole life; parked keeps a 1 GiB device residue."""
    kv = kv_cache if kv_cache is not None else min(4 * GiB, device_limit // 4)
    ready_device = weights * 110 // 100 + kv + 5 * GiB // 4
    host = 4 * GiB + (weights * 3 // 2 if host_backed else 0)
    peak, provenance = startup or (max(ready_device, weights * 9 // 4 + 8 * GiB), "derived")
    ready = {gpu: ready_device, SYSTEM: host}
    return Footprint(
        phases={
            "cold": {},
            "starting": {gpu: max(peak, ready_device), SYSTEM: host},
            "ready": ready,
            "waking": ready,
            "parked": {gpu: min(GiB, ready_device), SYSTEM: host},
        },
        startup_provenance=provenance,
    )


@dataclass(frozen=True)
class Refusal:
    domain: str
    needs: int
    free: int
    reserve: int

    def __str__(self) -> str:
        return (
            f"needs {format_size(self.needs)} on {self.domain}, {format_size(self.free)} free, "
            f"{format_size(self.reserve)} reserve"
        )


@dataclass(frozen=True)
class Ledger:
    """Who is charged what, per domain. Charges replace (never add to) an owner's old ones."""

    domains: Mapping[str, Domain]
    charges: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def total(self, domain: str, without: str | None = None) -> int:
        return sum(c.get(domain, 0) for owner, c in self.charges.items() if owner != without)

    def refusals(self, owner: str, charge: Mapping[str, int]) -> list[Refusal]:
        """Every domain that would break its managed limit or its free reserve."""
        found = []
        for name, needs in charge.items():
            domain = self.domains.get(name)
            if domain is None:
                raise DeviceUnobserved(f"no fresh reading of {name}: admission is closed")
            others = self.total(name, without=owner)
            ceiling = min(domain.managed_limit, domain.capacity - domain.free_reserve)
            if others + needs > ceiling:
                found.append(Refusal(name, needs, max(0, ceiling - others), domain.free_reserve))
        return found

    def admit(self, owner: str, charge: Mapping[str, int]) -> Ledger:
        """The ledger with `owner` charged `charge`, or InsufficientResources with figures."""
        refusals = self.refusals(owner, charge)
        if refusals:
            raise InsufficientResources("; ".join(str(r) for r in refusals))
        return Ledger(self.domains, {**self.charges, owner: dict(charge)})

    def release(self, owner: str) -> Ledger:
        """Only once the owner's processes are proven gone."""
        return Ledger(self.domains, {o: c for o, c in self.charges.items() if o != owner})
