"""HTTP control of a running engine: readiness, the canary, park and wake, abort, load.

Each family subclasses `EngineControl`; every call has a named timeout, and httpx failures
become CapyCTL errors here, at the adapter boundary. Every control shares one TLS context:
an httpx client builds its own otherwise, loading the CA bundle (tens of milliseconds of CPU,
on the path of every wake and every load reading), for engines reached over plain HTTP.
"""

from __future__ import annotations

import functools
import re
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from capycommon.domain.engines import Residency
from capycommon.engines import decisions, template
from capycommon.engines.launch import Capabilities, LaunchSpec
from capycommon.errors import (
    CapabilityMissing,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
)

CANARY_PROMPT = "Reply with the single word: ready"


@dataclass(frozen=True)
class Timeouts:
    """Seconds per kind of call."""

    health: float = 5.0
    canary: float = 60.0
    park: float = 120.0
    wake: float = 300.0
    abort: float = 5.0
    metrics: float = 5.0


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metric(text: str, name: str) -> float:
    """The sum of a metric's samples (over labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match[1] == name:
            total += float(match[3])
    return total


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


class EngineControl:
    """Talks to one engine on loopback with its per-launch key."""

    def __init__(
        self,
        spec: LaunchSpec,
        capabilities: Capabilities,
        timeouts: Timeouts | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.spec = spec
        self.capabilities = capabilities
        self.timeouts = timeouts or Timeouts()
        self.base_url = f"http://127.0.0.1:{spec.port}"
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {spec.api_key}"},
            transport=transport,
            verify=_tls(),
            trust_env=False,  # loopback: no proxy, no .netrc
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        timeout: float,
        *,
        expect: tuple[int, ...] = (200,),
        **kwargs: Any,
    ) -> httpx.Response:
        try:
            response = await self._client.request(method, path, timeout=timeout, **kwargs)
        except httpx.TimeoutException:
            raise EngineTimeout(
                f"{self.spec.profile.family} on port {self.spec.port} did not answer "
                f"{method} {path} within {timeout:g} s"
            ) from None
        except httpx.TransportError as exc:
            raise EngineUnreachable(
                f"{self.spec.profile.family} on port {self.spec.port} is unreachable ({exc})"
            ) from None
        if response.status_code not in expect:
            raise EngineError(
                f"{self.spec.profile.family} answered {method} {path} with "
                f"{response.status_code}: {response.text[:200]}"
            )
        return response

    def ready_path(self) -> str:
        """Where the engine says it is ready (200), as its family defines it."""
        return "/health"

    async def ready(self) -> bool:
        """Whether the engine reports itself ready (health as the engine defines it)."""
        try:
            response = await self._client.get(self.ready_path(), timeout=self.timeouts.health)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def canary(self) -> str:
        """A one-token chat request; its answer proves the engine generates. A decision
        model's is one System One choice: the option it chose proves it decides."""
        if self.spec.api == "decisions":
            body = decisions.canary_body(self.spec.served_name)
            path = decisions.SYSTEMONE_PATH
            response = await self._call("POST", path, self.timeouts.canary, json=body)
            try:
                return decisions.canary_answer(response.json())
            except ValueError as exc:
                raise EngineError(str(exc)) from None
        body = {
            "model": self.spec.served_name,
            "messages": [{"role": "user", "content": CANARY_PROMPT}],
            "max_tokens": 1,
            "temperature": 0,
        }
        response = await self._call("POST", "/v1/chat/completions", self.timeouts.canary, json=body)
        message = response.json()["choices"][0]["message"]
        # A thinking model spends its first token on reasoning; that counts as an answer.
        reasoning = message.get(self.capabilities.reasoning_field)
        return str(message.get("content") or reasoning or "")

    async def confirm_api(self) -> None:
        """Once the engine is ready: EngineError where it says it cannot serve its api."""

    async def load(self) -> Load:
        """Running and waiting requests, from the engine's own metrics."""
        text = (await self._call("GET", "/metrics", self.timeouts.metrics)).text
        return Load(
            running=int(parse_metric(text, self.capabilities.metrics_running)),
            waiting=int(parse_metric(text, self.capabilities.metrics_waiting)),
        )

    async def park(self, residency: Residency) -> None:
        raise CapabilityMissing(
            f"{self.spec.profile.family} cannot park; deploy it restart_only",
            capability="deep_park",
        )

    async def wake(self, residency: Residency) -> None:
        raise CapabilityMissing(
            f"{self.spec.profile.family} cannot wake a parked model",
            capability="deep_park",
        )

    async def abort(self, request_id: str) -> None:
        raise CapabilityMissing(
            f"{self.spec.profile.family} has no abort by request id; close the connection",
            capability="abort_by_id",
        )

    def check_parks(self, residency: Residency) -> None:
        if residency not in self.capabilities.residencies or residency == Residency.RESTART_ONLY:
            raise CapabilityMissing(
                f"{self.spec.profile.family} cannot park {residency}",
                capability="deep_park",
            )


class UnmeteredControl(EngineControl):
    """An engine that can only start and stop, with no metrics CapyCTL knows (TensorFold, a
    custom engine): ready at its registration's path; its load is not read (the routers'
    places say when it is busy)."""

    def ready_path(self) -> str:
        given = self.spec.profile.ready_path or "/health"
        return template.ready_path(given, self.spec.served_name)

    async def load(self) -> Load:
        raise CapabilityMissing(
            f"{self.spec.profile.family} has no metrics CapyCTL reads; its load is the routers' "
            "places",
            capability="load_metrics",
        )
