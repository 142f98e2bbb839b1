"""Deployment documents: what to serve, checked strictly, and bound to a host.

`load_deployment` / `parse_deployment` read a document (`schema.Deployment`);
`revision_digest` tells revisions apart; `check_routes` keeps routes unique across
deployments; `resolve` binds one to a host's engines, model facts and memory.
"""

from capycommon.deployments.load import (
    check_routes,
    load_deployment,
    parse_deployment,
    revision_digest,
)
from capycommon.deployments.resolve import HostFacts, ModelNotDescribed, Resolved, resolve
from capycommon.domain.deployment import (
    Deployment,
    Device,
    EngineConfig,
    Lifecycle,
    Memory,
    ModelSource,
    env_reserved,
)

__all__ = [
    "Deployment",
    "Device",
    "EngineConfig",
    "HostFacts",
    "Lifecycle",
    "Memory",
    "ModelNotDescribed",
    "ModelSource",
    "Resolved",
    "check_routes",
    "env_reserved",
    "load_deployment",
    "parse_deployment",
    "resolve",
    "revision_digest",
]
