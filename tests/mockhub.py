"""A mock of the Hugging Face Hub's plain-HTTP download API on a loopback port, for offline
tests of model downloads.

It serves the four endpoints that a download client calls, with the Hub's own headers:

- `GET /api/models/{owner}/{name}[/revision/{rev}]`: model info, `{"id", "sha", "siblings"}`;
- `GET /api/models/{owner}/{name}/tree/{rev}[/{path}]?recursive=true`: the tree listing, pages
  chained by `Link: <next-url>; rel="next"` (only when `Faults.tree_page_size` is set);
- `HEAD` and `GET /{owner}/{name}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag`
  (the git blob sha1 of a regular file), `X-Linked-Etag` and `X-Linked-Size` (the sha256 and size
  of an LFS file), and `206` with `Content-Range: bytes N-M/TOTAL` for `Range: bytes=N-`;
- `HEAD` and `GET /blobs/{sha256}[?commit={commit}]`: a file's bytes by content, the target of
  redirects, with the same metadata headers (`X-Repo-Commit` only when `commit` is given). It asks
  for no token, like a CDN.

Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`) and
`X-Error-Message`, which clients map to typed exceptions. Xet is never advertised (no
`X-Xet-Hash`, no `xetHash`, no `xet-auth` link), so clients download over plain HTTP, and nothing
is compressed.

A file named `redirected.bin` is served behind a 302 to `{url}/blobs/{sha256}?commit={commit}`,
on the same host, and one named `cdn.bin` behind a 302 to `{alt_url}/blobs/{sha256}`: `localhost`
instead of `127.0.0.1`, another host to a client, like a CDN. Both 302s carry the file's metadata
headers. A client may follow a same-host redirect with its HEAD (huggingface_hub 1.33 does) and
read the metadata from the final answer, so that answer names the commit too; it must not follow
one to another host, and must fetch from there without its token.
Every request is recorded, so a test can assert that no `Authorization` header reached the other
host. `Faults` switches break one behaviour at a time; a test sets them on a running hub.

`python tests/mockhub.py [PORT]` serves `tiny_repo()` and `gated_repo()` until interrupted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import uvicorn

from support import wait_for

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SAME_HOST_REDIRECT = "redirected.bin"
CROSS_HOST_REDIRECT = "cdn.bin"
CHUNK = 64 * 1024
RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass(frozen=True)
class HubFile:
    """One file of a commit. The Hub identifies an LFS file by the sha256 of its content and a
    regular file by its git blob sha1."""

    path: str
    content: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.content)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @cached_property
    def git_sha1(self) -> str:
        """The git blob sha1 of the content: sha1 over `blob <size>\\0` and the content."""
        return _git_sha1(self.content)

    @property
    def etag(self) -> str:
        """The identity the Hub serves as the (linked) ETag."""
        return self.sha256 if self.lfs else self.git_sha1

    @cached_property
    def pointer(self) -> bytes:
        """The git LFS pointer file that git stores in place of an LFS file's content."""
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {self.size}\n"
        ).encode()

    @property
    def pointer_size(self) -> int:
        return len(self.pointer)

    @property
    def blob_id(self) -> str:
        """The git blob sha1 of what git stores: the pointer for an LFS file (the tree's `oid`,
        as on the Hub), the content otherwise."""
        return _git_sha1(self.pointer) if self.lfs else self.git_sha1


@dataclass
class HubRepo:
    """A model repository: files by commit, and the branches and tags naming commits. With a
    token, every request but `/blobs/` needs `Authorization: Bearer <token>`."""

    repo_id: str
    commits: dict[str, list[HubFile]]
    refs: dict[str, str]
    token: str | None = None

    def commit_of(self, rev: str) -> str | None:
        """The commit a ref name or a 40-hex commit names, or None."""
        return self.refs.get(rev) or (rev if rev in self.commits else None)


@dataclass
class Faults:
    """Behaviours to break, all off by default. Cuts, wrong bytes and ignored ranges apply to
    file bodies (resolve and blob GETs); wrong ETags and a dropped X-Repo-Commit to every answer
    about a file (resolve and blob, HEAD and GET, their 302s and a missing file's 404)."""

    cut_after: int | None = None  # close the connection after N bytes of a file body ...
    cut_times: int = 1  # ... for this many GETs (counted down), then serve whole
    ignore_range: bool = False  # answer a Range request with 200 and the whole body
    wrong_etag: bool = False  # serve a wrong ETag / X-Linked-Etag
    wrong_bytes: bool = False  # serve bytes that differ, with the same length
    drop_commit: bool = False  # omit X-Repo-Commit
    tree_page_size: int | None = None  # paginate the tree listing, linked by `Link`
    bytes_per_second: int | None = None  # send file bodies no faster than this
    hold_after: int | None = None  # send N bytes of each file body, then wait for `released`
    released: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Recorded:
    """One request as it arrived: `path` is still URL-quoted; header names are lower-case."""

    method: str
    host: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


@dataclass
class _Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    cut_after: int | None = None  # send only this many body bytes, then drop the connection


class MockHub:
    """The mock hub: an ASGI app over `repos`, served by uvicorn in a daemon thread."""

    def __init__(self, repos: list[HubRepo], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.alt_url = f"http://localhost:{port}"
        self.faults = Faults()
        self.requests: list[Recorded] = []
        self.repos = {repo.repo_id: repo for repo in repos}
        self._blobs = {
            file.sha256: file for repo in repos for files in repo.commits.values() for file in files
        }
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, repos: list[HubRepo], port: int = 0) -> MockHub:
        """Serve `repos` on `port` of 127.0.0.1 (a free one by default); return once listening."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        hub = cls(repos, sock.getsockname()[1])
        config = uvicorn.Config(
            hub,
            loop="asyncio",
            lifespan="off",
            log_config=None,  # leave the process's logging as it is
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        hub._server = server
        hub._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="mockhub", daemon=True
        )
        hub._thread.start()
        thread = hub._thread
        wait_for(lambda: server.started or not thread.is_alive(), 10, "the mock hub to listen")
        if not server.started:
            raise RuntimeError("the mock hub did not start: see the uvicorn log above")
        return hub

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    def __enter__(self) -> MockHub:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http", scope["type"]
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        request = Recorded(
            method=scope["method"],
            host=headers.get("host", ""),
            path=raw_path,
            query=dict(parse_qsl(scope["query_string"].decode("latin-1"))),
            headers=headers,
        )
        self.requests.append(request)
        await _send(send, self._route(request), request.method == "HEAD", self.faults)

    def _route(self, request: Recorded) -> _Answer:
        parts = [unquote(part) for part in request.path.split("/")[1:]]
        reading = request.method in ("GET", "HEAD")
        if request.method == "GET" and parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if not rest:
                return self._info(request, repo_id, "main")
            if rest[0] == "revision" and len(rest) == 2:
                return self._info(request, repo_id, rest[1])
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(request, repo_id, rest[1], "/".join(rest[2:]).strip("/"))
        elif reading and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(request, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        elif reading and len(parts) == 2 and parts[0] == "blobs" and parts[1] in self._blobs:
            file = self._blobs[parts[1]]
            return self._content(request, file, self._metadata(file, request.query.get("commit")))
        return _error(404, "EntryNotFound", f"no such endpoint: {request.method} {request.path}")

    def _open(self, request: Recorded, repo_id: str, rev: str) -> tuple[HubRepo, str] | _Answer:
        """The repository and the commit `rev` names, or the Hub's error answer."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.token is not None and request.authorization != f"Bearer {repo.token}":
            message = (
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it."
                if request.authorization is None
                else "Invalid credentials in Authorization header"
            )
            return _error(401, "GatedRepo", message)
        commit = repo.commit_of(rev)
        if commit is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, commit

    def _info(self, request: Recorded, repo_id: str, rev: str) -> _Answer:
        opened = self._open(request, repo_id, rev)
        if isinstance(opened, _Answer):
            return opened
        repo, commit = opened
        blobs = _true(request.query.get("blobs"))
        siblings = [_sibling(file, blobs) for file in repo.commits[commit]]
        info = {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": commit,
            "private": False,
            "gated": "manual" if repo.token else False,
            "disabled": False,
            "siblings": siblings,
        }
        return _json(info)

    def _tree(self, request: Recorded, repo_id: str, rev: str, folder: str) -> _Answer:
        opened = self._open(request, repo_id, rev)
        if isinstance(opened, _Answer):
            return opened
        repo, commit = opened
        recursive = _true(request.query.get("recursive"))
        prefix = f"{folder}/" if folder else ""
        entries = [
            entry
            for entry in _tree_entries(commit, repo.commits[commit])
            if entry["path"].startswith(prefix)
            and (recursive or "/" not in entry["path"].removeprefix(prefix))
        ]
        if folder and not entries:
            return _error(404, "EntryNotFound", f"{folder} does not exist on {rev}")
        start = int(request.query.get("cursor", "0"))
        size = self.faults.tree_page_size
        end = len(entries) if size is None else start + size
        headers = {}
        if end < len(entries):
            query = urlencode({**request.query, "cursor": str(end)})
            headers["link"] = f'<http://{request.host}{request.path}?{query}>; rel="next"'
        return _json(entries[start:end], headers)

    def _resolve(self, request: Recorded, repo_id: str, rev: str, path: str) -> _Answer:
        opened = self._open(request, repo_id, rev)
        if isinstance(opened, _Answer):
            return opened
        repo, commit = opened
        file = next((file for file in repo.commits[commit] if file.path == path), None)
        if file is None:
            headers = {} if self.faults.drop_commit else {"x-repo-commit": commit}
            return _error(404, "EntryNotFound", f"{path} does not exist on {rev}", headers)
        headers = self._metadata(file, commit)
        if path == SAME_HOST_REDIRECT:
            location = f"{self.url}/blobs/{file.sha256}?commit={commit}"
            return _Answer(302, {**headers, "location": location})
        if path == CROSS_HOST_REDIRECT:
            return _Answer(302, {**headers, "location": f"{self.alt_url}/blobs/{file.sha256}"})
        return self._content(request, file, headers)

    def _metadata(self, file: HubFile, commit: str | None) -> dict[str, str]:
        """The headers that identify a file: its commit (when known), ETag and, for LFS, the
        linked ETag and size that clients prefer."""
        headers = {} if self.faults.drop_commit or commit is None else {"x-repo-commit": commit}
        etag = file.etag
        if self.faults.wrong_etag:
            etag = hashlib.sha256(etag.encode()).hexdigest()[: len(etag)]
        headers["etag"] = f'"{etag}"'
        if file.lfs:
            headers["x-linked-etag"] = f'"{etag}"'
            headers["x-linked-size"] = str(file.size)
        return headers

    def _content(self, request: Recorded, file: HubFile, headers: dict[str, str]) -> _Answer:
        """The file's bytes (or a range of them), as the faults shape them."""
        body = file.content
        if self.faults.wrong_bytes and body:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        status, total = 200, len(body)
        headers = {**headers, "accept-ranges": "bytes", "content-type": "application/octet-stream"}
        wanted = RANGE.fullmatch(request.headers.get("range", "").strip())
        if "range" in request.headers and not self.faults.ignore_range:
            if wanted is None or int(wanted[1]) >= total:
                return _Answer(416, {"content-range": f"bytes */{total}"})
            first = int(wanted[1])
            last = min(int(wanted[2]), total - 1) if wanted[2] else total - 1
            status, body = 206, body[first : last + 1]
            headers["content-range"] = f"bytes {first}-{last}/{total}"
        faults, cut = self.faults, None
        if (
            request.method == "GET"
            and faults.cut_after is not None
            and faults.cut_times > 0
            and faults.cut_after < len(body)
        ):
            faults.cut_times -= 1
            cut = faults.cut_after
        return _Answer(status, headers, body, cut)


async def _send(send: Send, answer: _Answer, head: bool, faults: Faults) -> None:
    """Send `answer` with its full Content-Length, at most `faults.bytes_per_second` bytes a
    second, pausing after `faults.hold_after` bytes until `faults.released` is set. A cut
    answer stops after `cut_after` bytes and returns unfinished, and uvicorn then closes the
    connection: the client sees a body shorter than announced."""
    headers = [(name.encode(), value.encode()) for name, value in answer.headers.items()]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    if head:
        await send({"type": "http.response.body", "body": b""})
        return
    body = memoryview(answer.body)
    end = len(body) if answer.cut_after is None else answer.cut_after
    pace, hold = faults.bytes_per_second, faults.hold_after
    for start in range(0, end, CHUNK):
        if hold is not None and start >= hold:
            while not faults.released.is_set():
                await asyncio.sleep(0.05)
            hold = None
        chunk = bytes(body[start : min(start + CHUNK, end)])
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if pace is not None:
            await asyncio.sleep(len(chunk) / pace)
    if answer.cut_after is None:
        await send({"type": "http.response.body", "body": b""})


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _true(value: str | None) -> bool:
    return value in ("true", "True", "1")


def _json(data: object, headers: dict[str, str] | None = None) -> _Answer:
    return _Answer(
        200, {"content-type": "application/json", **(headers or {})}, json.dumps(data).encode()
    )


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> _Answer:
    return _Answer(
        status,
        {
            "x-error-code": code,
            "x-error-message": message,
            "content-type": "application/json",
            **(headers or {}),
        },
        json.dumps({"error": message}).encode(),
    )


def _sibling(file: HubFile, blobs: bool) -> dict[str, object]:
    """A `siblings` entry of model info; `?blobs=true` adds sizes and identities."""
    sibling: dict[str, object] = {"rfilename": file.path}
    if blobs:
        sibling.update(size=file.size, blobId=file.blob_id)
        if file.lfs:
            sibling["lfs"] = {
                "sha256": file.sha256,
                "size": file.size,
                "pointerSize": file.pointer_size,
            }
    return sibling


def _tree_entries(commit: str, files: list[HubFile]) -> list[dict[str, Any]]:
    """Every folder and file of a commit, sorted by path, as the tree listing shows them."""
    folders = {
        "/".join(parts[:depth])
        for parts in (file.path.split("/") for file in files)
        for depth in range(1, len(parts))
    }
    entries: list[dict[str, Any]] = [
        {"type": "directory", "path": folder, "oid": _git_sha1(f"{commit}:{folder}".encode())}
        for folder in folders
    ]
    for file in files:
        entry = {"type": "file", "path": file.path, "size": file.size, "oid": file.blob_id}
        if file.lfs:
            entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": file.pointer_size}
        entries.append(entry)
    return sorted(entries, key=lambda entry: str(entry["path"]))


def _commit_id(text: str) -> str:
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def _noise(size: int, seed: str) -> bytes:
    """`size` deterministic pseudo-random bytes (incompressible, like weights)."""
    return random.Random(seed).randbytes(size)


def tiny_repo() -> HubRepo:
    """`acme/tiny`: two commits, `main` naming the newer and tag `v1` the older. Each has a
    config (regular), a 3 MiB safetensors (LFS, different per commit) and a nested vocabulary
    (regular); the newer also has two 256 KiB LFS files behind redirects, `redirected.bin` (same
    host) and `cdn.bin` (the other host name)."""
    commits: dict[str, list[HubFile]] = {}
    for number, hidden in ((1, 64), (2, 128)):
        config = {"model_type": "tiny", "hidden_size": hidden, "vocab_size": 4}
        commits[_commit_id(f"acme/tiny commit {number}")] = [
            HubFile("config.json", json.dumps(config, indent=2).encode(), lfs=False),
            HubFile("model.safetensors", _noise(3 * 1024 * 1024, f"weights {number}"), lfs=True),
            HubFile("nested/tokenizer/vocab.txt", f"<s>\n</s>\nhi\nv{number}\n".encode(), False),
        ]
    older, newer = commits
    commits[newer] += [
        HubFile(SAME_HOST_REDIRECT, _noise(256 * 1024, "redirected"), lfs=True),
        HubFile(CROSS_HOST_REDIRECT, _noise(256 * 1024, "cdn"), lfs=True),
    ]
    return HubRepo("acme/tiny", commits, {"main": newer, "v1": older})


def gated_repo(token: str = "hf_good") -> HubRepo:
    """`acme/gated`: one commit that needs `Authorization: Bearer <token>`."""
    commit = _commit_id("acme/gated commit 1")
    files = [
        HubFile("config.json", b'{"model_type": "gated"}\n', lfs=False),
        HubFile("model.safetensors", _noise(64 * 1024, "gated weights"), lfs=True),
    ]
    return HubRepo("acme/gated", {commit: files}, {"main": commit}, token=token)


def one_commit_repo(repo_id: str, files: list[HubFile]) -> HubRepo:
    """`repo_id` with one commit holding `files`, named by `main`."""
    commit = _commit_id(f"{repo_id} commit 1")
    return HubRepo(repo_id, {commit: files}, {"main": commit})


if __name__ == "__main__":
    hub = MockHub.start([tiny_repo(), gated_repo()], int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(f"serving acme/tiny and acme/gated (token hf_good) at {hub.url} and {hub.alt_url}")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        hub.stop()
