"""The Launch command a start sends hostd: the engine profile and model the deployment resolved
to on the host, the GPU placement chose, the engine's settings, and the share of memory the
engine is told it may take for the budget the ledger charged it: of the whole card for vLLM,
of what the ledger leaves free on the GPU as it starts for SGLang (`engineterms.told_share`)."""

from __future__ import annotations

from capycommon.deployments import Resolved
from capycommon.domain import commands as hc
from capycommon.domain.desired import DeploymentRecord
from capyctl_scheduler.actions import Action
from capyctl_scheduler.engineterms import told_share
from capyctl_scheduler.ledger import Footprint
from capyctl_scheduler.snapshot import Snapshot


def launch_command(snapshot: Snapshot, record: DeploymentRecord, action: Action) -> hc.Launch:
    """The launch of `action` (a start) for `record`, as the snapshot bound it to its host."""
    binding = snapshot.bindings[record.name][action.host]
    resolved = binding.resolved
    footprint = binding.footprints[action.gpu]
    view = snapshot.hosts[action.host]
    assert resolved is not None
    config = record.document.engine_config
    # Each rank is told its share of its own card: of the smallest card of a set.
    total = min(view.domains[domain].capacity for domain in view.domains_of(action.gpu))
    uuids = view.uuids_of(action.gpu)
    fraction = told_share(
        resolved.profile.family, footprint.engine_budget, total, _free(action, footprint, total)
    )
    return hc.Launch(
        deployment=record.name,
        generation=action.generation,
        revision=record.revision,
        profile=resolved.profile.name,
        model_path=str(resolved.model_path),
        served_name=record.document.routes[0],
        residency=resolved.residency.value,
        gpu_uuid=uuids[0],
        gpu_uuids=uuids if len(uuids) > 1 else (),
        tensor_parallel=len(uuids) if len(uuids) > 1 else None,
        memory_fraction=fraction,
        gpu_memory_bytes=footprint.engine_budget if record.document.resources else None,
        kv_cache_bytes=footprint.kv_cache if config.memory.kv_cache else None,
        context_length=config.context_length,
        max_concurrent_requests=config.max_concurrent_requests,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        extra_args=resolved.extra_args,
        env=dict(config.env),
        reason=action.reason,
        start_deadline_s=snapshot.tunables.start_deadline_s,
        hub=hc.HubPull.of(record.document.model),
        retention=record.document.retention,
        cache=_cache_launch(resolved, footprint),
        api=record.document.api,
    )


def _free(action: Action, footprint: Footprint, total: int) -> int:
    """The device bytes expected free for the engine as it starts: what the plan's ledger left
    free on its GPU (the whole card for a start planned without it), less the CUDA context of
    its LMCache server, which starts first."""
    free = total if action.device_free is None else action.device_free
    if footprint.cache_bytes is not None:
        free -= footprint.cache_bytes[1]
    return free


def _cache_launch(resolved: Resolved, footprint: Footprint) -> hc.CacheLaunch | None:
    """The LMCache server of a launch, and what it is charged (as the ledger charged it)."""
    if resolved.cache is None or footprint.cache_bytes is None:
        return None
    host_bytes, device_bytes = footprint.cache_bytes
    return hc.CacheLaunch(
        profile=resolved.cache.name,
        pool_bytes=resolved.cache_pool,
        host_bytes=host_bytes,
        device_bytes=device_bytes,
    )
