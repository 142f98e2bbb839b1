"""One error tree for CapyCTL.

Every expected failure is a `CapyError` with a stable string code. Codes map to CLI exit
codes and HTTP statuses here, and nowhere else.
"""

from __future__ import annotations

from typing import ClassVar


class CapyError(Exception):
    """An expected failure with a stable code and a message that names the fix."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.code)

    @property
    def http_status(self) -> int:
        return http_status_for(self.code)


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


class HostNameChanged(CapyError):
    """A state dir started under another host name than the one it keeps."""

    code = "host_name_changed"


class EngineEnvReserved(InvalidConfig):
    """A deployment sets an engine variable CapyCTL owns; the code names it (`:<NAME>`)."""

    code = "engine_env_reserved"


class RouteConflict(CapyError):
    code = "route_conflict"


class MultiGpuUnsupported(CapyError):
    code = "multi_gpu_unsupported"


class HostBackedUnavailable(CapyError):
    code = "host_backed_unavailable"


class ProfileNotPublished(CapyError):
    code = "profile_not_published"


class ModelSourcePending(CapyError):
    code = "model_source_pending"


# CLI exit codes. A code carrying a suffix (`engine_env_reserved:<name>`) maps by its stem.
_EXIT_CODES: dict[str, int] = {
    "invalid_config": 2,
    "credentials_unusable": 2,
    "not_found": 2,
    "engine_env_reserved": 2,
    # The engine refused an inference request as sent (its own 4xx, relayed with its status).
    "engine_rejected": 2,
    "route_conflict": 2,
    "host_name_changed": 2,
    "unauthenticated": 3,
    "unauthorized": 3,
    "insufficient_resources": 4,
    "device_unobserved": 4,
    "service_port_in_use": 4,
    "capacity_blocked": 4,
    "unsupported": 5,
    "capability_missing": 5,
    "host_backed_unavailable": 5,
    "multi_gpu_unsupported": 5,
    # This release downloads no models: the document must name a local folder instead.
    "model_source_pending": 5,
    "activation_timeout": 10,
    "internal": 13,
    "launch_failed": 13,
    "host_revoked": 14,
    "host_ineligible": 15,
    "engine_not_found": 16,
    "engine_unsupported": 17,
    "engine_version_failed": 18,
    "profile_exists": 19,
    "profile_in_use": 20,
    "agent_unreachable": 22,
    "engine_unreachable": 22,
    "engine_timeout": 10,
    "engine_error": 13,
    "redis_unreachable": 22,
    "profile_not_published": 24,
    "still_stopping": 25,
    "toolchain_missing": 26,
    "role_not_running": 27,
    "state_dir_in_use": 28,
    # A request that conflicts with what the deployment is doing or with an earlier request.
    "lifecycle_conflict": 29,
    "revision_conflict": 29,
    "idempotency_conflict": 29,
}

_HTTP_STATUSES: dict[str, int] = {
    "invalid_config": 400,
    "invalid_request": 400,
    "engine_env_reserved": 400,
    "unauthenticated": 401,
    "forbidden": 403,
    "not_found": 404,
    "unknown_model": 404,
    "deployment_stopped": 409,
    "deployment_inactive": 409,
    "unsupported_parameter": 400,
    "engine_rejected": 400,
    "route_conflict": 409,
    "host_name_changed": 409,
    "profile_not_published": 409,
    "lifecycle_conflict": 409,
    "revision_conflict": 409,
    "idempotency_conflict": 409,
    "capability_missing": 409,
    "model_source_pending": 409,
    "multi_gpu_unsupported": 400,
    "host_backed_unavailable": 400,
    "body_too_large": 413,
    "queue_full": 429,
    "internal": 500,
    "engine_error": 500,
    "unavailable": 503,
    "insufficient_resources": 503,
    "device_unobserved": 503,
    "engine_unreachable": 503,
    "engine_timeout": 504,
    "redis_unreachable": 503,
}


def _stem(code: str) -> str:
    return code.split(":", 1)[0]


def exit_code_for(code: str) -> int:
    """The CLI exit code of an error code; unknown codes are internal errors (13)."""
    return _EXIT_CODES.get(_stem(code), 13)


def http_status_for(code: str) -> int:
    """The HTTP status of an error code; unknown codes are internal errors (500)."""
    return _HTTP_STATUSES.get(_stem(code), 500)
