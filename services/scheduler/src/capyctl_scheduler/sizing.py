"""A resolved deployment's footprint on each GPU of a host: the ledger's figures for it, from
its memory settings, its engine's terms on that card, and the peaks declared or measured."""

from __future__ import annotations

from capycommon.deployments import Resolved
from capycommon.domain.engines import Residency
from capyctl_scheduler.engineterms import terms_of
from capyctl_scheduler.ledger import (
    UNIFIED,
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
    footprint on the pool, the same for every GPU). `startup` is the declared or measured
    device peak, `startup_host` the measured host one; without them a start is derived."""
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
    return {
        gpu: derive_discrete(
            gpu=gpu,
            weights=weights,
            device=view.domains[gpu],
            host_backed=resolved.residency == Residency.HOST_BACKED,
            terms=terms_of(resolved, view.domains[gpu].capacity),
            request=memory.request,
            kv_cache=memory.kv_cache,
            startup=startup,
            startup_host=startup_host,
        )
        for gpu in view.gpus
        if gpu in view.domains
    }
