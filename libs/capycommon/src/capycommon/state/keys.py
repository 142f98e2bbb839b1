"""Every Redis key and channel name CapyCTL uses. Nothing else spells a key.

Control-plane keys live under `capyctl:`; everything a host's hostd and memwatch write,
and the command stream they read, lives under `capyctl:host:<host>:`, so a remote host's
Redis user can be limited to its own prefix.
"""

from __future__ import annotations

PREFIX = "capyctl"

CONTROL_SERVICES = frozenset({"router", "scheduler"})
HOST_SERVICES = frozenset({"hostd", "memwatch"})


def host_prefix(host: str) -> str:
    return f"{PREFIX}:host:{host}"


def heartbeat(service: str, host: str, server: str = "") -> str:
    """The heartbeat of one service process; host services under their host's prefix, and
    a replicated server's control services under their server's address (`server`), as
    every server runs its own. A worker of a service beats under its own name, the
    service's and its number (router-0)."""
    kind = service.split("-", 1)[0]
    if kind in HOST_SERVICES:
        return f"{host_prefix(host)}:heartbeat:{service}"
    if kind in CONTROL_SERVICES:
        return f"{PREFIX}:heartbeat:{service}{_at(server)}"
    raise ValueError(f"unknown service {service!r}")


def worker_heartbeats(service: str, server: str = "") -> str:
    """The pattern of the heartbeats of a control service's workers (on `server`)."""
    return f"{PREFIX}:heartbeat:{service}-*{_at(server)}"


def _at(server: str) -> str:
    return f"@{server}" if server else ""


def engines(host: str) -> str:
    """The engine registry a host publishes (JSON of `PublishedEngines`)."""
    return f"{host_prefix(host)}:engines"


def host_info(host: str) -> str:
    """What a host says of itself (JSON of `hosts.HostInfo`), written by hostd."""
    return f"{host_prefix(host)}:info"


def host_models(host: str) -> str:
    """The host's models (JSON of `capycommon.domain.models.HostModels`), written by hostd."""
    return f"{host_prefix(host)}:models"


def host_store_operation(host: str, operation: str) -> str:
    """A pull or removal in a host's model store and how it ended (JSON of
    `capycommon.domain.hosts.StoreOperation`), written by hostd."""
    return f"{host_prefix(host)}:store-operation:{operation}"


def host_download(host: str, deployment: str) -> str:
    """A deployment's model download under way on a host (JSON of
    `capycommon.domain.hosts.Download`), written by hostd; gone once it ended."""
    return f"{host_prefix(host)}:download:{deployment}"


def engine_log_reply(host: str, reply: str) -> str:
    """The pub/sub channel on which a host answers one request for an engine log's tail."""
    return f"{host_prefix(host)}:log-reply:{reply}"


def host_notifications(host: str) -> str:
    """The pub/sub channel on which a host's state changes are announced ({kind, id, version})."""
    return f"{host_prefix(host)}:notify"


def host_commands(host: str) -> str:
    """The stream of commands the scheduler sends to a host's hostd."""
    return f"{host_prefix(host)}:commands"


def host_events(host: str) -> str:
    """The stream of what happened on a host: transitions, refusals, with durations."""
    return f"{host_prefix(host)}:events"


def instance(host: str, deployment: str, index: int) -> str:
    """The observed state of one instance, written by the host's hostd only."""
    return f"{host_prefix(host)}:instance:{deployment}:{index}"


def instances(host: str) -> str:
    """The set of `<deployment>:<index>` members with an instance record on the host."""
    return f"{host_prefix(host)}:instances"


def instance_secret(host: str, deployment: str, index: int) -> str:
    """The per-launch key of an instance's engine (read by hostd and the router only)."""
    return f"{host_prefix(host)}:instance-secret:{deployment}:{index}"


def instance_log(host: str, deployment: str, index: int) -> str:
    """The last lines of an instance's engine log (redacted)."""
    return f"{host_prefix(host)}:instance-log:{deployment}:{index}"


def memory(host: str) -> str:
    """The host's latest memory reading (memwatch)."""
    return f"{host_prefix(host)}:memory"


def memory_notifications(host: str) -> str:
    """The pub/sub channel on which memwatch announces each reading of the host and hostd asks
    for readings while it verifies a park ({kind, id, version})."""
    return f"{host_prefix(host)}:memory-notify"


def startup_peak(host: str, deployment: str, revision: int, fingerprint: str) -> str:
    """The measured startup peak of a deployment revision on a host with one engine build."""
    return f"{host_prefix(host)}:startup-peak:{deployment}:{revision}:{fingerprint}"


def cache_server_rss(host: str, fingerprint: str) -> str:
    """The measured resident memory of an LMCache server (its pool aside) of one build on a
    host, in bytes."""
    return f"{host_prefix(host)}:lmcache-rss:{fingerprint}"


def request_ends(host: str) -> str:
    """Stream of aborted requests the host's engines have ended (`capycommon.state.settlement`)."""
    return f"{host_prefix(host)}:request-ends"


def engine_load(host: str) -> str:
    """Hash of `<deployment>:<index>` -> the engine's running and waiting requests (hostd)."""
    return f"{host_prefix(host)}:engine-load"


# The control plane: desired state, demands and choices (the scheduler owns these keys).


def deployment(name: str) -> str:
    """The desired state of one deployment (`DeploymentRecord`), written by the scheduler."""
    return f"{PREFIX}:deployment:{name}"


def deployments() -> str:
    """The set of declared deployment names."""
    return f"{PREFIX}:deployments"


def demands() -> str:
    """The stream of demands (a model is wanted) that routers and the CLI append to."""
    return f"{PREFIX}:demands"


def events() -> str:
    """The stream of the scheduler's choices, each with its reason."""
    return f"{PREFIX}:events"


def notifications() -> str:
    """The pub/sub channel on which control-plane changes are announced ({kind, id, version})."""
    return f"{PREFIX}:notify"


def gpu_memory() -> str:
    """What the scheduler's ledger charges on each GPU, by phase, with the GPU's limits
    (`capycommon.domain.memory.GpuMemory`), for the router's metrics."""
    return f"{PREFIX}:gpu-memory"


def idempotency(key: str) -> str:
    """The recorded answer to a management mutation, by its Idempotency-Key."""
    return f"{PREFIX}:idempotency:{key}"


def page_session(digest: str) -> str:
    """A status page login's session, by the SHA-256 of its id (the id is in its cookie
    alone), expiring with it (`capycommon.state.pagesessions`)."""
    return f"{PREFIX}:page-session:{digest}"


def hosts() -> str:
    """The set of host names known to the control plane."""
    return f"{PREFIX}:hosts"


def places(deployment: str) -> str:
    """The request places of a deployment's current generation (`capycommon.state.places`)."""
    return f"{PREFIX}:places:{deployment}"


def waiting() -> str:
    """Hash of `<deployment> <owner>` -> the requests a router worker holds waiting for a
    place (`capycommon.state.places`)."""
    return f"{PREFIX}:waiting"


def place_owners() -> str:
    """Sorted set of the router workers that hold places, each scored with the time it
    expires unless refreshed (`capycommon.state.places`)."""
    return f"{PREFIX}:place-owners"


# Joined hosts: the server's own records of them (never under a host's prefix, so no host
# can write them), and the renewal exchange under each host's prefix.


def server_version() -> str:
    """The server's CapyCTL version: the one key outside their prefix that hosts may read."""
    return f"{PREFIX}:server-version"


def invitation(invitation_id: str) -> str:
    """A pending invitation by its id (sha256 of its secret), expiring with it."""
    return f"{PREFIX}:invitation:{invitation_id}"


def host_identity(host: str) -> str:
    """What the server knows of a joined host (`capycommon.domain.hosts.HostIdentity`)."""
    return f"{PREFIX}:host-identity:{host}"


def revoked_serials() -> str:
    """The serials of every certificate revoked, kept for ever."""
    return f"{PREFIX}:revoked-serials"


def certificate_request(host: str) -> str:
    """A host's request for a renewed certificate (its CSR), which the scheduler signs."""
    return f"{host_prefix(host)}:certificate-request"


def certificate(host: str) -> str:
    """The host's renewed certificate, written by the scheduler for the host to take."""
    return f"{host_prefix(host)}:certificate"


def unreachable_hosts() -> str:
    """Joined hosts the scheduler found unreachable (their hostd's heartbeat lapsed): host ->
    since when (Unix seconds). Routers send nothing there."""
    return f"{PREFIX}:unreachable-hosts"


def refusals() -> str:
    """Hash: `<host>:<kind>` -> how many values the control plane refused (`quarantine`)."""
    return f"{PREFIX}:refusals"


def topology() -> str:
    """The servers' Sentinels and how to ask them for the primary
    (`capycommon.replication.Topology`), which hosts may read."""
    return f"{PREFIX}:topology"


def replication_probe() -> str:
    """A counter the management API increments to wait on: once a replica holds it, the
    replica holds every write before it (`capycommon.state.replicas`)."""
    return f"{PREFIX}:replication-probe"


def host_users() -> str:
    """Hash: joined host -> the SHA-256 of its Redis user's password. Each server applies it
    to its own Redis's users, which replication does not carry (`capycommon.state.acl`)."""
    return f"{PREFIX}:host-users"


def scheduler_lease() -> str:
    """The scheduler lease (`capycommon.domain.leader.Lease`), expiring unless renewed."""
    return f"{PREFIX}:scheduler-lease"


def scheduler_plan_times() -> str:
    """What the leader's planning ticks cost (`capycommon.domain.leader.PlanTimes`)."""
    return f"{PREFIX}:scheduler-plan-times"


def scheduler_epoch() -> str:
    """The fencing epoch of the latest lease: it only grows. Hosts may read it (and nothing
    else outside their prefix but the server's version) to refuse a deposed leader."""
    return f"{PREFIX}:scheduler-epoch"


def drained_hosts() -> str:
    """Hosts an operator drained: nothing new is placed there until undrained."""
    return f"{PREFIX}:drained-hosts"
