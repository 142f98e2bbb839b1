"""Each deployment bound to each host (its engine resolved there and its footprints), kept
from one snapshot to the next.

A snapshot needs every pair of deployment and host: at 30 hosts and 300 deployments, 9,000
resolutions and 9,000 startup-peak reads a tick, which took seconds and starved the loop
(the lease it renews on the same loop lapsed). A pair is worked out anew only when what it
is worked out from changed: the deployment's revision, what the host publishes (its view,
engines and models), or what was measured of the engine there (its startup peak and cache
server). The peaks of every pair are read in one round trip."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.hosts import STARTUP_HOST_BYTES, TENSOR_PARALLEL
from capycommon.domain.memory import StartupPeak
from capycommon.domain.models import HostModels
from capycommon.engines import lmcache
from capycommon.engines.registry import PublishedEngines
from capycommon.errors import HostCapabilityMissing
from capycommon.state.stores import State
from capycommon.version import __version__
from capyctl_scheduler.ledger import Footprint, Provenance
from capyctl_scheduler.sizing import engine_footprints
from capyctl_scheduler.snapshot import Binding, HostView

Resolve = Callable[
    [DeploymentRecord, str, HostView, PublishedEngines | None, HostModels | None], Binding
]


class HostRead(Protocol):
    """What a snapshot read of one host, as far as binding needs it."""

    @property
    def host(self) -> str: ...
    @property
    def view(self) -> HostView: ...
    @property
    def engines(self) -> PublishedEngines | None: ...
    @property
    def models(self) -> HostModels | None: ...


class Bindings:
    def __init__(self, state: State, resolver: Resolve) -> None:
        self.state = state
        self.resolver = resolver
        # (deployment, host) -> what it was worked out from, and the binding
        self._resolved: dict[tuple[str, str], tuple[Hashable, Binding]] = {}
        self._bound: dict[tuple[str, str], tuple[Hashable, Binding]] = {}

    async def of(
        self, deployments: Mapping[str, DeploymentRecord], reads: Sequence[HostRead]
    ) -> dict[str, dict[str, Binding]]:
        """Every deployment bound to every host read."""
        hosts = {read.host: (read, _host_key(read)) for read in reads}
        resolved = {
            (name, host): self._resolution(record, read, key)
            for name, record in deployments.items()
            for host, (read, key) in hosts.items()
        }
        measured = [pair for pair, (_, b) in resolved.items() if _sized(b, hosts[pair[1]][0])]
        peaks = await self.state.memory.startup_peaks(
            [
                (host, name, deployments[name].revision, _profile(resolved[(name, host)][1]))
                for name, host in measured
            ]
        )
        found: dict[str, dict[str, Binding]] = {name: {} for name in deployments}
        for (name, host), (_, binding) in resolved.items():
            found[name][host] = binding
        for (name, host), peak in zip(measured, peaks, strict=True):
            key, binding = resolved[(name, host)]
            found[name][host] = await self._bound_with(
                deployments[name], hosts[host][0].view, (key, peak), binding, peak
            )
        self._forget(set(resolved))
        return found

    def _resolution(
        self, record: DeploymentRecord, read: HostRead, host_key: Hashable
    ) -> tuple[Hashable, Binding]:
        key = (record.revision, record.digest, host_key)
        kept = self._resolved.get((record.name, read.host))
        if kept is not None and kept[0] == key:
            return kept
        binding = self.resolver(record, read.host, read.view, read.engines, read.models)
        self._resolved[(record.name, read.host)] = (key, binding)
        return key, binding

    async def _bound_with(
        self,
        record: DeploymentRecord,
        view: HostView,
        key: Hashable,
        binding: Binding,
        peak: StartupPeak | None,
    ) -> Binding:
        resolved = binding.resolved
        assert resolved is not None
        rss = None
        if resolved.cache is not None:  # rare: read as it comes
            rss = await self.state.memory.cache_server_rss(view.name, resolved.cache.fingerprint)
            key = (key, rss)
        kept = self._bound.get((record.name, view.name))
        if kept is not None and kept[0] == key:
            return kept[1]
        try:
            _spans_here(record, view)
            footprints = _footprints(record, view, binding, peak, rss)
            bound = Binding(view.name, resolved, footprints)
        except HostCapabilityMissing as exc:
            bound = Binding(view.name, error=exc)
        self._bound[(record.name, view.name)] = (key, bound)
        return bound

    def _forget(self, pairs: set[tuple[str, str]]) -> None:
        """Drop what is kept of a deployment or host gone."""
        for kept in (self._resolved, self._bound):
            for pair in [pair for pair in kept if pair not in pairs]:
                del kept[pair]


def _host_key(read: HostRead) -> Hashable:
    """What a binding reads of a host, comparable from one snapshot to the next."""
    view = read.view
    return (
        tuple(sorted(view.domains.items())),
        tuple(sorted(view.gpus.items())),
        tuple(sorted((tuple(sorted(pair)), link) for pair, link in view.links.items())),
        (view.unified, view.deep_park, view.lmcache, view.retention_zero),
        (view.version, tuple(sorted(view.capabilities))),
        None if read.engines is None else read.engines.model_dump_json(),
        None if read.models is None else read.models.model_dump_json(),
    )


def _sized(binding: Binding, read: HostRead) -> bool:
    """Whether the binding is sized on the host: resolved, on a host with a fresh reading."""
    return binding.resolved is not None and bool(read.view.domains)


def _profile(binding: Binding) -> str:
    assert binding.resolved is not None
    return binding.resolved.profile.fingerprint


def _footprints(
    record: DeploymentRecord,
    view: HostView,
    binding: Binding,
    peak: StartupPeak | None,
    rss: int | None,
) -> dict[str, Footprint]:
    resolved = binding.resolved
    assert resolved is not None
    memory = record.document.engine_config.memory
    startup: tuple[int, Provenance] | None = None
    startup_host: tuple[int, Provenance] | None = None
    if memory.startup is not None:
        startup = (memory.startup, "declared")
    elif peak is not None:
        startup = (peak.device_bytes, "measured")
    if peak is not None:
        _measured_here(record, view)
        startup_host = (peak.host_bytes, "measured")
    found = engine_footprints(resolved, view, startup, startup_host)
    if resolved.cache is None:
        return found
    server: int = lmcache.SERVER_HOST_ESTIMATE
    provenance: Provenance = "derived"
    if rss is not None:
        server, provenance = rss, "measured"
    host_bytes = resolved.cache_pool + server
    return {
        gpu: footprint.with_cache(
            host_bytes, (view.domain_of(gpu), lmcache.SERVER_DEVICE_ESTIMATE), provenance
        )
        for gpu, footprint in found.items()
    }


def _spans_here(record: DeploymentRecord, view: HostView) -> None:
    """A deployment across several GPUs goes only to a host whose release launches one."""
    if record.document.gpu_count > 1 and TENSOR_PARALLEL not in view.capabilities:
        spans = f"spans {record.document.gpu_count} GPUs, and host {view.name}"
        raise _missing(record, view, TENSOR_PARALLEL, spans, ", which launches an engine on one")


def _measured_here(record: DeploymentRecord, view: HostView) -> None:
    """A startup peak measured on a host with a discrete GPU is charged there only if the
    host's release measures a start's host RAM apart (`startup_host_bytes`)."""
    if not view.unified and STARTUP_HOST_BYTES not in view.capabilities:
        measured = f"has a startup peak measured on host {view.name}, which"
        raise _missing(record, view, STARTUP_HOST_BYTES, measured, " and cannot start it that way")


def _missing(
    record: DeploymentRecord, view: HostView, capability: str, what: str, why: str
) -> HostCapabilityMissing:
    """`host_capability_missing:<capability>`: what the deployment needs of the host, the
    release the host runs, why that cannot, and the upgrade that can."""
    release = f"CapyCTL {view.version}" if view.version else "a CapyCTL release that names none"
    return HostCapabilityMissing(
        f"{record.name!r} {what} runs {release}{why}; upgrade CapyCTL on {view.name} to the "
        f"server's release ({__version__})",
        capability=capability,
    )
