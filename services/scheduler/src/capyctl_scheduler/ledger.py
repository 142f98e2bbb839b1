"""The memory ledger: domains, what each instance is charged per phase, and admission.

Pure functions over figures; nothing here reads Redis or the clock. Reservations use the
declared, measured or derived figures, never sampled use, and an uncertain instance keeps its
charge until its processes are proven gone (the caller keeps charging it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from capycommon.domain.memory import MemoryReading
from capycommon.errors import DeviceUnobserved, InsufficientResources
from capycommon.units import format_size, parse_size

if TYPE_CHECKING:
    from capyctl_scheduler.engineterms import EngineTerms

GiB = 1 << 30
SYSTEM = "system"
UNIFIED = "unified"

BESIDE_BUDGET = 5 * GiB // 4  # a ready engine's CUDA context and graphs beside its budget
ENGINE_HOST_OVERHEAD = 4 * GiB  # an engine's host RAM, a placeholder until measured

Phase = Literal["cold", "starting", "ready", "parked", "waking"]
# whole_device: a derived peak above the domain's limit; the start needs the domain empty.
Provenance = Literal["declared", "measured", "derived", "whole_device"]


@dataclass(frozen=True)
class Domain:
    """One memory pool: a GPU, the host's RAM (`system`), or the one `unified` pool."""

    name: str
    capacity: int
    managed_limit: int
    free_reserve: int
    parked_limit: int


@dataclass(frozen=True)
class Limits:
    """Operator overrides of one kind of domain: a size (`24GiB`) or a share (`40%`)."""

    managed_limit: str | None = None
    free_reserve: str | None = None
    parked_limit: str | None = None


def _limit(value: str | None, total: int, default: int) -> int:
    if value is None:
        return default
    if value.endswith("%"):
        return total * int(value[:-1]) // 100
    return parse_size(value)


def _domain(name: str, total: int, defaults: tuple[int, int, int], limits: Limits) -> Domain:
    managed, reserve, parked = defaults
    return Domain(
        name,
        total,
        managed_limit=_limit(limits.managed_limit, total, managed),
        free_reserve=_limit(limits.free_reserve, total, reserve),
        parked_limit=_limit(limits.parked_limit, total, parked),
    )


def derive_domains(
    reading: MemoryReading, system: Limits = Limits(), gpu: Limits = Limits()
) -> list[Domain]:
    """The standalone-derived policy, unless overridden: 50% managed, 20% reserve, 25% parked
    of RAM (or of the unified pool); a card keeps max(1 GiB, 8%) in reserve, manages the rest
    and parks min(8 GiB, 25%)."""
    ram = reading.ram.total_bytes
    if any(g.unified for g in reading.gpus):
        total = max(ram, *(g.total_bytes for g in reading.gpus))
        return [_domain(UNIFIED, total, (total // 2, total // 5, total // 4), system)]
    domains = [_domain(SYSTEM, ram, (ram // 2, ram // 5, ram // 4), system)]
    for card in reading.gpus:
        total = card.total_bytes
        reserve = max(GiB, total * 8 // 100)
        defaults = (total - reserve, reserve, min(8 * GiB, total // 4))
        domains.append(_domain(f"gpu{card.index}", total, defaults, gpu))
    return domains


@dataclass(frozen=True)
class Footprint:
    """Bytes per domain in each phase, and where the startup figures came from.

    `engine_budget` is what the engine is told it may take on its device (weights, KV cache
    and activations; the CUDA context comes on top), `kv_cache` the KV part of it."""

    phases: Mapping[Phase, Mapping[str, int]]
    device_provenance: Provenance
    host_provenance: Provenance
    engine_budget: int
    kv_cache: int
    # Its LMCache server's charge (host RAM, device bytes) and where the figure of the
    # server's own memory came from; None without one.
    cache_bytes: tuple[int, int] | None = None
    cache_provenance: Provenance | None = None

    def charge(self, phase: Phase) -> Mapping[str, int]:
        return self.phases.get(phase, {})

    def with_cache(
        self, host_bytes: int, device: tuple[str, int], provenance: Provenance
    ) -> Footprint:
        """This footprint with an LMCache server beside the engine in every phase but cold:
        its pool and own memory in host RAM (`host_bytes`, on the system domain, or the one
        pool of unified memory), and its CUDA context on the engine's device."""
        domain, device_bytes = device
        phases: dict[Phase, Mapping[str, int]] = {}
        for phase, charge in self.phases.items():
            if phase == "cold":
                phases[phase] = charge
                continue
            added = dict(charge)
            home = UNIFIED if UNIFIED in charge else SYSTEM
            added[home] = added.get(home, 0) + host_bytes
            added[domain] = added.get(domain, 0) + device_bytes
            phases[phase] = added
        return replace(
            self,
            phases=phases,
            cache_bytes=(host_bytes, device_bytes),
            cache_provenance=provenance,
        )


def _startup(
    derived: int, ceiling: int, figure: tuple[int, Provenance] | None
) -> tuple[int, Provenance]:
    """A declared or measured peak as it is; a derived one above what the domain can ever
    hold is the whole domain: the start needs it empty (a solo first start)."""
    if figure is not None:
        return figure
    if derived > ceiling:
        return ceiling, "whole_device"
    return derived, "derived"


def derive_discrete(
    *,
    gpu: str,
    weights: int,
    device: Domain,
    host_backed: bool,
    terms: EngineTerms,
    request: int | None = None,
    kv_cache: int | None = None,
    startup: tuple[int, Provenance] | None = None,
    startup_host: tuple[int, Provenance] | None = None,
) -> Footprint:
    """A discrete-GPU deployment: device request (its budget) = weights x 1.10 + KV (or the
    declared request), plus 1.25 GiB of CUDA context and graphs when ready; 4 GiB of engine
    host overhead (until measured); a host_backed copy is 1.5 x weights of host RAM for the
    engine's whole life. An unmeasured start is charged what its engine's own terms reach
    (`EngineTerms.startup_peak`), at least its ready charge; parked, what its park leaves
    (`EngineTerms.parked_residue`), at most its ready charge.

    `gpu` may name a set (`gpu0+gpu1`, `gpusets`): each of its N GPUs is then charged its
    rank's share, worked out as above from weights / N (the request, KV cache and startup
    figures are per GPU, as the engines read them); host RAM is charged once, with the
    engine overhead once per rank and the host_backed copy once for the whole model.
    `device` is the set's smallest GPU."""
    gpus = gpu.split("+")
    ranks = len(gpus)
    share = weights // ranks
    kv = kv_cache if kv_cache is not None else min(4 * GiB, device.managed_limit // 4)
    budget = request if request is not None else share * 110 // 100 + kv
    ready_device = budget + BESIDE_BUDGET
    copy = weights * 3 // 2 if host_backed else 0
    overhead = ENGINE_HOST_OVERHEAD * ranks
    host_start, host_provenance = startup_host or (overhead, "derived")
    host = max(host_start, overhead) + copy
    derived = max(ready_device, terms.startup_peak(share, kv, budget, device.capacity))
    ceiling = min(device.managed_limit, device.capacity - device.free_reserve)
    peak, provenance = _startup(derived, ceiling, startup)
    residue = min(terms.parked_residue(), ready_device)

    def each(device_bytes: int) -> dict[str, int]:
        return {**dict.fromkeys(gpus, device_bytes), SYSTEM: host}

    ready = each(ready_device)
    return Footprint(
        phases={
            "cold": {},
            "starting": each(max(peak, ready_device)),
            "ready": ready,
            "waking": ready,
            "parked": each(residue),
        },
        device_provenance=provenance,
        host_provenance=host_provenance,
        engine_budget=budget,
        kv_cache=kv,
    )


def derive_unified(
    *,
    weights: int,
    domain: Domain,
    terms: EngineTerms,
    request: int | None = None,
    kv_cache: int | None = None,
    startup: tuple[int, Provenance] | None = None,
) -> Footprint:
    """A deployment on unified memory, charged on the one pool: request = weights + KV +
    margin (8 GiB, or 0.15 x weights + 4 GiB when larger); parked keeps 2 GiB (the engine
    process's own memory lives in the same pool). An unmeasured start is charged the most of
    its ready charge, its engine's own terms, and weights x 2.25 + margin: the files its
    loader reads land in the same pool as the copy it makes (a GB10 held 54.2 GiB loading a
    model it ran in 43.95, the eager loader; 34.5 in 26.63, the lazy one)."""
    kv = kv_cache if kv_cache is not None else min(4 * GiB, domain.managed_limit // 4)
    margin = max(8 * GiB, weights * 15 // 100 + 4 * GiB)
    ready = request if request is not None else weights + kv + margin
    budget = min(ready, weights * 110 // 100 + kv)
    engine = terms.startup_peak(weights, kv, budget, domain.capacity)
    derived = max(ready + BESIDE_BUDGET, weights * 9 // 4 + margin, engine)
    ceiling = min(domain.managed_limit, domain.capacity - domain.free_reserve)
    peak, provenance = _startup(derived, ceiling, startup)
    return Footprint(
        phases={
            "cold": {},
            "starting": {UNIFIED: max(peak, ready)},
            "ready": {UNIFIED: ready},
            "waking": {UNIFIED: ready},
            "parked": {UNIFIED: min(2 * GiB, ready)},
        },
        device_provenance=provenance,
        host_provenance=provenance,
        engine_budget=budget,
        kv_cache=kv,
    )


def stated(*, gpu: str | None, gpu_bytes: int, ram_bytes: int) -> Footprint:
    """A deployment whose `resources` state its memory (restart-only): those figures while it
    starts, serves and stops, nothing while stopped or parked (it never parks). `gpu` None: on
    unified memory, their sum on the one pool."""
    charge = (
        {UNIFIED: gpu_bytes + ram_bytes} if gpu is None else {gpu: gpu_bytes, SYSTEM: ram_bytes}
    )
    return Footprint(
        phases={"cold": {}, "starting": charge, "ready": charge, "waking": charge, "parked": {}},
        device_provenance="declared",
        host_provenance="declared",
        engine_budget=gpu_bytes,
        kv_cache=0,
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
    # Every owner's charges summed per domain, and the headrooms asked for, each worked out
    # once: a plan asks for them often (each GPU of each host, for each start).
    _totals: dict[str, int] = field(init=False, repr=False, compare=False)
    _headrooms: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        totals: dict[str, int] = {}
        for charge in self.charges.values():
            for domain, size in charge.items():
                totals[domain] = totals.get(domain, 0) + size
        object.__setattr__(self, "_totals", totals)
        object.__setattr__(self, "_headrooms", {})

    def headroom(self, domain: str) -> int:
        """What the domain can still take before its managed limit or its free reserve."""
        found = self._headrooms.get(domain)
        if found is None:
            limits = self.domains[domain]
            ceiling = min(limits.managed_limit, limits.capacity - limits.free_reserve)
            found = self._headrooms[domain] = ceiling - self.total(domain)
        return found

    def total(self, domain: str, without: str | None = None) -> int:
        found = self._totals.get(domain, 0)
        if without is not None and without in self.charges:
            found -= self.charges[without].get(domain, 0)
        return found

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

    def fits(self, owner: str, charge: Mapping[str, int]) -> bool:
        """Whether `charge` would leave every domain within its limits (`refusals` finds
        none), from the headrooms worked out once; False where a domain is unobserved."""
        own = self.charges.get(owner, {})
        return all(
            name in self.domains and needs <= self.headroom(name) + own.get(name, 0)
            for name, needs in charge.items()
        )

    def admit(self, owner: str, charge: Mapping[str, int]) -> Ledger:
        """The ledger with `owner` charged `charge`, or InsufficientResources with figures."""
        refusals = self.refusals(owner, charge)
        if refusals:
            raise InsufficientResources("; ".join(str(r) for r in refusals))
        return Ledger(self.domains, {**self.charges, owner: dict(charge)})

    def release(self, owner: str) -> Ledger:
        """Only once the owner's processes are proven gone."""
        return Ledger(self.domains, {o: c for o, c in self.charges.items() if o != owner})
