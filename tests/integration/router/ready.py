"""A deployment with a ready instance, written to Redis as the scheduler and hostd write them,
for tests that put the router in front of an engine of their own."""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis

from capycommon.deployments.load import parse_deployment
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import CacheRecord, InstanceRecord, InstanceState
from capycommon.state import keys
from capycommon.state.stores import State


async def put_deployment(
    client: aioredis.Redis, name: str, family: str = "vllm", api: str = "chat"
) -> DeploymentRecord:
    """Deployment `name` of `family` (serving `api`) at revision and generation 1, with no
    instance."""
    now = time.time()
    written = {"name": name, "engine": family, "model": "m", "api": api}
    record = DeploymentRecord(
        name=name,
        revision=1,
        digest="d",
        document=parse_deployment(written, "test"),
        created_at=now,
        updated_at=now,
        generation=1,
    )
    await State(client).deployments.put(record)
    return record


async def put_ready(
    client: aioredis.Redis,
    name: str,
    family: str = "vllm",
    host: str = "local",
    port: int = 8100,
    secret: str = "engine-key",
    cache: CacheRecord | None = None,
    api: str = "chat",
    version: str | None = None,
) -> None:
    """Deployment `name` of `family` (serving `api`), its instance ready at generation 1 on
    `host`, serving as `served` on `port` behind `secret`."""
    now = time.time()
    document = (await put_deployment(client, name, family, api)).document
    instance = InstanceRecord(
        deployment=name,
        instance=0,
        revision=1,
        generation=1,
        state=InstanceState.READY,
        since=now,
        host=host,
        family=family,
        version=version,
        served_name="served",
        port=port,
        cache=cache,
        api=document.api,
    )
    await client.set(keys.instance(host, name, 0), instance.model_dump_json())
    await client.sadd(keys.instances(host), f"{name}:0")
    await client.set(keys.instance_secret(host, name, 0), secret)


def chunk(content: str, finish: str | None = None) -> str:
    """One SSE event of a chat completion stream, as an engine serving as `served` sends it."""
    event = {
        "id": "chatcmpl-engine",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "served",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    return f"data: {json.dumps(event)}\n\n"
