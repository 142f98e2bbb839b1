"""Every error code's CLI exit code and HTTP status, in one table: the one place codes map
to them. The errors that carry the codes are the tree in `capycommon.errors`.
"""

from __future__ import annotations

# Every code CapyCTL raises or records: (CLI exit code, HTTP status). A code carrying a
# suffix (`engine_env_reserved:<name>`) maps by its stem. docs/errors.md lists this table, and
# a test holds the two (and the codes raised in the source) together.
CODES: dict[str, tuple[int, int]] = {
    # 2: what was given is wrong (a setting, a document, a request, a path).
    "invalid_config": (2, 400),
    "credentials_unusable": (2, 500),
    "not_found": (2, 404),
    "engine_env_reserved": (2, 400),
    "tensor_parallel_invalid": (2, 400),
    "route_conflict": (2, 409),
    "host_name_changed": (2, 409),
    "invalid_request": (2, 400),
    "method_not_allowed": (2, 405),
    "unsupported_parameter": (2, 400),
    "cache_salt_unsupported": (2, 400),
    "wrong_api": (2, 400),
    "body_too_large": (2, 413),
    "unknown_model": (2, 404),
    # The engine refused an inference request as sent (its own 4xx, relayed with its status).
    "engine_rejected": (2, 400),
    # A model on the Hugging Face Hub: no such repository or revision, or offline without it.
    "hf_repo_not_found": (2, 404),
    "hf_revision_not_found": (2, 404),
    "hf_offline_missing": (2, 404),
    # 3: the caller is not who it must be.
    "unauthenticated": (3, 401),
    "certificate_invalid": (3, 401),
    "invitation_refused": (3, 403),
    "hf_gated": (3, 401),
    "hf_token_refused": (3, 403),
    # 4: no room, or no way to know there is room.
    "insufficient_resources": (4, 503),
    "device_unobserved": (4, 503),
    "service_port_in_use": (4, 409),
    "queue_full": (4, 429),
    "host_drained": (4, 503),
    "disk_full": (4, 507),
    # 5: a capability this host, engine or release does not have.
    "capability_missing": (5, 409),
    "host_capability_missing": (5, 409),
    "lmcache_unavailable": (5, 409),
    "not_a_decision_model": (5, 409),
    "host_backed_unavailable": (5, 400),
    "multi_gpu_unsupported": (5, 400),
    "not_enough_gpus": (5, 409),
    "host_version_incompatible": (5, 409),
    "state_dir_newer": (5, 409),
    # This release downloads no models: the document must name a local folder instead.
    "model_source_pending": (5, 409),
    # 10: something did not happen in time.
    "activation_timeout": (10, 504),
    "engine_timeout": (10, 504),
    "unavailable": (10, 503),
    "request_timeout": (10, 408),
    # 13: a failure inside CapyCTL or an engine.
    "internal": (13, 500),
    "launch_failed": (13, 500),
    "activation_failed": (13, 500),
    "engine_error": (13, 500),
    "port_conflict": (13, 500),
    "wake_mismatch": (13, 500),
    # What a peer served is not what it listed (a model's hash, size or commit).
    "hf_integrity": (13, 502),
    # 16-19: engines being registered.
    "engine_not_found": (16, 400),
    "engine_unsupported": (17, 400),
    "engine_version_failed": (18, 500),
    "profile_exists": (19, 409),
    # 22: a peer could not be reached.
    "agent_unreachable": (22, 503),
    "engine_unreachable": (22, 503),
    "redis_unreachable": (22, 503),
    "not_replicated": (22, 503),
    "host_unreachable": (22, 503),
    "hf_unreachable": (22, 503),
    # 14: a host the server revoked; its units do not restart it.
    "host_revoked": (14, 403),
    "profile_not_published": (24, 409),
    "toolchain_missing": (26, 500),
    "role_not_running": (27, 503),
    "state_dir_in_use": (28, 409),
    "state_corrupt": (30, 500),
    # 29: the request conflicts with what the deployment is doing or with an earlier request.
    "lifecycle_conflict": (29, 409),
    "revision_conflict": (29, 409),
    "model_in_use": (29, 409),
    "idempotency_conflict": (29, 409),
    "identity_conflict": (29, 409),
    "host_not_revoked": (29, 409),
    "deployment_stopped": (29, 409),
    "deployment_inactive": (29, 409),
    "stale_dispatch": (29, 409),
}


def _stem(code: str) -> str:
    return code.split(":", 1)[0]


def exit_code_for(code: str) -> int:
    """The CLI exit code of an error code; unknown codes are internal errors (13)."""
    return CODES.get(_stem(code), (13, 500))[0]


def http_status_for(code: str) -> int:
    """The HTTP status of an error code; unknown codes are internal errors (500)."""
    return CODES.get(_stem(code), (13, 500))[1]


def http_code_for(status: int) -> str:
    """The code of an HTTP error the web framework raised itself (no route, wrong method)."""
    known = {404: "not_found", 405: "method_not_allowed"}
    return known.get(status, "invalid_request")
