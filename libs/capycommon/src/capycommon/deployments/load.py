"""Reading deployment documents, telling their revisions apart, and keeping routes unique."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from capycommon.domain.deployment import Deployment
from capycommon.errors import (
    EngineEnvReserved,
    InvalidConfig,
    MultiGpuUnsupported,
    RouteConflict,
    TensorParallelInvalid,
)
from capycommon.yamldoc import load_yaml_document

# Keys people put in the wrong place (or know from the reference's fuller schema), and where
# they belong; an unknown key is refused with this pointer instead of a bare "unknown".
_MOVED = {
    "env": "engine_config.env",
    "context_length": "engine_config.context_length",
    "max_concurrent_requests": "engine_config.max_concurrent_requests",
    "memory": "engine_config.memory",
    "extra_args": "engine_config.extra_args",
    "tool_call_parser": "engine_config.tool_call_parser",
    "reasoning_parser": "engine_config.reasoning_parser",
    "ready_idle_timeout": "lifecycle.ready_idle_timeout",
    "parked_idle_timeout": "lifecycle.parked_idle_timeout",
    "warm": "lifecycle.warm",
    "activation": "lifecycle.activation",
    "device": "devices",
    "runtime_profile": "engine",
    "engine_config.vllm": "engine_config (tool_call_parser, reasoning_parser, extra_args)",
    "engine_config.sglang": "engine_config (tool_call_parser, reasoning_parser, extra_args)",
    "engine_config.llamacpp": "engine_config (context_length, extra_args)",
}
_NOT_YET = frozenset(
    {"host", "instances", "placement", "topology", "resources", "timeouts", "recovery", "recipe"}
)
_CLASSES: dict[str, type[InvalidConfig] | type[MultiGpuUnsupported]] = {
    "engine_env_reserved": EngineEnvReserved,
    "multi_gpu_unsupported": MultiGpuUnsupported,
    "tensor_parallel_invalid": TensorParallelInvalid,
}


def load_deployment(path: Path) -> Deployment:
    """Read and check one deployment document; every problem is named in one error."""
    return parse_deployment(load_yaml_document(path), str(path))


def parse_deployment(data: object, source: str) -> Deployment:
    """Check a parsed document; `source` (a file, or `request body`) starts every message.

    The error's code is its first problem's: `invalid_config` for most, else the specific
    one (`engine_env_reserved:<NAME>`, `multi_gpu_unsupported`).
    """
    if not isinstance(data, dict):
        shape = "empty" if data is None else f"a {type(data).__name__}"
        raise InvalidConfig(
            f"{source}: a deployment is a mapping of at least name, engine and model, not "
            f"{shape}; write e.g. name: qwen3-4b, engine: vllm, model: Qwen3-4B"
        )
    try:
        return Deployment.model_validate(data)
    except ValidationError as exc:
        problems = [_problem(error) for error in exc.errors()]
        code = problems[0][0]
        message = f"{source}: " + "; ".join(text for _, text in problems)
        raise _CLASSES.get(code.split(":", 1)[0], InvalidConfig)(message, code=code) from None


def _problem(error: ErrorDetails) -> tuple[str, str]:
    """The error code and the sentence for one validation problem."""
    path = _dotted(error["loc"])
    code = str((error.get("ctx") or {}).get("code", "invalid_config"))
    reason = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        if path in _MOVED:
            return code, f"unknown key {path!r}; it belongs at {_MOVED[path]}"
        if path in _NOT_YET:
            return code, f"unknown key {path!r}; this release does not support it yet, remove it"
        return code, f"unknown key {path!r}; remove it or correct its spelling"
    if error["type"] == "missing":
        return code, f"{path} is required; add it"
    if error["type"] == "value_error" or code != "invalid_config":
        return code, f"{path}: {reason}"
    return code, f"{path} = {error['input']!r}: {reason}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    """('devices', 0, 'id') -> devices[0].id; a dict key's marker is dropped."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part != "[key]":
            text += f".{part}" if text else part
    return text or "the document"


def revision_digest(deployment: Deployment) -> str:
    """`sha256:<hex>` over the document's canonical JSON: equal digests, same revision.

    Defaults are filled in and sizes and durations written in their exact unit, so layout,
    key order, `14336MiB` for `14GiB`, or stating a default change nothing.
    """
    document = deployment.model_dump(mode="json")
    if not deployment.placement.hosts:
        del document["placement"]  # added after 0.1: the digests of earlier documents stand
    for later in ("lmcache", "lmcache_pool"):  # the same, added in 0.1.7
        if document[later] is None:
            del document[later]
    if document["api"] == "chat":  # the same, added in 0.1.7
        del document["api"]
    if document["resources"] is None:  # the same, added with TensorFold and custom engines
        del document["resources"]
    if document["engine_config"]["tensor_parallel"] is None:  # the same, added with multi-GPU
        del document["engine_config"]["tensor_parallel"]
    canonical = json.dumps(
        document,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def check_routes(deployments: Iterable[Deployment]) -> None:
    """Refuse two deployments that serve the same route (`route_conflict`).

    Pass the deployments as they would be after a change: a new revision replaces the
    deployment of its name, it is not a second one.
    """
    owners: dict[str, str] = {}
    names: set[str] = set()
    conflicts = []
    for deployment in deployments:
        if deployment.name in names:
            raise InvalidConfig(
                f"two deployments are named {deployment.name!r}; rename one (a changed "
                "document replaces the deployment of its name)"
            )
        names.add(deployment.name)
        for route in deployment.routes:
            owner = owners.setdefault(route, deployment.name)
            if owner != deployment.name:
                conflicts.append(
                    f"route {route!r} of deployment {deployment.name!r} is already served by "
                    f"deployment {owner!r}"
                )
    if conflicts:
        raise RouteConflict(
            "; ".join(conflicts) + "; give each route to one deployment (routes: [...])"
        )
