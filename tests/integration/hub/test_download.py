"""Downloads from a mock Hugging Face Hub on loopback: resolving, the file set, resume within
a run and across runs, integrity failures, the token's reach, the Hub's error answers, the disk
check, the offline path and one download for concurrent pulls."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capycommon.hub import HubLimits, HubSource, StorePaths, pull, read_manifest
from capycommon.hub.errors import (
    DiskFull,
    HfGated,
    HfIntegrity,
    HfOfflineMissing,
    HfRepoNotFound,
    HfRevisionNotFound,
    HfTokenRefused,
    HfUnreachable,
)
from capycommon.hub.store import remove_tree
from mockhub import Faults, HubFile, HubRepo, MockHub, Recorded, gated_repo, tiny_repo
from support import wait_for_async

FAST = HubLimits(attempts=5, backoff_s=0.01, connect_timeout_s=2.0, read_timeout_s=10.0)
TINY = tiny_repo()
MAIN, V1 = TINY.refs["main"], TINY.refs["v1"]
WEIGHTS = "model.safetensors"
# The tiny repo's weights alone, at its main commit.
TINY_WEIGHTS = HubSource("acme/tiny", MAIN, (WEIGHTS,))
MiB = 1 << 20


@pytest.fixture
def hub() -> Iterator[MockHub]:
    with MockHub.start([tiny_repo(), gated_repo("hf_good")]) as hub:
        yield hub


@pytest.fixture
def models(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "models"
    root.mkdir()
    try:
        yield root
    finally:
        remove_tree(root)


def files_of(commit: str) -> dict[str, HubFile]:
    return {file.path: file for file in TINY.commits[commit]}


def assert_stored(store: Path, commit: str, paths: list[str] | None = None) -> None:
    """The store holds exactly the expected files, byte for byte, read-only, with a manifest."""
    expected = files_of(commit)
    wanted = sorted(paths if paths is not None else expected)
    manifest = read_manifest(store)
    assert (manifest["repo"], manifest["commit"]) == ("acme/tiny", commit)
    assert manifest["files"] == [
        {"path": p, "size": expected[p].size, "sha256": expected[p].sha256} for p in wanted
    ]
    found = sorted(
        str(path.relative_to(store))
        for path in store.rglob("*")
        if path.is_file() and path.name != ".capyctl-manifest.json"
    )
    assert found == wanted
    for path in wanted:
        assert (store / path).read_bytes() == expected[path].content
        assert stat.S_IMODE((store / path).stat().st_mode) == 0o444
    assert stat.S_IMODE(store.stat().st_mode) == 0o555


def gets(hub: MockHub, path: str) -> list[Recorded]:
    """The GETs of one file's bytes (through resolve or a redirect's blob URL)."""
    file = files_of(MAIN).get(path) or files_of(V1)[path]
    return [
        r
        for r in hub.requests
        if r.method == "GET" and (r.path.endswith(f"/{path}") or r.path.endswith(file.sha256))
    ]


def partial(models: Path, commit: str, path: str, files: tuple[str, ...] = (WEIGHTS,)) -> Path:
    """Where the download of `path` for `acme/tiny` narrowed to `files` keeps its bytes."""
    return StorePaths.of(models, HubSource("acme/tiny", commit, files), commit).partial(path)


@pytest.mark.anyio
async def test_a_branch_resolves_to_its_commit_and_every_file_lands_verified(
    hub: MockHub, models: Path
) -> None:
    told: list[tuple[int, int]] = []
    store = await pull(
        HubSource("acme/tiny", "main"),
        models,
        endpoint=hub.url,
        token=None,
        progress=lambda done, total: told.append((done, total)),
        limits=FAST,
    )
    assert store == models / "sources" / "huggingface" / f"acme--tiny@{MAIN}"
    assert_stored(store, MAIN)
    total = sum(file.size for file in TINY.commits[MAIN])
    assert told[-1] == (total, total)
    assert all(done <= total for done, _ in told)
    assert not (models / "sources" / ".capyctl" / "partial" / store.name).exists()
    assert stat.S_IMODE((models / "sources" / ".capyctl").stat().st_mode) == 0o700
    assert [r.path for r in hub.requests if "/revision/" in r.path] == [
        "/api/models/acme/tiny/revision/main"
    ]


@pytest.mark.anyio
async def test_a_pinned_commit_makes_no_model_info_call(hub: MockHub, models: Path) -> None:
    store = await pull(HubSource("acme/tiny", V1), models, endpoint=hub.url, token=None)
    assert_stored(store, V1)
    assert not [r for r in hub.requests if "/revision/" in r.path]
    assert hub.requests[0].path == f"/api/models/acme/tiny/tree/{V1}"
    assert hub.requests[0].query == {"recursive": "true", "expand": "false"}


@pytest.mark.anyio
async def test_the_tree_listing_is_followed_across_pages(hub: MockHub, models: Path) -> None:
    hub.faults = Faults(tree_page_size=2)
    store = await pull(HubSource("acme/tiny", MAIN), models, endpoint=hub.url, token=None)
    assert_stored(store, MAIN)
    assert len([r for r in hub.requests if "/tree/" in r.path]) > 2


@pytest.mark.anyio
async def test_patterns_select_the_file_set(hub: MockHub, models: Path) -> None:
    source = HubSource("acme/tiny", MAIN, ("*.json", "nested/"))
    store = await pull(source, models, endpoint=hub.url, token=None)
    chosen = ["config.json", "nested/tokenizer/vocab.txt"]
    assert_stored(store, MAIN, chosen)
    fetched = sorted(r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path)
    assert fetched == [f"/acme/tiny/resolve/{MAIN}/{path}" for path in chosen]


@pytest.mark.anyio
async def test_a_cut_body_is_resumed_with_a_range_and_hashes_the_same(
    hub: MockHub, models: Path
) -> None:
    hub.faults = Faults(cut_after=MiB, cut_times=1)
    store = await pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=FAST)
    assert_stored(store, MAIN, [WEIGHTS])
    ranges = [r.headers.get("range") for r in gets(hub, WEIGHTS)]
    assert ranges == [None, f"bytes={MiB}-"]


@pytest.mark.anyio
async def test_a_new_pull_after_the_tries_ran_out_resumes_from_the_partial_file(
    hub: MockHub, models: Path
) -> None:
    hub.faults = Faults(cut_after=256 * 1024, cut_times=100)
    three = HubLimits(attempts=3, backoff_s=0.01)
    with pytest.raises(HfUnreachable, match="786432 of 3145728 bytes are kept"):
        await pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=three)
    kept = partial(models, MAIN, WEIGHTS)
    assert kept.stat().st_size == 3 * 256 * 1024
    assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
    assert not (models / "sources" / "huggingface" / f"acme--tiny@{MAIN}").exists()

    hub.faults = Faults()
    hub.requests.clear()
    store = await pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=three)
    assert_stored(store, MAIN, [WEIGHTS])
    assert [r.headers.get("range") for r in gets(hub, WEIGHTS)] == [f"bytes={3 * 256 * 1024}-"]
    assert not kept.exists()


@pytest.mark.anyio
@pytest.mark.parametrize("cuts", [1, 2])
async def test_a_200_to_a_range_request_restarts_the_file_from_zero(
    hub: MockHub, models: Path, cuts: int
) -> None:
    # With two cuts, the restarted body is cut too: the next try resumes the restart.
    hub.faults = Faults(cut_after=MiB, cut_times=cuts, ignore_range=True)
    store = await pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=FAST)
    assert_stored(store, MAIN, [WEIGHTS])
    ranges = [r.headers.get("range") for r in gets(hub, WEIGHTS)]
    assert ranges == [None] + [f"bytes={MiB}-"] * cuts


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("faults", "message"),
    [
        (Faults(wrong_bytes=True), r"cdn\.bin has sha256"),
        (Faults(wrong_etag=True), r"ETag of cdn\.bin is"),
        (Faults(drop_commit=True), "no X-Repo-Commit header"),
    ],
)
async def test_served_bytes_or_headers_unlike_the_listing_fail_and_store_nothing(
    hub: MockHub, models: Path, faults: Faults, message: str
) -> None:
    hub.faults = faults
    with pytest.raises(HfIntegrity, match=message) as caught:
        await pull(HubSource("acme/tiny", MAIN), models, endpoint=hub.url, token=None)
    assert caught.value.code == "hf_integrity"
    assert "nothing entered the store" in caught.value.message
    assert list((models / "sources" / "huggingface").iterdir()) == []
    assert not partial(models, MAIN, "cdn.bin", ()).exists()  # the first file, by path


@pytest.mark.anyio
async def test_a_wrong_last_byte_of_a_resumed_lfs_file_is_caught(
    hub: MockHub, models: Path
) -> None:
    hub.faults = Faults(cut_after=MiB, cut_times=1, wrong_bytes=True)
    with pytest.raises(HfIntegrity, match=r"model\.safetensors has sha256"):
        await pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None)
    assert not partial(models, MAIN, WEIGHTS).exists()


@pytest.mark.anyio
async def test_the_token_reaches_the_hub_host_and_never_the_other_one(models: Path) -> None:
    private = tiny_repo()
    private.token = "hf_good"
    with MockHub.start([private]) as hub:
        store = await pull(
            HubSource("acme/tiny", "main"), models, endpoint=hub.url, token="hf_good"
        )
        assert_stored(store, MAIN)
        requests = list(hub.requests)
    port = hub.url.rsplit(":", 1)[1]
    elsewhere = [r for r in requests if r.host == f"localhost:{port}"]
    assert [r.method for r in elsewhere] == ["GET"]
    assert elsewhere[0].authorization is None
    assert elsewhere[0].path.endswith(files_of(MAIN)["cdn.bin"].sha256)
    at_home = [r for r in requests if r.host == f"127.0.0.1:{port}"]
    assert {r.authorization for r in at_home} == {"Bearer hf_good"}
    redirected = files_of(MAIN)["redirected.bin"].sha256
    assert [r.method for r in at_home if r.path == f"/blobs/{redirected}"] == ["GET"]


@pytest.mark.anyio
async def test_a_gated_repository_needs_a_token_and_a_wrong_one_is_refused(
    hub: MockHub, models: Path
) -> None:
    source = HubSource("acme/gated", "main")
    with pytest.raises(HfGated, match="CAPYCTL_HF_TOKEN") as gated:
        await pull(source, models, endpoint=hub.url, token=None)
    assert (gated.value.code, gated.value.exit_code) == ("hf_gated", 3)
    with pytest.raises(HfTokenRefused) as refused:
        await pull(source, models, endpoint=hub.url, token="hf_wrong_secret")
    assert "hf_wrong_secret" not in str(refused.value)
    store = await pull(source, models, endpoint=hub.url, token="hf_good")
    assert (store / "config.json").read_bytes() == b'{"model_type": "gated"}\n'


@pytest.mark.anyio
async def test_an_unknown_repository_or_revision_is_named(hub: MockHub, models: Path) -> None:
    with pytest.raises(HfRepoNotFound, match="no repository acme/nothing"):
        await pull(HubSource("acme/nothing", "main"), models, endpoint=hub.url, token=None)
    with pytest.raises(HfRevisionNotFound, match=r"acme/tiny .* has no revision v9"):
        await pull(HubSource("acme/tiny", "v9"), models, endpoint=hub.url, token=None)
    with pytest.raises(HfRevisionNotFound, match="has no revision"):
        await pull(HubSource("acme/tiny", "f" * 40), models, endpoint=hub.url, token=None)


@pytest.mark.anyio
async def test_a_refused_connection_fails_fast_naming_the_endpoint(models: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        started = time.monotonic()
        with pytest.raises(HfUnreachable) as caught:
            await pull(HubSource("acme/tiny"), models, endpoint=endpoint, token="hf_x", limits=FAST)
    assert time.monotonic() - started < 5
    assert endpoint in caught.value.message
    assert "CAPYCTL_HF_ENDPOINT" in caught.value.message
    assert "hf_x" not in caught.value.message


@pytest.mark.anyio
async def test_a_download_that_does_not_fit_is_refused_before_any_byte(
    hub: MockHub, models: Path
) -> None:
    free = os.statvfs(models).f_bavail * os.statvfs(models).f_frsize
    cramped = HubLimits(reserve_bytes=free)  # nothing fits with that much kept free
    with pytest.raises(DiskFull, match=r"needs 3\.0 MiB more .* has [\d.]+ [KMGT]iB free"):
        await pull(
            TINY_WEIGHTS,
            models,
            endpoint=hub.url,
            token=None,
            limits=cramped,
        )
    assert not [r for r in hub.requests if "/resolve/" in r.path]


@pytest.mark.anyio
async def test_a_complete_store_is_used_offline_with_no_hub(models: Path) -> None:
    with MockHub.start([tiny_repo()]) as hub:
        first = await pull(HubSource("acme/tiny", V1), models, endpoint=hub.url, token=None)
    again = await pull(
        HubSource("acme/tiny", V1), models, endpoint=hub.url, token=None, offline=True
    )
    assert again == first
    assert_stored(again, V1)
    with pytest.raises(HfOfflineMissing, match="works offline"):
        await pull(HubSource("acme/tiny", MAIN), models, endpoint=hub.url, token=None, offline=True)


@pytest.mark.anyio
async def test_concurrent_pulls_of_one_store_make_one_download(hub: MockHub, models: Path) -> None:
    source = HubSource("acme/tiny", "main")
    stores = await asyncio.gather(
        *(pull(source, models, endpoint=hub.url, token=None) for _ in range(3))
    )
    assert len(set(stores)) == 1
    assert_stored(stores[0], MAIN)
    assert len(gets(hub, WEIGHTS)) == 1
    assert len([r for r in hub.requests if "/tree/" in r.path]) == 1
    assert (
        hashlib.sha256((stores[0] / WEIGHTS).read_bytes()).hexdigest()
        == files_of(MAIN)[WEIGHTS].sha256
    )


@pytest.mark.anyio
async def test_a_pull_whose_downloader_is_cancelled_is_taken_over_and_resumes(
    hub: MockHub, models: Path
) -> None:
    hub.faults = Faults(cut_after=MiB, cut_times=1)
    slow = HubLimits(attempts=5, backoff_s=5.0)  # the first try's cut waits out its backoff
    first = asyncio.create_task(
        pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=slow)
    )

    async def cut() -> bool:
        kept = partial(models, MAIN, WEIGHTS)
        return kept.exists() and kept.stat().st_size == MiB

    await wait_for_async(cut, 10, "the first download to be cut")
    second = asyncio.create_task(
        pull(TINY_WEIGHTS, models, endpoint=hub.url, token=None, limits=FAST)
    )
    # One turn of the loop: a pinned commit reaches the running download with no request.
    await asyncio.sleep(0)
    first.cancel()
    store = await second
    assert first.cancelled()
    assert_stored(store, MAIN, [WEIGHTS])
    assert [r.headers.get("range") for r in gets(hub, WEIGHTS)] == [None, f"bytes={MiB}-"]


@pytest.mark.anyio
async def test_another_process_holding_the_store_lock_is_waited_for(
    hub: MockHub, models: Path
) -> None:
    source = HubSource("acme/tiny", V1, ("config.json",))
    lock = StorePaths.of(models, source, V1).lock
    lock.parent.mkdir(parents=True)
    script = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline() == "held\n"
            waiting = asyncio.create_task(pull(source, models, endpoint=hub.url, token=None))
            with pytest.raises(TimeoutError):  # it waits while the other process holds the lock
                await asyncio.wait_for(asyncio.shield(waiting), 1.0)
            assert hub.requests == []
            holder.stdin.close()
            assert holder.wait(timeout=10) == 0
            store = await asyncio.wait_for(waiting, 10)
        finally:
            holder.kill()
    assert_stored(store, V1, ["config.json"])


@pytest.mark.anyio
async def test_an_empty_file_and_a_name_to_quote_are_stored(models: Path) -> None:
    commit = "c" * 40
    files = [
        HubFile("empty/__init__.py", b"", lfs=False),
        HubFile("tokenizer config #1.json", b'{"a": 1}\n', lfs=False),
    ]
    with MockHub.start([HubRepo("acme/odd", {commit: files}, {"main": commit})]) as hub:
        store = await pull(HubSource("acme/odd", "main"), models, endpoint=hub.url, token=None)
        fetched = [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert (store / "empty" / "__init__.py").read_bytes() == b""
    assert (store / "tokenizer config #1.json").read_bytes() == b'{"a": 1}\n'
    assert fetched == [f"/acme/odd/resolve/{commit}/tokenizer%20config%20%231.json"]
    assert [f["path"] for f in read_manifest(store)["files"]] == [
        "empty/__init__.py",
        "tokenizer config #1.json",
    ]
