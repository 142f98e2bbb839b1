"""The engines' side of LMCache's multi-process mode: where the server is (vLLM's
`--kv-transfer-config`, SGLang's `--enable-lmcache` and its YAML), the connection that
registers the engine's GPUs for the life of the process, and each request's use of the cache.

The connection speaks `enginesim.lmcache`'s line protocol. Before the engine reports ready it
registers and asks the chunk size, within `kv_connect_seconds` (the connector's mq_timeout),
or the engine exits with `ConnectionError: cannot reach the LMCache server at tcp://H:P`. It
stays open through sleep and wake. If the server goes away, requests run uncached and each
next one tries to connect and register again (as vLLM's connector does on heartbeat recovery).

Per request (chat and text completions): the prompt's text is cut into chunks of the server's
chunk size, a token being 4 characters (`openai_chat.CHARS_PER_TOKEN`); only full chunks
count. Keys chain: each is the SHA-256 of the key before and the chunk's text, from a root
drawn from PYTHONHASHSEED (random bytes per process when it is unset, as vLLM's NONE_HASH)
and, on vLLM only, the request's `cache_salt`. The engine looks the chunks up in order until
one misses; the hits are `usage.prompt_tokens_details.cached_tokens`. The misses are stored
once the request is scheduled and its prefill has passed, before its answer reaches the
client (its first part, when streamed).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import os
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from enginesim.engine import Work
from enginesim.openai_chat import CHARS_PER_TOKEN, ChatRequest, CompletionRequest, JsonDict
from enginesim.process import Process
from enginesim.serving import Frontend, Handler

log = logging.getLogger("enginesim.kvconnector")

LMCACHE_MP = "LMCacheMPConnector"
# Connectors vLLM knows that the simulator accepts and does nothing with.
OTHER_CONNECTORS = frozenset(
    {
        "LMCacheConnectorV1",
        "NixlConnector",
        "SharedStorageConnector",
        "OffloadingConnector",
        "P2pNcclConnector",
        "MooncakeConnector",
        "MultiConnector",
    }
)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5555

# The cache use of the request being handled, from its lookup to its hand-over to the engine.
_USE: ContextVar[CacheUse | None] = ContextVar("enginesim_kv_use", default=None)


class KvConfigError(Exception):
    """The engine's LMCache settings are wrong; the message says how."""


@dataclass(frozen=True)
class KvServer:
    """The LMCache server an engine connects to."""

    host: str
    port: int
    # vLLM folds the request's cache_salt into the keys. SGLang's LMCache path drops it: its
    # contract keeps the keys of external (L3) storage token-only, so salts share chunks.
    salted: bool

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass(frozen=True)
class VllmKvConfig:
    """What `--kv-transfer-config` asks of the simulated vLLM."""

    connector: str
    module_path: str | None
    server: KvServer | None  # None: a connector accepted and not simulated
    autostart: bool


def _address(value: object) -> str:
    """`tcp://127.0.0.1` or a bare `127.0.0.1` -> `127.0.0.1`."""
    text = str(value)
    scheme, separator, rest = text.partition("://")
    if not separator:
        return text
    if scheme != "tcp" or not rest:
        raise KvConfigError(f"the LMCache server address {text!r} is not tcp://HOST")
    return rest


def _port(value: object) -> int:
    try:
        port = int(str(value))
    except ValueError:
        raise KvConfigError(f"the LMCache server port {value!r} is not a number") from None
    if not 0 < port < 65536:
        raise KvConfigError(f"the LMCache server port {port} is out of range")
    return port


def _true(value: object) -> bool:
    return value is True or str(value).lower() in ("true", "1")


def vllm_kv_config(text: str) -> VllmKvConfig:
    """Read `--kv-transfer-config`; `KvConfigError` for what vLLM refuses at start."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KvConfigError(f"invalid JSON ({exc}): {text!r}") from None
    if not isinstance(data, dict):
        raise KvConfigError(f"expected a JSON object: {text!r}")
    connector, module = data.get("kv_connector"), data.get("kv_connector_module_path")
    if not isinstance(connector, str) or not connector:
        raise KvConfigError("kv_connector is missing")
    if connector != LMCACHE_MP and connector not in OTHER_CONNECTORS and module is None:
        raise KvConfigError(f"Unsupported connector type: {connector}")
    if data.get("kv_role") not in KV_ROLES:
        raise KvConfigError(
            f"Please specify kv_role when kv_connector is set, supported roles are {KV_ROLES}"
        )
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise KvConfigError("kv_connector_extra_config must be a JSON object")
    path = str(module) if module is not None else None
    if connector != LMCACHE_MP:
        return VllmKvConfig(connector, path, None, autostart=False)
    server = KvServer(
        _address(extra.get("lmcache.mp.host", f"tcp://{DEFAULT_HOST}")),
        _port(extra.get("lmcache.mp.port", DEFAULT_PORT)),
        salted=True,
    )
    return VllmKvConfig(connector, path, server, _true(extra.get("lmcache.mp.autostart")))


def sglang_kv_server(config_file: str | None, env: Mapping[str, str]) -> KvServer:
    """The server SGLang's LMCache connector names: `mp_host` and `mp_port` of the YAML file
    --lmcache-config-file names, else LMCACHE_CONFIG_FILE; LMCache's defaults without one."""
    path = config_file or env.get("LMCACHE_CONFIG_FILE")
    if not path:
        return KvServer(DEFAULT_HOST, DEFAULT_PORT, salted=False)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise KvConfigError(f"{type(exc).__name__}: {exc}") from None
    except yaml.YAMLError as exc:
        raise KvConfigError(f"yaml.YAMLError: {path}: {exc}") from None
    if not isinstance(data, dict | None):
        raise KvConfigError(f"ValueError: {path} does not hold a mapping")
    data = data or {}
    return KvServer(
        _address(data.get("mp_host", DEFAULT_HOST)),
        _port(data.get("mp_port", DEFAULT_PORT)),
        salted=False,
    )


def require_module(process: Process, module: str) -> None:
    """The connector imports `module` from the engine's environment: exit as Python does
    when it cannot."""
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:
        process.die(f"ModuleNotFoundError: {exc}")
    if found is None:
        process.die(f"ModuleNotFoundError: No module named '{module}'")


def hash_root(env: Mapping[str, str]) -> bytes:
    """The root every chunk key chains from: fixed by PYTHONHASHSEED, else new per process."""
    seed = env.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(f"PYTHONHASHSEED={seed}".encode()).digest()


def chunk_keys(root: bytes, text: str, chunk_size: int, salt: str | None) -> list[str]:
    """The keys of the full chunks of `text`, each chained from the one before."""
    width = chunk_size * CHARS_PER_TOKEN
    key = hashlib.sha256(root + salt.encode()).digest() if salt else root
    keys = []
    for start in range(0, len(text) - width + 1, width):
        key = hashlib.sha256(key + text[start : start + width].encode()).digest()
        keys.append(key.hex())
    return keys


@dataclass
class CacheUse:
    """One request's use of the cache: the tokens it found, the chunks it will store."""

    cached_tokens: int
    misses: list[str]
    stored: asyncio.Task[None] | None = field(default=None, repr=False)


class KvConnector:
    """One engine's connection to its LMCache server, one question at a time."""

    def __init__(
        self,
        server: KvServer,
        engine: str,
        gpu_ids: Sequence[int],
        root: bytes,
        timeout: float,
    ) -> None:
        self.server = server
        self.engine = engine
        self.gpu_ids = list(gpu_ids)
        self.root = root
        self.timeout = timeout
        self.chunk_size = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lost = False
        self._lock = asyncio.Lock()
        self._cached: weakref.WeakKeyDictionary[Work, int] = weakref.WeakKeyDictionary()

    # The connection --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect, register and learn the chunk size, trying again while the server refuses,
        until `timeout` has passed: `ConnectionError` then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._open()
                return
            except TimeoutError:
                break
            except OSError:
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(min(0.1, deadline - loop.time()))
        raise ConnectionError(f"cannot reach the LMCache server at {self.server.url}")

    async def _open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.server.host, self.server.port
        )
        try:
            await self._ask({"op": "register", "gpu_ids": self.gpu_ids, "engine": self.engine})
            size = (await self._ask({"op": "config"})).get("chunk_size")
            if not isinstance(size, int) or size <= 0:
                raise ConnectionError(f"the LMCache server at {self.server.url} gave no chunk size")
        except BaseException:
            self.close()
            raise
        self.chunk_size = size
        self._lost = False
        log.info(
            "Registered the KV caches with the LMCache server at %s: GPU ids %s, chunks of %d "
            "tokens",
            self.server.url,
            self.gpu_ids,
            size,
        )

    async def _ask(self, message: JsonDict) -> JsonDict:
        assert self._reader is not None
        assert self._writer is not None
        self._writer.write(json.dumps(message).encode() + b"\n")
        await self._writer.drain()
        line = await self._reader.readline()
        try:
            answer = json.loads(line) if line else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or "error" in answer:
            raise ConnectionError(f"the LMCache server answered {message['op']} with {line!r}")
        return answer

    async def _call(self, message: JsonDict) -> JsonDict | None:
        """The server's answer; None when it cannot be reached (the request goes uncached)."""
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout):
                    if self._writer is None:
                        await self._open()
                    return await self._ask(message)
            except (OSError, TimeoutError) as exc:
                if not self._lost:
                    log.warning(
                        "The LMCache server at %s is unreachable (%s); requests run uncached "
                        "until it is back",
                        self.server.url,
                        str(exc) or type(exc).__name__,
                    )
                self._lost = True
                self.close()
                return None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    # The cache -------------------------------------------------------------------------------

    async def lookup(self, text: str, salt: str | None) -> CacheUse:
        """The prompt's chunks found in order until one is missing, and those not found."""
        salt = salt if self.server.salted else None
        keys = chunk_keys(self.root, text, self.chunk_size, salt)
        hits = 0
        for key in keys:
            answer = await self._call({"op": "lookup", "key": key, "tokens": self.chunk_size})
            if answer is None or answer.get("hit") is not True:
                break
            hits += 1
        return CacheUse(hits * self.chunk_size, keys[hits:])

    async def store(self, keys: Sequence[str]) -> None:
        for key in keys:
            if await self._call({"op": "store", "key": key, "tokens": self.chunk_size}) is None:
                return

    # Each request ----------------------------------------------------------------------------

    async def serve(
        self,
        request: Request,
        model: type[ChatRequest] | type[CompletionRequest],
        handler: Handler,
    ) -> Response:
        """Answer `request` with `handler`, the prompt looked up first and its misses stored
        before the answer (its first part, when streamed) goes out."""
        try:
            body = model.model_validate_json(await request.body())
        except ValidationError:
            return await handler(request)  # refused there
        salt = (body.model_extra or {}).get("cache_salt")
        use = await self.lookup(body.prompt_text(), salt if isinstance(salt, str) else None)
        token = _USE.set(use)
        try:
            response = await handler(request)
        finally:
            _USE.reset(token)
        if use.stored is None:
            return response
        if isinstance(response, StreamingResponse):
            response.body_iterator = _after_store(use.stored, response.body_iterator)
        else:
            await asyncio.wait({use.stored})
        return response

    def started(
        self,
        work: Work,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        prefill_seconds: float,
    ) -> None:
        """The request being served was handed to the engine as `work`."""
        use = _USE.get()
        if use is None:
            return
        self._cached[work] = use.cached_tokens
        use.stored = spawn(self._store_after_prefill(work, use.misses, prefill_seconds))

    def prompt_details(self, work: Work) -> JsonDict:
        return {"cached_tokens": self._cached.get(work, 0)}

    async def _store_after_prefill(self, work: Work, misses: list[str], prefill: float) -> None:
        """Nothing is stored for a request aborted before its prefill ends."""
        if not misses:
            return
        await _any_of(work.scheduled, work.aborted)
        if work.aborted.is_set():
            return
        if prefill > 0:
            await _any_of(work.aborted, timeout=prefill)
            if work.aborted.is_set():
                return
        await self.store(misses)


async def _any_of(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Until one of `events` is set, or `timeout` has passed."""
    if any(event.is_set() for event in events):
        return
    waits = {asyncio.ensure_future(event.wait()) for event in events}
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _after_store(stored: asyncio.Task[None], body: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """`body`, held from its first part until the request's misses are stored."""
    parts = aiter(body)
    try:
        async for part in parts:
            if not stored.done():
                await asyncio.wait({stored})
            yield part
    finally:
        close = getattr(parts, "aclose", None)
        if close is not None:
            await close()


async def connect(
    process: Process, server: KvServer, engine: str, gpu_ids: Sequence[int], timeout: float
) -> KvConnector | None:
    """The engine's connection, registered before it reports ready; None when told to stop
    meanwhile. An engine that cannot reach its server exits non-zero."""
    connector = KvConnector(server, engine, gpu_ids, hash_root(os.environ), timeout)
    log.info("Registering the KV caches with the LMCache server at %s", server.url)
    connecting = asyncio.ensure_future(connector.connect())
    stopping = asyncio.ensure_future(process.stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        await asyncio.wait({connecting})
        return None
    try:
        connecting.result()
    except ConnectionError as exc:
        process.die(f"ConnectionError: {exc}")
    process.at_exit(connector.close)
    return connector


class CachingFrontend(Frontend):
    """A family's frontend whose engine may use an LMCache server (`kv`)."""

    kv: KvConnector | None = None

    async def chat(self, request: Request) -> Response:
        if self.kv is None or self.precheck(request) is not None:
            return await super().chat(request)
        return await self.kv.serve(request, ChatRequest, super().chat)

    async def completions(self, request: Request) -> Response:
        if self.kv is None or self.precheck(request) is not None:
            return await super().completions(request)
        return await self.kv.serve(request, CompletionRequest, super().completions)

    def submit(self, work: Work) -> None:
        super().submit(work)
        if self.kv is not None:
            self.kv.started(work, self.process.spawn, self.behaviour.prefill_seconds)
