"""Redis as a live host leaves it, for the scheduler's tests over a real redis-server: the
host's engines, its heartbeat and the models it described; and deployments as the management
API records them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from capycommon.deployments import parse_deployment, revision_digest
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.models import HostModels, ModelFacts
from capycommon.engines.families import Family
from capycommon.engines.registry import PublishedEngines
from capycommon.state import keys
from capycommon.state.stores import State
from support import engine_profile
from unit.readings import GiB

ROOT = "/srv/models"
SMALL = ModelFacts(path=f"{ROOT}/small", kind="folder", weights_bytes=2 * GiB)


async def publish_live_host(state: State, host: str) -> None:
    """`host` alive, as hostd publishes it: one engine (vLLM) and the model `small` under
    ROOT."""
    engines = PublishedEngines(
        revision=1, source="engines.yaml", profiles=[engine_profile(Family.VLLM)]
    )
    await state.client.set(keys.engines(host), engines.model_dump_json())
    await state.client.set(keys.heartbeat("hostd", host), "{}")
    await state.host_models.publish(host, HostModels(models_root=ROOT, models={"small": SMALL}))


@asynccontextmanager
async def live_host(redis_socket: Path, host: str) -> AsyncIterator[State]:
    """The state over a client of the redis-server at `redis_socket`, once `host` is
    published alive."""
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    try:
        await publish_live_host(state, host)
        yield state
    finally:
        await state.client.aclose()


def deployment_record(written: dict[str, Any], **record: Any) -> DeploymentRecord:
    """The deployment document `written`, at revision 1 as the management API records it;
    `record` sets the record's other fields."""
    document = parse_deployment(written, "test")
    return DeploymentRecord(
        name=document.name,
        revision=1,
        digest=revision_digest(document),
        document=document,
        created_at=0.0,
        updated_at=0.0,
        **record,
    )
