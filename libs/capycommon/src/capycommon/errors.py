"""One error tree for CapyCTL.

Every expected failure is a `CapyError` with a stable string code. Codes map to CLI exit
codes and HTTP statuses in `capycommon.errorcodes`, and nowhere else.
"""

from __future__ import annotations

from typing import ClassVar, Self

from capycommon.errorcodes import exit_code_for, http_status_for


class CapyError(Exception):
    """An expected failure with a stable code and a message that names the fix."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]

    def retold(self, message: str) -> Self:
        """The same error (class and code) told with `message`."""
        told = type(self).__new__(type(self))
        Exception.__init__(told, message)
        told.__dict__.update(self.__dict__, message=message)
        return told

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.code)

    @property
    def http_status(self) -> int:
        return http_status_for(self.code)


class Internal(CapyError):
    """Something CapyCTL did not expect: a bug, or a peer that broke its own contract."""

    code = "internal"


class AgentUnreachable(CapyError):
    """A CapyCTL service (the management API, a host's agent) did not answer."""

    code = "agent_unreachable"


class InvalidConfig(CapyError):
    code = "invalid_config"


class CredentialsUnusable(CapyError):
    code = "credentials_unusable"


class Unauthenticated(CapyError):
    code = "unauthenticated"


class NotFound(CapyError):
    code = "not_found"


class ToolchainMissing(CapyError):
    code = "toolchain_missing"


class ServicePortInUse(CapyError):
    code = "service_port_in_use"


class StateDirInUse(CapyError):
    code = "state_dir_in_use"


class RoleNotRunning(CapyError):
    code = "role_not_running"


class RedisUnreachable(CapyError):
    code = "redis_unreachable"


class NotReplicated(CapyError):
    """A declaration written on the primary that no replica confirmed in time: it stands,
    but a loss of the primary before a replica catches up would lose it."""

    code = "not_replicated"


class StateCorrupt(CapyError):
    """The role's own data (its Redis append-only file) cannot be read: repair it first."""

    code = "state_corrupt"


class HostNameChanged(CapyError):
    """A state dir started under another host name than the one it keeps."""

    code = "host_name_changed"


class EngineEnvReserved(InvalidConfig):
    """A deployment sets an engine variable CapyCTL owns; the code names it (`:<NAME>`)."""

    code = "engine_env_reserved"


class RouteConflict(CapyError):
    code = "route_conflict"


class MultiGpuUnsupported(CapyError):
    """A deployment spans GPUs where it cannot: its engine runs on one GPU, or the host has one
    unified pool."""

    code = "multi_gpu_unsupported"


class TensorParallelInvalid(InvalidConfig):
    """A tensor-parallel size the engine refuses for the model (its attention heads), or one
    that disagrees with the devices named."""

    code = "tensor_parallel_invalid"


class NotEnoughGpus(CapyError):
    """A deployment spans more GPUs than the host has."""

    code = "not_enough_gpus"


class HostBackedUnavailable(CapyError):
    code = "host_backed_unavailable"


class ProfileNotPublished(CapyError):
    code = "profile_not_published"


class ModelSourcePending(CapyError):
    code = "model_source_pending"


# Engines: registering, controlling and launching them -----------------------------------


class EngineNotFound(CapyError):
    code = "engine_not_found"


class EngineVersionFailed(CapyError):
    code = "engine_version_failed"


class EngineUnsupported(CapyError):
    code = "engine_unsupported"


class ProfileExists(CapyError):
    code = "profile_exists"


class ProfileNotFound(NotFound):
    """No engine registered under that name."""


class EngineUnreachable(CapyError):
    code = "engine_unreachable"


class EngineTimeout(CapyError):
    code = "engine_timeout"


class EngineError(CapyError):
    """An engine failed a control call, or its answer broke the router's rules (not JSON,
    over the limits)."""

    code = "engine_error"


class CapabilityMissing(InvalidConfig):
    """`capability_missing:<name>`: a declared value the engine, host or checkpoint cannot do
    (`capability`)."""

    code = "capability_missing"

    def __init__(self, message: str, *, capability: str) -> None:
        super().__init__(message, code=f"{CapabilityMissing.code}:{capability}")
        self.capability = capability


class HostCapabilityMissing(CapyError):
    """`host_capability_missing:<name>`: the host's CapyCTL release cannot do what the
    deployment needs there (`capability`, one of `capycommon.domain.hosts.HOST_CAPABILITIES`)."""

    code = "host_capability_missing"

    def __init__(self, message: str, *, capability: str) -> None:
        super().__init__(message, code=f"{HostCapabilityMissing.code}:{capability}")
        self.capability = capability


class NotADecisionModel(InvalidConfig):
    """`api: decisions` on a model that is no decision model: no `decision_config.json`, no
    joint-head files, no GGUF decision metadata."""

    code = "not_a_decision_model"


class ApiNotServed(CapyError):
    """`capability_missing:<api>` as a request's refusal (400): the model's engine, at its
    version, does not serve the API the request was sent to."""

    code = "capability_missing"

    def __init__(self, message: str, *, api: str) -> None:
        super().__init__(message, code=f"{ApiNotServed.code}:{api}")
        self.api = api

    @property
    def http_status(self) -> int:
        return 400


class WrongApi(CapyError):
    """A request on a route of the other api than its deployment's (chat or decisions)."""

    code = "wrong_api"


class LMCacheUnavailable(InvalidConfig):
    """`lmcache_unavailable:<gate>`: a deployment says lmcache: required where a condition of
    LMCache's (`capycommon.engines.lmcache.Gate`) does not hold."""

    code = "lmcache_unavailable"

    def __init__(self, message: str, *, gate: str) -> None:
        super().__init__(message, code=f"{LMCacheUnavailable.code}:{gate}")
        self.gate = gate


class EngineRejected(CapyError):
    """The engine refused a request as sent (its 4xx answer)."""

    code = "engine_rejected"


class EngineFailed(CapyError):
    """The engine's own error answer to an inference request: its HTTP status and message,
    whatever shape it gave them. Code `engine_rejected` for a 4xx (the engine refused the
    request as sent), `engine_error` for a 5xx; the client gets the engine's status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        code = EngineRejected.code if status < 500 else EngineError.code
        super().__init__(message, code=code)
        self.status = status
        self.param = param

    @property
    def http_status(self) -> int:
        return self.status


class LaunchFailed(CapyError):
    code = "launch_failed"


class PortsExhausted(CapyError):
    """No engine port of the host's range is free."""

    code = "port_conflict"


# Memory: room on a device, and knowing there is room -------------------------------------


class InsufficientResources(CapyError):
    code = "insufficient_resources"


class DeviceUnobserved(CapyError):
    """No fresh reading of a device: admission is closed, or memwatch wrote none."""

    code = "device_unobserved"


# Requests: the inference and management APIs ------------------------------------------


class InvalidRequest(CapyError):
    code = "invalid_request"


class MethodNotAllowed(CapyError):
    """A route asked with a method it does not answer."""

    code = "method_not_allowed"


class UnsupportedParameter(CapyError):
    code = "unsupported_parameter"


class CacheSaltUnsupported(CapyError):
    """A request's cache_salt for an engine that cannot keep caches apart by it."""

    code = "cache_salt_unsupported"


class BodyTooLarge(CapyError):
    code = "body_too_large"


class RequestTimeout(CapyError):
    """A request's body did not arrive whole within its bound: a client sending it too slowly
    would hold its connection for as long as it liked."""

    code = "request_timeout"


class UnknownModel(CapyError):
    code = "unknown_model"


class QueueFull(CapyError):
    code = "queue_full"


class Unavailable(CapyError):
    """A request's model was not ready within its deadline, or its deployment failed."""

    code = "unavailable"


class ActivationFailed(CapyError):
    """A deployment's engine could not start: the requests waiting for it get the engine's
    own last log lines, and a later request starts it again after the retry's cooldown."""

    code = "activation_failed"


class DeploymentStopped(CapyError):
    code = "deployment_stopped"


class HostUnreachable(CapyError):
    """A joined host whose heartbeat lapsed: nothing is sent there until it comes back."""

    code = "host_unreachable"


class HostDrained(CapyError):
    """A host an operator drained: nothing new is placed there until it is undrained."""

    code = "host_drained"


class StaleDispatch(CapyError):
    """A host's ingress refused a request for an instance that no longer runs there at the
    generation the router admitted it to (it stopped or moved)."""

    code = "stale_dispatch"


class DeploymentInactive(CapyError):
    code = "deployment_inactive"


# Lifecycle: what a deployment is doing, and earlier requests -------------------------------


class LifecycleConflict(CapyError):
    code = "lifecycle_conflict"


class RevisionConflict(CapyError):
    code = "revision_conflict"


class ModelInUse(CapyError):
    """A model a deployment names or an engine runs from cannot be removed."""

    code = "model_in_use"


class IdempotencyConflict(CapyError):
    code = "idempotency_conflict"


class ActivationTimeout(CapyError):
    code = "activation_timeout"


# Certificates: the server's authority and the certificates it issues ----------------------


class CertificateInvalid(CapyError):
    """A certificate that does not check: not issued by the expected authority, outside its
    validity, not the kind it must be, or not a certificate at all."""

    code = "certificate_invalid"


class CertificateRequestRefused(InvalidRequest):
    """A certificate request the authority will not sign: a bad signature, another name than
    the invitation's, or a weak key."""


# Hosts joining a server ----------------------------------------------------------------


class InvitationRefused(CapyError):
    """A join the server will not take: an unknown, used or expired invitation, or another
    host name than the invitation's."""

    code = "invitation_refused"


class HostRevoked(CapyError):
    """The server revoked this host: its Redis user is gone and its certificate revoked."""

    code = "host_revoked"


class IdentityConflict(CapyError):
    """A name already held by a joined host: a name never replaces an identity."""

    code = "identity_conflict"


class HostNotRevoked(CapyError):
    """A recovery for a host that was never revoked."""

    code = "host_not_revoked"


class HostVersionIncompatible(CapyError):
    """A host and a server whose versions cannot talk."""

    code = "host_version_incompatible"


class StateDirNewer(CapyError):
    """A state dir written by a newer release line than this one: its data may be in a form
    this release cannot read."""

    code = "state_dir_newer"
