"""Talking to a running role's management API: the address from its role record, the admin
token from its credentials, an Idempotency-Key per command (a retry reuses it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx

from capycommon import credentials
from capycommon.errors import CapyError, RoleNotRunning
from capycommon.paths import StatePaths
from capycommon.settingvalues import split_address
from capyctl_cli import record
from capyctl_cli.launcher import lock_is_held

RETRIES = 3


class ActivationTimeout(CapyError):
    code = "activation_timeout"


class LaunchFailed(CapyError):
    code = "launch_failed"


class Management:
    """A client of the management API of the role on a state dir."""

    def __init__(self, paths: StatePaths, timeout: float = 30.0) -> None:
        found = record.read(paths) if lock_is_held(paths) else None
        address = found.listeners.get("management") if found else None
        if found is None or address is None:
            raise RoleNotRunning(
                f"no standalone or server role is running on the state dir {paths.root}; "
                "start one with `capyctl start standalone`"
            )
        host, port = split_address(address)
        host = "127.0.0.1" if host in ("0.0.0.0", "localhost") else host
        if ":" in host:
            host = f"[{host}]"
        token = credentials.load(paths.credentials).admin_token
        self.http = httpx.Client(
            base_url=f"http://{host}:{port}/management/v1",
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def __enter__(self) -> Management:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.http.close()

    def get(self, path: str) -> dict[str, Any]:
        return self._call(lambda: self.http.get(path))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A mutation: the same Idempotency-Key on every retry, so it acts once."""
        key = str(uuid.uuid4())
        headers = {"Idempotency-Key": key}
        return self._call(lambda: self.http.post(path, json=body, headers=headers))

    def _call(self, send: Callable[[], httpx.Response]) -> dict[str, Any]:
        for attempt in range(RETRIES):
            try:
                response = send()
                break
            except httpx.TransportError as exc:
                if attempt == RETRIES - 1:
                    raise CapyError(
                        f"the management API did not answer: {exc}; is the scheduler running? "
                        "(capyctl status)",
                        code="agent_unreachable",
                    ) from None
                time.sleep(0.5 * (attempt + 1))
        body: dict[str, Any] = response.json()
        if response.is_error:
            error = body.get("error", {})
            raise CapyError(error.get("message", response.text), code=error.get("code"))
        return body


def wait_for(
    api: Management,
    name: str,
    done: Callable[[dict[str, Any]], bool],
    timeout: float,
    what: str,
    since: float | None = None,
) -> dict[str, Any]:
    """Poll the deployment's status until `done`, a failed start (13), a placement no host
    can make, a refusal written since `since` (e.g. 4: it can never fit), or the timeout (4
    when memory was what it waited for, else 10)."""
    since = time.time() if since is None else since
    deadline = time.monotonic() + timeout
    status = api.get(f"/deployments/{name}")
    failures = status["attempts"]["count"]
    while True:
        if done(status):
            return status
        refusal = status.get("refusal")
        if refusal is not None and refusal["at"] >= since:
            raise CapyError(refusal["message"], code=refusal["code"])
        attempts = status["attempts"]
        if attempts["failed"] or attempts["count"] > failures:
            raise LaunchFailed(f"deployment {name!r} failed to start: {attempts['last_error']}")
        reason = (status.get("last_operation") or {}).get("reason", "")
        if reason.startswith("no host can run it") and status["state"] == "pending":
            errors = [b["error"] for b in status["bindings"] if "error" in b]
            if errors and len(errors) == len(status["bindings"]):
                raise CapyError(errors[0]["message"], code=errors[0]["code"])
        if time.monotonic() > deadline:
            if reason.startswith(("insufficient_resources", "device_unobserved")):
                code = reason.split(":", 1)[0]
                raise CapyError(f"deployment {name!r} is not {what}: {reason}", code=code)
            raise ActivationTimeout(
                f"deployment {name!r} is {status['state']}, not {what}, after "
                f"{timeout:.0f}s; last: {reason or 'nothing yet'} (capyctl status deployment "
                f"{name})"
            )
        time.sleep(0.25)
        status = api.get(f"/deployments/{name}")
