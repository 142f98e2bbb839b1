"""A Hub download on a standalone role survives a restart of hostd: the new hostd resumes the
partial file with `Range`, the store hashes as the Hub lists it, and the request that waited
for the model is answered. Two deployments of one repository at one commit, starting at once,
share one download. The Hub is the mock hub on loopback, paced so a download takes seconds."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from cluster import SMALL, Cluster, on_hub
from mockhub import HubFile, HubRepo, MockHub, Recorded
from support import pid_alive, wait_for

HELLO: Any = [{"role": "user", "content": "hi"}]
WEIGHTS = "model.safetensors"
MiB = 1 << 20
# File bodies at 1 MiB/s: 4 MiB of weights take 4 s, time to restart hostd half way.
PACE = MiB
REPOS = {"SIGTERM": "acme/term", "SIGKILL": "acme/kill", "shared": "acme/shared"}


def _repo(repo_id: str, size: int) -> HubRepo:
    """One commit: a config (a regular file) and `size` bytes of weights (LFS)."""
    commit = hashlib.sha1(repo_id.encode(), usedforsecurity=False).hexdigest()
    config = {"model_type": "tiny", "hidden_size": 64, "vocab_size": 4}
    files = [
        HubFile("config.json", json.dumps(config).encode(), lfs=False),
        HubFile(WEIGHTS, random.Random(repo_id).randbytes(size), lfs=True),
    ]
    return HubRepo(repo_id, {commit: files}, {"main": commit})


@pytest.fixture(scope="module")
def hub() -> Iterator[MockHub]:
    with MockHub.start([_repo(repo_id, 4 * MiB) for repo_id in REPOS.values()]) as served:
        yield served


@pytest.fixture(scope="module")
def role(hub: MockHub) -> Iterator[Cluster]:
    # Two GPUs: two deployments start on one each, at once (starts are one at a time per GPU).
    yield from on_hub("hub-resume", hub, "gpu0:24GiB,gpu1:24GiB")


@pytest.fixture
def cluster(role: Cluster, hub: MockHub) -> Iterator[Cluster]:
    """The role, its deployments deleted after the test; the hub paced, its log emptied."""
    hub.requests.clear()
    hub.faults.bytes_per_second = PACE
    try:
        yield role
    finally:
        hub.faults.bytes_per_second = None
        role.clean()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda sig: sig.name)
def test_a_download_cut_by_a_restart_of_hostd_resumes_from_its_partial_file(
    hub: MockHub, cluster: Cluster, sig: signal.Signals
) -> None:
    repo = hub.repos[REPOS[sig.name]]
    commit = repo.refs["main"]
    weights = next(file for file in repo.commits[commit] if file.path == WEIGHTS)
    cluster.deploy("resumed", model={"hf": f"{repo.repo_id}@{commit}"}, engine_config=SMALL)
    name = f"{repo.repo_id.replace('/', '--')}@{commit}"
    partial = cluster.root / "models/sources/.capyctl/partial" / name / f"{WEIGHTS}.partial"
    store = cluster.root / "models/sources/huggingface" / name

    hostd = cluster.role.processes()["hostd"]["pid"]
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(_ask, cluster, "resumed")
        wait_for(lambda: _size(partial) >= MiB, timeout=30, what="a MiB of the weights")
        os.kill(hostd, sig)
        wait_for(lambda: not pid_alive(hostd), timeout=15, what="hostd to exit", interval=0.01)
        kept = _size(partial)  # before the next hostd appends
        assert MiB <= kept < weights.size, "hostd was stopped half way"
        wait_for(cluster.role.healthy, timeout=30, what="supervisord to start hostd again")
        # The request waits through the restart, as for any start, and is answered.
        answer = _answered(asked, hub, partial)
    assert answer.choices[0].message.content

    starts = [_range_start(get) for get in _gets(hub, repo.repo_id, commit, WEIGHTS)]
    assert starts == [0, kept], (
        f"one GET from the start, then one from the {kept} bytes on disk: {starts}"
    )
    assert hashlib.sha256((store / WEIGHTS).read_bytes()).hexdigest() == weights.sha256
    assert not partial.parent.exists(), "the partial files are gone once the store is complete"
    # The new hostd resumed the launch it was sent: no failed start, no second launch.
    status = cluster.status("resumed")
    assert (status["state"], status["instances"][0]["generation"]) == ("ready", 1)


def test_two_deployments_of_one_commit_starting_at_once_share_one_download(
    hub: MockHub, cluster: Cluster
) -> None:
    repo = hub.repos[REPOS["shared"]]
    commit = repo.refs["main"]
    for name in ("one", "two"):
        cluster.deploy(name, model={"hf": f"{repo.repo_id}@{commit}"}, engine_config=SMALL)
    store = cluster.root / "models/sources/huggingface" / f"acme--shared@{commit}"

    with ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(_ask, cluster, name) for name in ("one", "two", "one", "two")]
        wait_for(
            lambda: cluster.state("one") == "starting" == cluster.state("two"),
            timeout=30,
            what="both deployments to start",
        )
        assert not store.exists(), "both started before the download ended"
        answers = [request.result(timeout=90) for request in asked]
    assert all(answer.choices[0].message.content for answer in answers)
    gpus = {cluster.status(name)["instances"][0]["gpu"] for name in ("one", "two")}
    assert gpus == {"gpu0", "gpu1"}, "the two started side by side"
    for file in repo.commits[commit]:
        assert len(_gets(hub, repo.repo_id, commit, file.path)) == 1, f"one GET of {file.path}"
    weights = next(file for file in repo.commits[commit] if file.path == WEIGHTS)
    assert hashlib.sha256((store / WEIGHTS).read_bytes()).hexdigest() == weights.sha256


def _ask(cluster: Cluster, model: str) -> ChatCompletion:
    return cluster.openai(timeout=120).chat.completions.create(model=model, messages=HELLO)


def _answered(asked: Future[ChatCompletion], hub: MockHub, partial: Path) -> ChatCompletion:
    """The answer, or a failure that says how far the download got and what reached the hub."""
    try:
        return asked.result(timeout=90)
    except TimeoutError:
        seen = [(r.method, r.path, r.headers.get("range")) for r in hub.requests]
        raise AssertionError(
            f"no answer in 90 s; {_size(partial)} bytes in {partial}; the hub saw {seen}"
        ) from None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _gets(hub: MockHub, repo: str, commit: str, path: str) -> list[Recorded]:
    """The GETs of one file's bytes that reached the hub, in order."""
    wanted = f"/{repo}/resolve/{commit}/{path}"
    return [r for r in hub.requests if r.method == "GET" and r.path == wanted]


def _range_start(request: Recorded) -> int:
    """Where a GET asked the body to start: `Range: bytes=N-`, or 0 without one."""
    asked = request.headers.get("range")
    if asked is None:
        return 0
    found = re.fullmatch(r"bytes=(\d+)-", asked)
    assert found is not None, asked
    return int(found[1])
