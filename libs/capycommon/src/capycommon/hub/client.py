"""A small client of the Hugging Face Hub's four download endpoints, over httpx.

- `GET /api/models/{repo}/revision/{rev}`: a branch or tag to its commit;
- `GET /api/models/{repo}/tree/{commit}?recursive=true&expand=false`: the file listing,
  paged with `Link: <url>; rel="next"`;
- `HEAD /{repo}/resolve/{commit}/{path}`: a file's commit, identity and download URL;
- `GET` of that URL: the bytes, resumed with `Range: bytes=N-`.

The token goes only to the endpoint's own origin (scheme, host and port): a redirect to any
other origin is fetched without it. It is never logged and never part of an error message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote, urljoin, urlsplit

import httpx

from capycommon.errors import CapyError
from capycommon.hub.errors import (
    HfGated,
    HfIntegrity,
    HfRepoNotFound,
    HfRevisionNotFound,
    HfTokenRefused,
    HfUnreachable,
)
from capycommon.hub.integrity import Expected, etag_value
from capycommon.hub.source import HubSource, is_commit

_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5


@dataclass(frozen=True)
class HubLimits:
    """Timeouts, retries and bounds of one client.

    `attempts` bounds the tries of each request (a file download resumes from its partial file
    on each); the waits between them start at `backoff_s` and double. `reserve_bytes` stays free
    on the store's filesystem after a download."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    attempts: int = 5
    backoff_s: float = 0.5
    max_tree_pages: int = 1000
    reserve_bytes: int = 1 << 30

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_s * float(2**attempt), 8.0)


def origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port of `url`, default ports filled in (`localhost` and `127.0.0.1`
    are different origins)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port


@dataclass(frozen=True)
class FileTarget:
    """Where to GET one file, and whether the token goes with it."""

    url: str
    with_token: bool


class HubClient:
    """One endpoint, one token (or none), one connection pool. Use it as an async context."""

    def __init__(self, endpoint: str, token: str | None, limits: HubLimits | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.limits = limits or HubLimits()
        self._token = token or None
        self._origin = origin(self.endpoint)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                self.limits.read_timeout_s, connect=self.limits.connect_timeout_s
            ),
            follow_redirects=False,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._http.aclose()

    # Requests ---------------------------------------------------------------------------

    def _headers(self, url: str, **extra: str) -> dict[str, str]:
        headers = {"Accept-Encoding": "identity", **extra}
        if self._token is not None and origin(url) == self._origin:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def redact(self, text: str) -> str:
        """`text` without the token."""
        return text.replace(self._token, "***") if self._token else text

    def unreachable(self, exc: Exception, what: str) -> HfUnreachable:
        detail = self.redact(str(exc) or type(exc).__name__)
        return HfUnreachable(
            f"the Hugging Face Hub at {self.endpoint} cannot be reached to {what} ({detail}); "
            "check the network, set CAPYCTL_HF_ENDPOINT to a reachable Hub or mirror, or deploy "
            "the model from a local folder"
        )

    async def _send(self, method: str, url: str, what: str, repo: str) -> httpx.Response:
        """One small request (no streamed body), retried on connection errors and 5xx."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, url, headers=self._headers(url))
                await response.aread()
            except httpx.TransportError as exc:
                failure: CapyError = self.unreachable(exc, what)
            else:
                if response.status_code < 500:
                    return response
                failure = self.failed(response, what, repo)
            attempt += 1
            if attempt >= self.limits.attempts:
                raise failure
            await asyncio.sleep(self.limits.backoff(attempt - 1))

    def failed(
        self, response: httpx.Response, what: str, repo: str, revision: str = ""
    ) -> CapyError:
        """The error of a Hub answer that is not a success, by its `X-Error-Code` and status."""
        code = response.headers.get("x-error-code", "")
        status = response.status_code
        if code == "RevisionNotFound":
            return HfRevisionNotFound(
                f"{repo} on {self.endpoint} has no revision {revision or '(unknown)'}; check "
                "the branch, tag or commit"
            )
        if code == "RepoNotFound" or (status == 404 and not code):
            tail = (
                ", or it is private and the token cannot see it"
                if self._token
                else "; if it is private, set the token file or CAPYCTL_HF_TOKEN"
            )
            return HfRepoNotFound(
                f"the Hugging Face Hub at {self.endpoint} has no repository {repo}{tail}; "
                "check the name (owner/name)"
            )
        if code == "GatedRepo" or status in (401, 403):
            if self._token is None:
                return HfGated(
                    f"{repo} on {self.endpoint} is gated or private and no token was sent; "
                    "set the token file or CAPYCTL_HF_TOKEN to a token with access"
                )
            return HfTokenRefused(
                f"the Hugging Face Hub at {self.endpoint} refused the token for {repo} (HTTP "
                f"{status}); replace the token file or CAPYCTL_HF_TOKEN with a valid token, and "
                "accept the repository's conditions on the Hub if it is gated"
            )
        message = self.redact(response.headers.get("x-error-message", response.reason_phrase))
        return HfUnreachable(
            f"the Hugging Face Hub at {self.endpoint} failed to {what} of {repo}: HTTP {status} "
            f"{message}; try again later, or set CAPYCTL_HF_ENDPOINT to another Hub or mirror"
        )

    # The four endpoints -----------------------------------------------------------------

    async def resolve(self, source: HubSource) -> str:
        """The commit `source.revision` names: a 40-hex commit as is, with no request; a
        branch or tag through the model-info API."""
        if is_commit(source.revision):
            return source.revision
        revision = quote(source.revision, safe="")
        url = f"{self.endpoint}/api/models/{source.repo}/revision/{revision}"
        what = f"resolve revision {source.revision}"
        response = await self._send("GET", url, what, source.repo)
        if response.status_code != 200:
            raise self.failed(response, what, source.repo, source.revision)
        try:
            sha = response.json()["sha"]
        except (ValueError, KeyError, TypeError):
            sha = None
        if not isinstance(sha, str) or not is_commit(sha):
            raise HfIntegrity(
                f"the Hub at {self.endpoint} answered no commit for {source.repo}@"
                f"{source.revision}; is it a Hugging Face Hub?"
            )
        return sha

    async def tree(self, source: HubSource, commit: str) -> list[dict[str, Any]]:
        """Every entry of the recursive tree listing at `commit`, all pages."""
        url: str | None = (
            f"{self.endpoint}/api/models/{source.repo}/tree/{commit}?recursive=true&expand=false"
        )
        entries: list[dict[str, Any]] = []
        what = f"list the files of revision {commit}"
        for _page in range(self.limits.max_tree_pages):
            if url is None:
                return entries
            response = await self._send("GET", url, what, source.repo)
            if response.status_code != 200:
                raise self.failed(response, what, source.repo, commit)
            try:
                page = response.json()
            except ValueError:
                page = None
            if not isinstance(page, list) or not all(isinstance(e, dict) for e in page):
                raise HfIntegrity(
                    f"the Hub at {self.endpoint} answered no file listing for {source.repo}@"
                    f"{commit}; is it a Hugging Face Hub?"
                )
            entries.extend(page)
            following = response.links.get("next", {}).get("url")
            url = urljoin(url, following) if following else None
        if url is None:
            return entries
        raise HfIntegrity(
            f"the file listing of {source.repo}@{commit} runs past "
            f"{self.limits.max_tree_pages} pages; is the endpoint a Hugging Face Hub?"
        )

    def file_url(self, source: HubSource, commit: str, path: str) -> str:
        return f"{self.endpoint}/{source.repo}/resolve/{commit}/{quote(path, safe='/')}"

    async def locate(self, source: HubSource, commit: str, file: Expected) -> FileTarget:
        """HEAD the file: the Hub must serve `commit` and list the same identity; the answer,
        or its redirect, is where to GET the bytes."""
        url = self.file_url(source, commit, file.path)
        what = f"find {file.path}"
        response = await self._send("HEAD", url, what, source.repo)
        if response.status_code not in (200, *_REDIRECTS):
            if response.headers.get("x-error-code") == "EntryNotFound":
                raise HfIntegrity(
                    f"the Hub lists {file.path} in {source.repo}@{commit} but does not serve it"
                )
            raise self.failed(response, what, source.repo, commit)
        served = response.headers.get("x-repo-commit")
        if served is None:
            raise HfIntegrity(
                f"the answer for {file.path} from {self.endpoint} has no "
                "X-Repo-Commit header, so it does not come from a Hugging Face Hub; check "
                "CAPYCTL_HF_ENDPOINT"
            )
        if served != commit:
            raise HfIntegrity(f"the Hub served {file.path} at commit {served}, not the pinned one")
        etag = etag_value(response.headers.get("x-linked-etag") or response.headers.get("etag"))
        if etag is not None and etag.lower() != file.oid:
            raise HfIntegrity(
                f"the Hub's ETag of {file.path} is {etag}, its listing says {file.oid}"
            )
        if response.status_code in _REDIRECTS and "location" in response.headers:
            url = urljoin(url, response.headers["location"])
        return FileTarget(url, with_token=origin(url) == self._origin)

    @asynccontextmanager
    async def stream(self, target: FileTarget, offset: int) -> AsyncIterator[httpx.Response]:
        """A GET of the file's bytes from `offset` on, redirects followed by hand (the token
        only to the endpoint's origin). Transport errors propagate as httpx errors."""
        url = target.url
        for _hop in range(_MAX_REDIRECTS + 1):
            extra = {"Range": f"bytes={offset}-"} if offset else {}
            headers = self._headers(url, **extra)
            if not target.with_token:
                headers.pop("Authorization", None)
            request = self._http.build_request("GET", url, headers=headers)
            response = await self._http.send(request, stream=True)
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    target = FileTarget(url, target.with_token and origin(url) == self._origin)
                    continue
                yield response
                return
            finally:
                await response.aclose()
        raise HfUnreachable(f"{target.url} redirects more than {_MAX_REDIRECTS} times")
