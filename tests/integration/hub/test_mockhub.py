"""The mock Hugging Face Hub serves what a download client relies on: model info, the tree
listing with its identities, HEAD metadata, redirects to the same and to another host, ranges,
the typed errors, a gated repository, and each fault switch doing what it says. Checked over
real HTTP with httpx and, where it is installed, with the huggingface_hub client itself."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from mockhub import Faults, HubFile, MockHub, gated_repo, tiny_repo
from support import run_python

TINY = tiny_repo()
OLDER, NEWER = TINY.commits
GATED = gated_repo()
(GATED_COMMIT,) = GATED.commits


def files_of(commit: str) -> dict[str, HubFile]:
    return {file.path: file for file in TINY.commits[commit]}


@pytest.fixture(scope="module")
def served() -> Iterator[MockHub]:
    with_pr = dataclasses.replace(TINY, refs={**TINY.refs, "refs/pr/1": OLDER})
    with MockHub.start([with_pr, GATED]) as hub:
        yield hub


@pytest.fixture
def hub(served: MockHub) -> MockHub:
    """The module's hub with its faults off and its record empty."""
    served.faults = Faults()
    served.requests.clear()
    return served


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as client:
        yield client


def test_model_info_names_the_commit_of_a_ref_or_a_commit(
    hub: MockHub, client: httpx.Client
) -> None:
    for path, commit in (
        ("", NEWER),
        ("/revision/main", NEWER),
        ("/revision/v1", OLDER),
        (f"/revision/{OLDER}", OLDER),
        ("/revision/refs%2Fpr%2F1", OLDER),
    ):
        response = client.get(f"{hub.url}/api/models/acme/tiny{path}")
        assert response.status_code == 200, path
        info = response.json()
        assert (info["id"], info["sha"]) == ("acme/tiny", commit), path
        assert [sibling["rfilename"] for sibling in info["siblings"]] == list(files_of(commit))
    detailed = client.get(f"{hub.url}/api/models/acme/tiny", params={"blobs": "true"}).json()
    weights = next(s for s in detailed["siblings"] if s["rfilename"] == "model.safetensors")
    assert weights["lfs"]["sha256"] == files_of(NEWER)["model.safetensors"].sha256
    assert weights["size"] == 3 * 1024 * 1024


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/api/models/acme/missing", 404, "RepoNotFound"),
        ("GET", "/api/models/acme/missing/tree/main", 404, "RepoNotFound"),
        ("GET", "/api/models/acme/tiny/revision/v9", 404, "RevisionNotFound"),
        ("GET", f"/api/models/acme/tiny/revision/{'0' * 40}", 404, "RevisionNotFound"),
        ("GET", "/api/models/acme/tiny/tree/v9", 404, "RevisionNotFound"),
        ("HEAD", "/acme/missing/resolve/main/config.json", 404, "RepoNotFound"),
        ("HEAD", "/acme/tiny/resolve/v9/config.json", 404, "RevisionNotFound"),
        ("HEAD", "/acme/tiny/resolve/main/missing.json", 404, "EntryNotFound"),
        ("GET", "/acme/tiny/resolve/v1/redirected.bin", 404, "EntryNotFound"),
    ],
)
def test_errors_carry_the_hub_error_code(
    hub: MockHub, client: httpx.Client, method: str, path: str, status: int, code: str
) -> None:
    response = client.request(method, hub.url + path)
    assert response.status_code == status
    assert response.headers["x-error-code"] == code
    assert response.headers["x-error-message"]


def test_a_missing_file_names_the_commit(hub: MockHub, client: httpx.Client) -> None:
    response = client.head(f"{hub.url}/acme/tiny/resolve/v1/nested/missing.txt")
    assert response.headers["x-error-code"] == "EntryNotFound"
    assert response.headers["x-repo-commit"] == OLDER


def test_tree_lists_folders_and_files_whose_identities_match_their_bytes(
    hub: MockHub, client: httpx.Client
) -> None:
    for recursive in ("true", "True", "1"):
        url = f"{hub.url}/api/models/acme/tiny/tree/{NEWER}"
        entries = client.get(url, params={"recursive": recursive, "expand": "false"}).json()
        assert {entry["path"] for entry in entries if entry["type"] == "directory"} == {
            "nested",
            "nested/tokenizer",
        }
        files = {entry["path"]: entry for entry in entries if entry["type"] == "file"}
        assert set(files) == set(files_of(NEWER))
        for path, entry in files.items():
            file_url = f"{hub.url}/acme/tiny/resolve/{NEWER}/{path}"
            content = client.get(file_url, follow_redirects=True).content
            assert entry["size"] == len(content)
            if "lfs" in entry:
                assert entry["lfs"]["oid"] == hashlib.sha256(content).hexdigest()
                assert entry["lfs"]["size"] == len(content)
                assert entry["lfs"]["pointerSize"] == len(files_of(NEWER)[path].pointer)
            else:
                blob = b"blob %d\0" % len(content) + content
                assert entry["oid"] == hashlib.sha1(blob).hexdigest()
        assert "xetHash" not in json.dumps(entries)
    top = client.get(f"{hub.url}/api/models/acme/tiny/tree/v1").json()
    assert [entry["path"] for entry in top] == ["config.json", "model.safetensors", "nested"]
    nested = client.get(f"{hub.url}/api/models/acme/tiny/tree/v1/nested/tokenizer").json()
    assert [entry["path"] for entry in nested] == ["nested/tokenizer/vocab.txt"]


def test_tree_pages_are_chained_by_link_headers(hub: MockHub, client: httpx.Client) -> None:
    url = f"{hub.url}/api/models/acme/tiny/tree/main?recursive=true&expand=false"
    whole = client.get(url).json()
    assert "link" not in client.get(url).headers
    hub.faults.tree_page_size = 2
    pages: list[list[dict[str, Any]]] = []
    next_url: str | None = url
    while next_url is not None:
        response = client.get(next_url)
        pages.append(response.json())
        next_url = response.links.get("next", {}).get("url")
        if next_url is not None:
            assert next_url.startswith(f"{hub.url}/api/models/acme/tiny/tree/main?")
            assert "recursive=true" in next_url
    assert [len(page) for page in pages] == [2, 2, 2, 1]
    assert [entry for page in pages for entry in page] == whole


def test_head_serves_the_identity_the_commit_and_the_size(
    hub: MockHub, client: httpx.Client
) -> None:
    files = files_of(OLDER)
    config = client.head(
        f"{hub.url}/acme/tiny/resolve/v1/config.json", headers={"accept-encoding": "identity"}
    )
    assert config.status_code == 200
    assert config.headers["etag"] == f'"{files["config.json"].git_sha1}"'
    assert config.headers["x-repo-commit"] == OLDER
    assert config.headers["content-length"] == str(files["config.json"].size)
    assert "x-linked-etag" not in config.headers
    weights = client.head(f"{hub.url}/acme/tiny/resolve/v1/model.safetensors")
    assert weights.status_code == 200
    assert weights.headers["x-linked-etag"] == f'"{files["model.safetensors"].sha256}"'
    assert weights.headers["x-linked-size"] == str(3 * 1024 * 1024)
    assert weights.headers["etag"] == f'"{files["model.safetensors"].sha256}"'
    assert weights.headers["content-length"] == str(3 * 1024 * 1024)
    for response in (config, weights):
        assert response.content == b""
        assert not {"x-xet-hash", "content-encoding", "link"} & set(response.headers)


def test_a_nested_file_is_served_under_its_path(hub: MockHub, client: httpx.Client) -> None:
    response = client.get(f"{hub.url}/acme/tiny/resolve/main/nested/tokenizer/vocab.txt")
    assert response.content == files_of(NEWER)["nested/tokenizer/vocab.txt"].content
    assert hub.requests[-1].path == "/acme/tiny/resolve/main/nested/tokenizer/vocab.txt"


def test_a_same_host_redirect_carries_the_metadata_and_keeps_the_token(
    hub: MockHub, client: httpx.Client
) -> None:
    file = files_of(NEWER)["redirected.bin"]
    url = f"{hub.url}/acme/tiny/resolve/main/redirected.bin"
    moved = client.head(url)
    assert moved.status_code == 302
    assert moved.headers["location"] == f"{hub.url}/blobs/{file.sha256}?commit={NEWER}"
    followed = client.head(url, follow_redirects=True)
    for response in (moved, followed):
        assert response.headers["x-repo-commit"] == NEWER
        assert response.headers["x-linked-etag"] == f'"{file.sha256}"'
        assert response.headers["x-linked-size"] == str(file.size)
    assert followed.headers["content-length"] == str(file.size)
    got = client.get(url, headers={"authorization": "Bearer hf_any"}, follow_redirects=True)
    assert got.content == file.content
    blob = hub.requests[-1]
    assert (blob.host, blob.path) == (urlsplit(hub.url).netloc, f"/blobs/{file.sha256}")
    assert blob.authorization == "Bearer hf_any"


def test_a_cross_host_redirect_gets_no_token_from_httpx(hub: MockHub, client: httpx.Client) -> None:
    file = files_of(NEWER)["cdn.bin"]
    url = f"{hub.url}/acme/tiny/resolve/{NEWER}/cdn.bin"
    moved = client.head(url)
    assert moved.status_code == 302
    assert moved.headers["location"] == f"{hub.alt_url}/blobs/{file.sha256}"
    assert urlsplit(hub.alt_url).hostname == "localhost"
    assert moved.headers["x-repo-commit"] == NEWER
    assert moved.headers["x-linked-etag"] == f'"{file.sha256}"'
    assert moved.headers["x-linked-size"] == str(file.size)
    got = client.get(url, headers={"authorization": "Bearer hf_any"}, follow_redirects=True)
    assert got.content == file.content
    hub_request, cdn_request = hub.requests[-2:]
    assert hub_request.authorization == "Bearer hf_any"
    assert cdn_request.host == urlsplit(hub.alt_url).netloc
    assert cdn_request.authorization is None
    # the mock records a token sent to the other host; it does not refuse it
    sent = client.get(moved.headers["location"], headers={"authorization": "Bearer hf_any"})
    assert sent.status_code == 200
    assert hub.requests[-1].authorization == "Bearer hf_any"


def test_a_range_gets_206_with_content_range(hub: MockHub, client: httpx.Client) -> None:
    content = files_of(NEWER)["model.safetensors"].content
    url = f"{hub.url}/acme/tiny/resolve/main/model.safetensors"
    tail = client.get(url, headers={"range": "bytes=1000000-"})
    assert tail.status_code == 206
    assert tail.headers["content-range"] == f"bytes 1000000-{len(content) - 1}/{len(content)}"
    assert tail.headers["content-length"] == str(len(content) - 1000000)
    assert tail.content == content[1000000:]
    middle = client.get(url, headers={"range": "bytes=10-19"})
    assert (middle.status_code, middle.content) == (206, content[10:20])
    beyond = client.get(url, headers={"range": f"bytes={len(content)}-"})
    assert beyond.status_code == 416
    assert beyond.headers["content-range"] == f"bytes */{len(content)}"
    blob = files_of(NEWER)["cdn.bin"]
    from_cdn = client.get(f"{hub.alt_url}/blobs/{blob.sha256}", headers={"range": "bytes=5-"})
    assert (from_cdn.status_code, from_cdn.content) == (206, blob.content[5:])


def read_until_broken(client: httpx.Client, url: str, **headers: str) -> tuple[bytes, bool]:
    """The body bytes that arrived, and whether the transfer broke before its end."""
    received = bytearray()
    try:
        with client.stream("GET", url, headers=headers) as response:
            for chunk in response.iter_raw():
                received += chunk
    except httpx.RemoteProtocolError:
        return bytes(received), True
    return bytes(received), False


def test_a_cut_body_breaks_after_n_bytes_then_resumes_whole(
    hub: MockHub, client: httpx.Client
) -> None:
    content = files_of(NEWER)["model.safetensors"].content
    url = f"{hub.url}/acme/tiny/resolve/main/model.safetensors"
    hub.faults.cut_after, hub.faults.cut_times = 100_000, 2
    first, broken = read_until_broken(client, url)
    assert (first, broken) == (content[:100_000], True)
    second, broken = read_until_broken(client, url, range=f"bytes={len(first)}-")
    assert (second, broken) == (content[100_000:200_000], True)
    rest, broken = read_until_broken(client, url, range=f"bytes={len(first) + len(second)}-")
    assert not broken
    assert first + second + rest == content
    assert hub.faults.cut_times == 0


def test_ignore_range_answers_200_with_the_whole_body(hub: MockHub, client: httpx.Client) -> None:
    content = files_of(NEWER)["model.safetensors"].content
    hub.faults.ignore_range = True
    response = client.get(
        f"{hub.url}/acme/tiny/resolve/main/model.safetensors", headers={"range": "bytes=100-"}
    )
    assert response.status_code == 200
    assert "content-range" not in response.headers
    assert response.content == content


def test_wrong_bytes_have_the_same_length_and_another_hash(
    hub: MockHub, client: httpx.Client
) -> None:
    hub.faults.wrong_bytes = True
    for path in ("model.safetensors", "config.json", "cdn.bin"):
        file = files_of(NEWER)[path]
        got = client.get(f"{hub.url}/acme/tiny/resolve/main/{path}", follow_redirects=True)
        assert len(got.content) == file.size
        assert hashlib.sha256(got.content).hexdigest() != file.sha256
        assert got.headers["etag"].strip('"') == file.etag


def test_wrong_etag_names_other_identities(hub: MockHub, client: httpx.Client) -> None:
    hub.faults.wrong_etag = True
    files = files_of(NEWER)
    config = client.head(f"{hub.url}/acme/tiny/resolve/main/config.json")
    weights = client.head(f"{hub.url}/acme/tiny/resolve/main/model.safetensors")
    assert config.headers["etag"] != f'"{files["config.json"].git_sha1}"'
    assert len(config.headers["etag"]) == 42
    assert weights.headers["x-linked-etag"] != f'"{files["model.safetensors"].sha256}"'
    assert weights.headers["etag"] == weights.headers["x-linked-etag"]
    got = client.get(f"{hub.url}/acme/tiny/resolve/main/model.safetensors")
    assert got.content == files["model.safetensors"].content


def test_drop_commit_leaves_out_x_repo_commit(hub: MockHub, client: httpx.Client) -> None:
    hub.faults.drop_commit = True
    for path in ("config.json", "model.safetensors", "cdn.bin", "missing.txt"):
        response = client.head(f"{hub.url}/acme/tiny/resolve/main/{path}")
        assert response.status_code in (200, 302, 404)
        assert "x-repo-commit" not in response.headers


@pytest.mark.parametrize(
    "path",
    [
        "/api/models/acme/gated",
        "/api/models/acme/gated/revision/main",
        "/api/models/acme/gated/tree/main?recursive=true",
        "/acme/gated/resolve/main/config.json",
        f"/acme/gated/resolve/{GATED_COMMIT}/model.safetensors",
    ],
)
def test_a_gated_repo_needs_the_right_token(hub: MockHub, client: httpx.Client, path: str) -> None:
    for method in ("HEAD", "GET") if "/resolve/" in path else ("GET",):
        refused = client.request(method, hub.url + path)
        assert refused.status_code == 401
        assert refused.headers["x-error-code"] == "GatedRepo"
        wrong = client.request(method, hub.url + path, headers={"authorization": "Bearer hf_bad"})
        assert wrong.status_code == 401
        assert wrong.headers["x-error-code"] == "GatedRepo"
        assert wrong.headers["x-error-message"] == "Invalid credentials in Authorization header"
        assert hub.requests[-1].authorization == "Bearer hf_bad"
        right = client.request(method, hub.url + path, headers={"authorization": "Bearer hf_good"})
        assert right.status_code == 200


def test_gated_blobs_need_no_token(hub: MockHub, client: httpx.Client) -> None:
    (_config, weights) = GATED.commits[GATED_COMMIT]
    response = client.get(f"{hub.alt_url}/blobs/{weights.sha256}")
    assert (response.status_code, response.content) == (200, weights.content)


SNAPSHOT = """
import json, sys
from pathlib import Path
from huggingface_hub import hf_hub_download, snapshot_download

endpoint, commit, target = sys.argv[1:4]
folder = snapshot_download(
    repo_id="acme/tiny", revision=commit, local_dir=target, endpoint=endpoint, token=False
)
cdn = hf_hub_download(
    repo_id="acme/tiny", filename="cdn.bin", revision="main", endpoint=endpoint,
    token="hf_secret", local_dir=Path(target) / "again",
)
gated = snapshot_download(
    repo_id="acme/gated", local_dir=Path(target) / "gated", endpoint=endpoint, token="hf_good"
)
errors = {}
for name, kwargs in {
    "repo": {"repo_id": "acme/missing", "filename": "config.json"},
    "revision": {"repo_id": "acme/tiny", "filename": "config.json", "revision": "v9"},
    "entry": {"repo_id": "acme/tiny", "filename": "missing.json"},
    "gated": {"repo_id": "acme/gated", "filename": "config.json"},
}.items():
    try:
        into = Path(target) / f"error-{name}"
        hf_hub_download(**kwargs, endpoint=endpoint, token=False, local_dir=into)
    except Exception as error:
        errors[name] = type(error).__name__
print(json.dumps({"folder": folder, "cdn": cdn, "gated": gated, "errors": errors}))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("huggingface_hub") is None, reason="huggingface_hub is not installed"
)
def test_huggingface_hub_downloads_every_file_with_its_bytes(hub: MockHub, tmp_path: Path) -> None:
    """The real client, in a process of its own (it reads its settings at import)."""
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    env.pop("HF_ENDPOINT", None)
    env.pop("HF_TOKEN", None)
    target = tmp_path / "tiny"
    done = run_python("-c", SNAPSHOT, hub.url, NEWER, str(target), env=env)
    assert done.returncode == 0, done.stderr
    paths = json.loads(done.stdout.splitlines()[-1])
    assert Path(paths["folder"]) == target
    for file in TINY.commits[NEWER]:
        assert (target / file.path).read_bytes() == file.content, file.path
    assert Path(paths["cdn"]).read_bytes() == files_of(NEWER)["cdn.bin"].content
    for file in GATED.commits[GATED_COMMIT]:
        assert (target / "gated" / file.path).read_bytes() == file.content
    assert paths["errors"] == {
        "repo": "RepositoryNotFoundError",
        "revision": "RevisionNotFoundError",
        "entry": "RemoteEntryNotFoundError",
        "gated": "GatedRepoError",
    }
    to_cdn = [r for r in hub.requests if r.host == urlsplit(hub.alt_url).netloc]
    assert to_cdn
    assert all(r.authorization is None for r in to_cdn)
    assert any(r.authorization == "Bearer hf_secret" for r in hub.requests)
