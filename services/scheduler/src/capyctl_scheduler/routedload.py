"""The load of an engine CapyCTL reads no metrics from (TensorFold, a custom engine), as the
routers' places show it.

hostd publishes no reading for such an engine, so the scheduler makes one from each
snapshot's places: the requests routers hold on it now, and when it last saw any (a router
keeps a spare place for at most `places.SPARE_IDLE_S` after a request ends, so a spare counts
as a recent request). It is kept in memory across snapshots, by deployment and generation;
after a restart of the scheduler an engine's last request counts from its start, as it would
with no reading at all.
"""

from __future__ import annotations

from collections.abc import Mapping

from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.places import Places
from capycommon.engines.families import LOAD_UNREAD
from capyctl_scheduler.snapshot import Binding

SERVING = (InstanceState.READY, InstanceState.DRAINING)


class RoutedLoads:
    def __init__(self) -> None:
        # deployment -> (generation, when the routers last held a place on it)
        self._active: dict[str, tuple[int, float]] = {}

    def loads(
        self,
        now: float,
        instances: Mapping[str, InstanceRecord],
        places: Mapping[str, Places],
        bindings: Mapping[str, Mapping[str, Binding]],
    ) -> dict[str, EngineLoad]:
        """A reading for each serving instance of an unmetered engine."""
        found: dict[str, EngineLoad] = {}
        for name, instance in instances.items():
            binding = bindings.get(name, {}).get(instance.host)
            resolved = binding.resolved if binding else None
            if instance.state not in SERVING or resolved is None:
                continue
            if resolved.profile.family not in LOAD_UNREAD:
                continue
            held = places.get(name) or Places()
            if held.generation != instance.generation:
                held = Places()
            generation, last = self._active.get(name, (instance.generation, instance.since))
            if generation != instance.generation:
                last = instance.since
            if held.serving + held.spare > 0:
                last = now
            self._active[name] = (instance.generation, last)
            found[name] = EngineLoad(
                generation=instance.generation,
                running=max(held.serving, 0),
                waiting=0,
                last_active_at=max(last, instance.since),
                read_at=now,
            )
        for gone in self._active.keys() - found.keys():
            del self._active[gone]
        return found
