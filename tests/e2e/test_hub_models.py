"""A model from the Hugging Face Hub, end to end on a standalone role: `model: {hf: ...}` is
pinned at deploy, the first request waits while hostd downloads it into the model store, and
the simulated engine serves it from there, offline. The Hub is the mock hub on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capycommon.hub import HubSource, pull
from cluster import SMALL, Cluster, on_hub, running
from integration.hostd.harness import environ
from mockhub import HubFile, MockHub, gated_repo, one_commit_repo, tiny_repo
from support import processes_mentioning, wait_for

HELLO = [{"role": "user", "content": "hi"}]
TOKEN = "hf_secret_0123456789"


PULLED = one_commit_repo(
    "acme/pulled",
    [
        HubFile("config.json", b'{"model_type": "pulled"}\n', lfs=False),
        HubFile("model.safetensors", bytes(range(256)) * 4096, lfs=True),
    ],
)
# Listings no git tree makes, which a hostile or broken mirror may serve: a file and a folder
# of the same name, and a name longer than a file system holds.
CONFIG = HubFile("config.json", b'{"model_type": "odd"}\n', lfs=False)
LONG_NAME = "w" * 300 + ".safetensors"
ODD = {
    "acme/clash": (
        "'weights' as a file and a folder",
        [
            CONFIG,
            HubFile("weights", b"a file", lfs=False),
            HubFile("weights/model.safetensors", b"a file in a folder", lfs=True),
        ],
    ),
    "acme/long": (
        f"{LONG_NAME!r} in acme/long whose name is longer than a file system holds",
        [CONFIG, HubFile(LONG_NAME, b"weights", lfs=True)],
    ),
}


@pytest.fixture(scope="module")
def hub() -> Iterator[MockHub]:
    odd = [one_commit_repo(repo, files) for repo, (_, files) in ODD.items()]
    with MockHub.start([tiny_repo(), gated_repo(TOKEN), PULLED, *odd]) as served:
        yield served


@pytest.fixture(scope="module")
def cluster(hub: MockHub) -> Iterator[Cluster]:
    yield from on_hub("hub", hub)


def test_a_hub_model_is_pinned_downloaded_and_served_offline(
    hub: MockHub, cluster: Cluster
) -> None:
    repo = hub.repos["acme/tiny"]
    main, v1 = repo.refs["main"], repo.refs["v1"]
    cluster.deploy(
        "tiny", model={"hf": "acme/tiny", "files": ["*.json", "*.safetensors"]}, **_small()
    )
    status = cluster.status("tiny")
    pinned = {k: v for k, v in status["document"]["model"].items() if v is not None}
    assert pinned == {
        "hf": f"acme/tiny@{main}",
        "revision": "main",
        "files": ["*.json", "*.safetensors"],
    }
    shown = cluster.ok("status", "deployment", "tiny")
    assert f"commit        {main} (main)" in shown or f"{main} (main)" in shown, shown

    # The first request starts the model: hostd downloads it, then the engine serves it.
    client = cluster.openai()
    answer = client.chat.completions.create(model="tiny", messages=HELLO)  # type: ignore[arg-type]
    assert answer.choices[0].message.content

    folder = HubSource("acme/tiny", main, ("*.json", "*.safetensors")).store_name(main)
    assert folder.startswith(f"acme--tiny@{main}-"), "a choice of files has a store of its own"
    store = cluster.root / "models" / "sources" / "huggingface" / folder
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == [
        "config.json",
        "model.safetensors",
    ]
    weights = store / "model.safetensors"
    assert weights.read_bytes() == next(
        f.content for f in repo.commits[main] if f.path == weights.name
    )
    assert not stat.S_IMODE(weights.stat().st_mode) & 0o222, "a finished store is read-only"
    # The engine got the store's path and the Hub offline.
    engines = processes_mentioning(str(store))
    assert engines, "the engine runs from the store"
    env = environ(engines[0])
    assert (env["HF_HUB_OFFLINE"], env["HF_HUB_DISABLE_TELEMETRY"]) == ("1", "1")

    # The store is listed with its repository, commit and user, beside the local folders
    # (once hostd looked at its models again: every 5 s).
    name = f"sources/huggingface/{folder}"

    def listed_models() -> dict[str, Any] | None:
        out = cluster.ok("list", "models", "--host", "local", "--json")
        found = {row["name"]: row for row in json.loads(out)}
        return found if name in found else None

    listed = wait_for(listed_models, timeout=15, what="the store in list models")
    row = listed[name]
    assert (row["repo"], row["commit"], row["used_by"]) == ("acme/tiny", main, ["tiny"])
    assert row["weights_bytes"] == weights.stat().st_size
    assert listed["small"]["repo"] is None
    shown = cluster.ok("list", "models")
    assert f"hf acme/tiny@{main}" in shown, shown
    assert "nowhere" in cluster.cli("list", "models", "--host", "nowhere").stderr

    # Deployed again, the same document keeps its pin; a tag pins that tag's commit.
    assert "(unchanged)" in cluster.ok("deploy", "model", "--file", str(cluster.root / "tiny.yaml"))
    cluster.deploy("older", model={"hf": "acme/tiny", "revision": "v1"}, **_small())
    assert cluster.status("older")["document"]["model"]["hf"] == f"acme/tiny@{v1}"


def test_a_repository_the_hub_does_not_have_is_refused_at_deploy(cluster: Cluster) -> None:
    path = cluster.root / "nosuch.yaml"
    path.write_text("name: nosuch\nengine: vllm\nmodel: {hf: acme/nosuch}\n")
    refused = cluster.cli("deploy", "model", "--file", str(path))
    assert refused.returncode != 0
    assert "hf_repo_not_found" in refused.stderr, refused.stderr
    assert "acme/nosuch" in refused.stderr


def test_a_download_that_fails_answers_the_waiting_request_with_its_code(
    hub: MockHub, cluster: Cluster
) -> None:
    v1 = hub.repos["acme/tiny"].refs["v1"]
    hub.faults.wrong_bytes = True
    try:
        cluster.deploy("broken", model={"hf": f"acme/tiny@{v1}"}, **_small())
        with pytest.raises(openai.APIStatusError) as failed:
            cluster.openai(timeout=60).chat.completions.create(
                model="broken",
                messages=HELLO,  # type: ignore[arg-type]
            )
    finally:
        hub.faults.wrong_bytes = False
    assert "hf_integrity" in str(failed.value.body), failed.value.body
    store = cluster.root / "models" / "sources" / "huggingface"
    assert not (store / f"acme--tiny@{v1}").exists(), "a download that failed leaves nothing"


def test_a_request_waits_while_the_model_downloads_and_status_shows_the_bytes(
    hub: MockHub, cluster: Cluster
) -> None:
    v1 = hub.repos["acme/tiny"].refs["v1"]
    # 2 MiB of the 3 MiB of weights in about 2 s, then the rest once the test has looked.
    hub.faults.bytes_per_second = 1 << 20
    hub.faults.hold_after = 2 << 20
    hub.faults.released.clear()
    try:
        cluster.deploy("paced", model={"hf": "acme/tiny", "revision": "v1"}, **_small())
        # Before any byte is downloaded, the Hub's listing gives the weights' size.
        weights = 3 << 20  # model.safetensors
        wait_for(
            lambda: cluster.status("paced")["bindings"][0]["weights_bytes"] == weights,
            timeout=20,
            what="the weights' size from the Hub's listing",
        )
        assert not (cluster.root / "models/sources/huggingface" / f"acme--tiny@{v1}").exists()
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(
                lambda: cluster.openai().chat.completions.create(
                    model="paced",
                    messages=HELLO,  # type: ignore[arg-type]
                )
            )
            # The first row may be written before a byte came (0 B at 0 B/s): wait for bytes.
            moving = r"download +[\d.]+ [KM]iB of 3\.0 MiB \(\d+%\) at [\d.]+ [KM]iB/s on local"
            rows: list[str | None] = []

            def downloading() -> str | None:
                rows.append(_download_row(cluster.ok("status", "deployment", "paced")))
                return rows[-1] if re.fullmatch(moving, rows[-1] or "") else None

            try:
                wait_for(downloading, timeout=60, what="bytes in status's download row")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the last rows: {rows[-3:]}") from None
            assert not asked.done(), "the request waits for the download"
            hub.faults.released.set()
            answer = asked.result(timeout=120)
    finally:
        hub.faults.bytes_per_second = hub.faults.hold_after = None
        hub.faults.released.set()
    assert answer.choices[0].message.content
    assert cluster.status("paced")["download"] is None
    assert (cluster.root / "models/sources/huggingface" / f"acme--tiny@{v1}").is_dir()


def test_a_gated_model_needs_the_owners_token_file_which_never_leaves_the_hub(
    hub: MockHub, cluster: Cluster
) -> None:
    path = cluster.root / "gated.yaml"
    path.write_text("name: gated\nengine: vllm\nmodel: {hf: acme/gated}\n")
    refused = cluster.cli("deploy", "model", "--file", str(path))
    assert "hf_gated" in refused.stderr, refused.stderr
    token = cluster.role.state_dir / "hf-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    refused = cluster.cli("deploy", "model", "--file", str(path))
    assert f"chmod 600 {token}" in refused.stderr, refused.stderr
    token.chmod(0o600)
    hub.requests.clear()
    cluster.deploy("gated", model={"hf": "acme/gated"}, **_small())
    answer = cluster.openai().chat.completions.create(model="gated", messages=HELLO)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
    authorized = {r.host.split(":")[0] for r in hub.requests if r.authorization}
    assert authorized == {"127.0.0.1"}, "the token goes to the Hub's own host only"
    logs = [f for f in cluster.role.state_dir.rglob("*.log") if f.is_file()]
    assert logs
    assert not [f for f in logs if TOKEN in f.read_text(errors="replace")], "never logged"


def test_offline_a_stored_model_runs_and_a_missing_one_names_the_fix(hub: MockHub) -> None:
    main = hub.repos["acme/tiny"].refs["main"]
    # No endpoint that answers: only the store can serve.
    offline = {"HF_HUB_OFFLINE": "1", "CAPYCTL_HF_ENDPOINT": "http://127.0.0.1:9"}
    with running("hub-offline", env=offline) as alone:
        source = HubSource("acme/tiny", main)
        asyncio.run(pull(source, alone.root / "models", endpoint=hub.url, token=None))
        alone.deploy("stored", model={"hf": f"acme/tiny@{main}"}, **_small())
        client = alone.openai()
        answer = client.chat.completions.create(model="stored", messages=HELLO)  # type: ignore[arg-type]
        assert answer.choices[0].message.content
        v1 = hub.repos["acme/tiny"].refs["v1"]
        alone.deploy("missing", model={"hf": f"acme/tiny@{v1}"}, **_small())
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="missing", messages=HELLO)  # type: ignore[arg-type]
        assert "hf_offline_missing" in str(failed.value.body), failed.value.body
        assert "download it while online" in str(failed.value.body)


def _download_row(shown: str) -> str | None:
    return next((line for line in shown.splitlines() if line.startswith("download ")), None)


def test_a_model_pulled_ahead_starts_without_a_download_and_is_removed_once_unused(
    hub: MockHub, cluster: Cluster
) -> None:
    commit = PULLED.refs["main"]
    name = f"sources/huggingface/acme--pulled@{commit}"
    store = cluster.root / "models" / name
    pulled = json.loads(cluster.ok("model", "pull", "acme/pulled", "--json"))
    assert (pulled["state"], pulled["host"], pulled["name"]) == ("done", "local", name)
    assert (store / "model.safetensors").read_bytes() == PULLED.commits[commit][1].content
    again = cluster.ok("model", "pull", f"acme/pulled@{commit}")
    assert f"acme/pulled@{commit} is in the store of host local: {name}" in again

    # The router counts the bytes received and how long it took, once.
    labels = {"host": "local", "repo": "acme/pulled"}

    def counted() -> dict[str, float] | None:
        found = _samples(cluster, labels)
        return found if "capyctl_download_bytes_total" in found else None

    found = wait_for(counted, timeout=10, what="the download in the router's metrics")
    assert found["capyctl_download_bytes_total"] == sum(f.size for f in PULLED.commits[commit])
    assert found["capyctl_download_seconds_count"] == 1

    # A deployment of it starts from the store: no file is asked for again.
    asked = len(hub.requests)
    cluster.deploy("ahead", model={"hf": f"acme/pulled@{commit}"}, **_small())
    with cluster.openai() as client:
        client.chat.completions.create(model="ahead", messages=HELLO)  # type: ignore[arg-type]
    assert [r.path for r in hub.requests[asked:]] == []

    refused = cluster.cli("model", "remove", name)
    assert refused.returncode == 29, refused.stderr
    assert "model_in_use" in refused.stderr
    assert "ahead" in refused.stderr
    assert store.is_dir()
    cluster.ok("delete", "deployment", "ahead", "--wait")
    removed = cluster.ok("model", "remove", f"acme/pulled@{commit}")
    assert f"removed {name} from host local" in removed
    assert not store.exists()
    gone = cluster.cli("model", "remove", name)
    assert gone.returncode == 2, gone.stderr
    assert "not_found" in gone.stderr
    mine = cluster.cli("model", "remove", "sources/huggingface/../../small")
    assert mine.returncode == 2, mine.stderr
    assert "is not a download in the model store" in mine.stderr


@pytest.mark.parametrize("revision", ["", f"@{'0' * 40}"])
def test_a_pull_of_a_repository_the_hub_does_not_have_names_it(
    cluster: Cluster, revision: str
) -> None:
    """Refused as its branch is resolved here, or (a pinned commit) by hostd as it starts."""
    refused = cluster.cli("model", "pull", f"acme/nothing{revision}")
    assert refused.returncode == 2, refused.stderr
    assert "hf_repo_not_found" in refused.stderr
    assert "acme/nothing" in refused.stderr


@pytest.mark.parametrize("repo", ODD, ids=ODD)
def test_a_listing_no_git_tree_makes_is_refused_and_leaves_nothing(
    cluster: Cluster, repo: str
) -> None:
    """Refused by hostd from the listing, before a byte is downloaded: no store, staging
    folder or partial file."""
    said, _ = ODD[repo]
    refused = cluster.cli("model", "pull", repo)
    assert refused.returncode == 13, refused.stderr
    assert refused.stderr.startswith("error [hf_integrity]: "), refused.stderr
    assert said in refused.stderr
    assert "Traceback" not in refused.stderr
    sources = cluster.root / "models" / "sources"
    name = repo.replace("/", "--")
    assert list((sources / "huggingface").glob(f"*{name}@*")) == []
    assert list((sources / ".capyctl" / "partial").glob(f"{name}@*")) == []


def _samples(cluster: Cluster, labels: dict[str, str]) -> dict[str, float]:
    """The router's metric samples whose labels include `labels`, by name."""
    text = httpx.get(
        f"http://{cluster.role.inference}/metrics",
        headers={"Authorization": f"Bearer {cluster.api_key}"},
    ).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if labels.items() <= sample.labels.items()
    }


def _small() -> dict[str, object]:
    return {"engine_config": SMALL}
