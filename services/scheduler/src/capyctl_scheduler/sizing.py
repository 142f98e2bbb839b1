"""A resolved deployment's footprint on each GPU of a host: the ledger's figures for it, from
its memory settings, its engine's terms on that card, and the peaks declared or measured."""

from __future__ import annotations

from capycommon.deployments import Resolved
from capycommon.domain.engines import Residency
from capyctl_scheduler import gpusets
from capyctl_scheduler.engineterms import terms_of
from capyctl_scheduler.ledger import (
    UNIFIED,
    Domain,
    Footprint,
    Provenance,
    derive_discrete,
    derive_unified,
    stated,
)
from capyctl_scheduler.snapshot import HostView


def engine_footprints(
    resolved: Resolved,
    view: HostView,
    startup: tuple[int, Provenance] | None = None,
    startup_host: tuple[int, Provenance] | None = None,
) -> dict[str, Footprint]:
    """Its footprint on each GPU of `view` whose domain is observed (on unified memory one
    footprint on the pool, the same for every GPU); a deployment across N GPUs has one on
    each set of N observed GPUs it may take (`gpusets.candidates`). `startup` is the declared
    or measured device peak (per GPU), `startup_host` the measured host one; without them a
    start is derived."""
    memory = resolved.deployment.engine_config.memory
    weights = resolved.weights_bytes or 0
    resources = resolved.deployment.resources
    if resources is not None:
        if view.unified:
            pooled = stated(gpu=None, gpu_bytes=resources.gpu, ram_bytes=resources.ram)
            return dict.fromkeys(view.gpus, pooled)
        return {
            gpu: stated(gpu=gpu, gpu_bytes=resources.gpu, ram_bytes=resources.ram)
            for gpu in view.gpus
            if gpu in view.domains
        }
    if view.unified:
        pool = view.domains[UNIFIED]
        footprint = derive_unified(
            weights=weights,
            domain=pool,
            terms=terms_of(resolved, pool.capacity),
            request=memory.request,
            kv_cache=memory.kv_cache,
            startup=startup,
        )
        return dict.fromkeys(view.gpus, footprint)
    found = {}
    observed = [gpu for gpu in view.gpus if gpu in view.domains]
    count = resolved.deployment.gpu_count
    for place in gpusets.candidates(observed, count, resolved.devices if count > 1 else ()):
        device = min((view.domains[gpu] for gpu in gpusets.members(place)), key=_capacity)
        found[place] = derive_discrete(
            gpu=place,
            weights=weights,
            device=device,
            host_backed=resolved.residency == Residency.HOST_BACKED,
            terms=terms_of(resolved, device.capacity),
            request=memory.request,
            kv_cache=memory.kv_cache,
            startup=startup,
            startup_host=startup_host,
        )
    return found


def _capacity(domain: Domain) -> int:
    return domain.capacity
