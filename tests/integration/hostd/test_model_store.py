"""hostd's model store against a real Redis and the mock hub: a pull and a launch of one
model share one download, both see its bytes, and one event tells how it ended; a removal
refuses a store a launch or a live instance uses, and anything that is not a download."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon.domain import commands as hc
from capycommon.errors import InvalidConfig
from capycommon.hub.store import remove_tree
from capycommon.state.stores import State
from capyctl_hostd.downloads import ModelStore, store_folder
from mockhub import Faults, MockHub, tiny_repo
from support import instance_record

HOST = "gpu-s"
REPO = tiny_repo()
V1 = REPO.refs["v1"]
WHOLE = hc.HubPull(repo="acme/tiny", commit=V1)
STORE = f"sources/huggingface/acme--tiny@{V1}"


@pytest.fixture
def hub() -> Iterator[MockHub]:
    with MockHub.start([REPO]) as served:
        yield served


@pytest.fixture
async def store(
    redis_socket: Path, tmp_path: Path, hub: MockHub, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ModelStore]:
    monkeypatch.setenv("CAPYCTL_HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    client = aioredis.Redis(unix_socket_path=str(redis_socket))
    root = tmp_path / "models"
    try:
        state = State(client)
        yield ModelStore(HOST, state, state.instances(HOST), root, tmp_path / "state")
    finally:
        await client.aclose()
        remove_tree(root)


@pytest.mark.anyio
async def test_a_pull_and_a_launch_share_one_download_and_its_figures(
    store: ModelStore, hub: MockHub
) -> None:
    hub.faults = Faults(bytes_per_second=2 << 20)  # 3 MiB of weights: about 1.5 s
    pulled = asyncio.create_task(store.pull(hc.Pull(operation="op-1", source=WHOLE)))
    seen: list[int] = []

    async def launch() -> Path:
        async with store.using(WHOLE):
            return await store.fetch("tiny", WHOLE)

    launched = asyncio.create_task(launch())
    while not launched.done():
        figures = await store.state.downloads.get(HOST, "tiny")
        if figures is not None:
            seen.append(figures.done_bytes)
        await asyncio.wait({launched}, timeout=0.1)  # a reading each 0.1 s until it ends
    folder = await launched
    await pulled
    assert folder == store.models_root / STORE
    weights = next(f for f in REPO.commits[V1] if f.path == "model.safetensors")
    assert [r.path for r in hub.requests if r.path.endswith("model.safetensors")] == [
        f"/acme/tiny/resolve/{V1}/model.safetensors"
    ] * 2, "one HEAD and one GET: the launch waited for the pull's download"
    assert seen, "the launch's record showed the bytes of the pull's download"
    assert seen == sorted(seen)
    assert await store.state.downloads.get(HOST, "tiny") is None, "cleared at the end"
    done = await store.state.downloads.operation(HOST, "op-1")
    assert done is not None
    assert (done.kind, done.state, done.name, done.code) == ("pull", "done", STORE, None)
    events = [e for e in await store.state.events.read(HOST) if e.kind == "download"]
    assert len(events) == 1, "one download, one event"
    assert (events[0].repo, events[0].outcome) == ("acme/tiny", "done")
    assert events[0].received_bytes == sum(f.size for f in REPO.commits[V1])
    assert (folder / "model.safetensors").read_bytes() == weights.content


@pytest.mark.anyio
async def test_a_pull_that_fails_says_so_with_its_code_and_one_event(
    store: ModelStore, hub: MockHub
) -> None:
    hub.faults = Faults(wrong_bytes=True)
    await store.pull(hc.Pull(operation="op-2", source=WHOLE))
    failed = await store.state.downloads.operation(HOST, "op-2")
    assert failed is not None
    assert (failed.state, failed.code) == ("failed", "hf_integrity")
    assert failed.message is not None
    assert "acme/tiny" in failed.message
    events = [e for e in await store.state.events.read(HOST) if e.kind == "download"]
    assert [e.outcome for e in events] == ["failed"]
    assert not (store.models_root / STORE).exists()


@pytest.mark.anyio
async def test_a_removal_waits_for_no_user_of_the_store(store: ModelStore) -> None:
    await store.pull(hc.Pull(operation="op-3", source=WHOLE))
    folder = store.models_root / STORE
    assert folder.is_dir()

    async with store.using(WHOLE):
        await store.remove(hc.Remove(operation="op-4", name=STORE))
    refused = await store.state.downloads.operation(HOST, "op-4")
    assert refused is not None
    assert (refused.state, refused.code) == ("failed", "model_in_use")

    running = instance_record("tiny", HOST, model_path=str(folder))
    await store.instances.transition(running, allowed=["absent"], generation=None, reason="test")
    await store.remove(hc.Remove(operation="op-5", name=STORE))
    refused = await store.state.downloads.operation(HOST, "op-5")
    assert refused is not None
    assert refused.code == "model_in_use"
    assert refused.message is not None
    assert "deployment 'tiny'" in refused.message
    assert folder.is_dir()

    await store.instances.forget("tiny", 0)
    await store.remove(hc.Remove(operation="op-6", name=STORE))
    removed = await store.state.downloads.operation(HOST, "op-6")
    assert removed is not None
    assert removed.state == "done"
    assert not folder.exists()
    await store.remove(hc.Remove(operation="op-7", name=STORE))
    gone = await store.state.downloads.operation(HOST, "op-7")
    assert gone is not None
    assert gone.code == "not_found"


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-8b",
        "sources/huggingface",
        "sources/huggingface/../../qwen3-8b",
        "sources/huggingface/acme--tiny@main",
        f"sources/huggingface/acme--tiny@{V1}/model.safetensors",
        f"/abs/sources/huggingface/acme--tiny@{V1}",
    ],
)
def test_only_a_download_in_the_store_can_be_removed(name: str) -> None:
    with pytest.raises(InvalidConfig, match="is not a download in the model store"):
        store_folder(name)


def test_a_download_is_named_as_list_models_shows_it() -> None:
    assert store_folder(STORE) == f"acme--tiny@{V1}"
    narrowed = f"{STORE}-0a1b2c3d"
    assert store_folder(narrowed) == f"acme--tiny@{V1}-0a1b2c3d"
