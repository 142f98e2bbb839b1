"""llama-server's HTTP API: loading state, slots, props, metrics, idle sleep, chat.

Requests beyond the -np slots wait (`llamacpp:requests_deferred`). With
--sleep-idle-seconds N the server unloads after N idle seconds (`/props` is_sleeping) and the
next completion reloads it (the load time again); /health, /props, /slots and /metrics do not
wake it. A client hang-up cancels its slot (or not: keep_generating_on_disconnect).

Decisions (`/v1/systemone`, `enginesim.decisions`) need a model whose GGUF metadata has a
decision type; without one the route answers 501, and `/v1/models` lists the model's
`architecture.output_modalities` as `["text"]`. A `clef` model serves only decisions
(`["decisions"]`: chat and completions answer 501); for `clef`, `laya` and `lfm2-d1-omni`
the whole prompt must fit in one physical batch (the smaller of -ub and -b).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from enginesim import audio_api, decisions, messages_api, pooling_api, responses_api, tokenize_api
from enginesim.auth import BearerAuth
from enginesim.behaviour import Behaviour
from enginesim.engine import Engine, Work
from enginesim.gpu import (
    LocalHolder,
    NoDevice,
    NoHolder,
    SimDevice,
    Spread,
    find_devices,
    with_cuda,
)
from enginesim.memory import Regions, finish_loading, weight_bytes
from enginesim.metrics import Exposition
from enginesim.openai_chat import Dialect, GenerationRequest, JsonDict, ModelRequest, random_id
from enginesim.parallel import split_bytes
from enginesim.process import Process
from enginesim.serving import Frontend, add_generation, add_hot_paths

if TYPE_CHECKING:
    from enginesim.llamacpp import LlamaArgs

log = logging.getLogger("llama-server")
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/api/tags", "/"})
KV_PER_TOKEN = 128 << 10  # f16 K and V: 32 layers x 8 KV heads x 128 dims x 2 x 2 bytes
COMPUTE_PER_SLOT = 8 << 20
GENERATION_PREFIXES = ("/v1", "")  # chat and text completions, each at both
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def commit_of(build: int) -> str:
    return hashlib.sha256(f"llama.cpp b{build}".encode()).hexdigest()[:8]


def _not_supported(what: str, flag: str) -> Response:
    message = f"This server does not support {what}. Start it with `{flag}`"
    body = {"error": {"code": 501, "message": message, "type": "not_supported_error"}}
    return JSONResponse(body, status_code=501)


class LlamaFrontend(Frontend):
    def __init__(self, args: LlamaArgs, build: int, behaviour: Behaviour, process: Process) -> None:
        super().__init__(Engine(behaviour, args.parallel, self.fatal), behaviour, process)
        self.args = args
        self.build = build
        self.fingerprint = f"b{build}-{commit_of(build)}"
        self.ready = False
        self.sleeping = False
        self.model_size = 0
        self.regions: Regions | None = None
        self._waking: asyncio.Task[Any] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self.started = int(time.time())
        # Read from the file's metadata, before (and whether or not) it loads.
        self.decision_type = decisions.gguf_decision_type(Path(args.model))
        self.dialect = Dialect(
            reasoning_fields=("reasoning_content",),
            new_tool_call_id=lambda: random_id(32),
            usage_null_in_chunks=False,
            timings=True,
            system_fingerprint=self.fingerprint,
        )

    def say(self, line: str) -> None:
        log.info(line)

    # Frontend hooks ---------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> Response:
        return JSONResponse(
            {"error": {"code": status, "message": message, "type": kind}}, status_code=status
        )

    def check(self, body: GenerationRequest) -> Response | None:
        if self.decision_type in decisions.DECISION_ONLY_TYPES:
            return self.error(
                501,
                f"the loaded model (decision type {self.decision_type}) cannot generate "
                "text; it serves only /v1/systemone",
                "not_supported_error",
            )
        return None

    def model_name(self, body: ModelRequest) -> str:
        return body.model or self.args.alias or self.args.model

    def reasoning_on(self) -> bool:
        return self.args.reasoning_format != "none"

    def tools_on(self) -> bool:
        return self.args.jinja

    async def admit(self) -> Response | None:
        if self.sleeping and self._waking is None:
            self._waking = self.process.spawn(self._wake())
        return None

    # Decisions --------------------------------------------------------------------------

    def decisions_unsupported(self) -> Response | None:
        if self.decision_type is not None:
            return None
        return self.error(501, "This model is not a decision model", "not_supported_error")

    def decision_limits(self) -> decisions.Limits:
        most = decisions.OPTION_LIMITS.get(self.decision_type or "", decisions.MAX_OPTIONS)
        return decisions.Limits(max_options=most)

    def decision_refusal(self, body: decisions.DecisionRequest) -> Response | None:
        # The request's model is not checked (build 11549): any name is answered.
        if body.images or body.files:
            return self.error(
                501,
                "This server does not support image input for decisions. "
                "For a model that supports it, start it with `--mmproj`",
                "not_supported_error",
            )
        tokens, batch = decisions.prompt_tokens(body), self.physical_batch
        if self.decision_type in decisions.ONE_BATCH_TYPES and tokens > batch:
            return self.error(
                400,
                f"the question and its options ({tokens} tokens) are too large to process. "
                f"increase the batch size (current batch size: {batch})",
            )
        return None

    def decision_body(self, body: decisions.DecisionRequest, work: Work) -> JsonDict:
        """Named after its alias (else its path), whatever the request named; a noul answer
        carries no confidence."""
        found = decisions.response(body, self.args.alias or self.args.model, work.prompt_tokens)
        for answer in found["answers"].values():
            if answer["type"] == "noul":
                del answer["confidence"]
        return found

    @property
    def physical_batch(self) -> int:
        return min(self.args.ubatch_size, self.args.batch_size)

    # Load, sleep, wake, death -----------------------------------------------------------

    async def load(self) -> None:
        model = Path(self.args.model)
        self.say(f"srv    load_model: loading model '{model}'")
        if not model.is_file():
            self.process.die(
                f"gguf_init_from_file: failed to open GGUF file '{model}'\n"
                f"srv    load_model: failed to load model, '{model}'\n"
                "main: exiting due to model loading error"
            )
        self.model_size = weight_bytes(model)
        self.regions = self._plan_memory()
        self.regions.loading(self.regions.sizes["weights"])
        if not await finish_loading(self.process, self.behaviour, self.regions):
            return
        self.ready = True
        self.say("main: model loaded")
        self.say(
            f"main: server is listening on http://{self.args.host}:{self.args.port} - "
            "starting the main loop"
        )
        self.say("srv  update_slots: all slots are idle")
        self._arm_idle()
        self.arm_death()

    def _plan_memory(self) -> Regions:
        try:
            devices = find_devices(os.environ)
        except NoDevice:
            self.process.die(
                "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device "
                "is detected\nmain: exiting due to model loading error"
            )
        kv = self.args.ctx_size * KV_PER_TOKEN + self.args.parallel * COMPUTE_PER_SLOT
        sizes = {"weights": self.model_size, "kv_cache": kv}
        if devices is None:
            unclaimed = with_cuda(self.process, NoHolder())
            self.process.at_exit(unclaimed.close)
            return Regions.of(unclaimed, sizes, self.behaviour)
        placed = self._placement(devices)
        spread = Spread(tuple(d for _, d, _ in placed), tuple(p for _, _, p in placed))
        # Real memory on the devices the model lies on, by torch index; torch's current
        # device when that is the first alone, as before any split.
        indexes = [(index, part) for index, _, part in placed]
        claims = LocalHolder(spread.devices[0], self.behaviour.memory_lag_seconds, spread=spread)
        holder = with_cuda(self.process, claims, None if indexes == [(0, 1.0)] else indexes)
        self.process.at_exit(holder.close)
        if self.args.n_gpu_layers == "0":
            holder.set(0, self.model_size + kv)
            return Regions(NoHolder(), sizes, 0, self.behaviour.faults.sleep_keeps_memory)
        self._check_room(placed, self.model_size + kv)
        return Regions.of(holder, sizes, self.behaviour)

    def _placement(self, devices: list[SimDevice]) -> list[tuple[int, SimDevice, float]]:
        """The devices the model lies on, each with its index and proportion: the main GPU
        alone with --split-mode none, else every visible device with a proportion above 0."""
        if self.args.split_mode == "none":
            main = self.args.main_gpu
            if not 0 <= main < len(devices):
                self.process.die(
                    f"llama_model_load_from_file_impl: invalid value for main_gpu: {main} "
                    f"(available devices: {len(devices)})\n"
                    f"srv    load_model: failed to load model, '{self.args.model}'\n"
                    "main: exiting due to model loading error"
                )
            return [(main, devices[main], 1.0)]
        given = [*self.args.tensor_split[: len(devices)]]
        given += [0.0] * (len(devices) - len(given))
        parts = given if any(given) else [1.0] * len(devices)
        return [
            (i, d, part) for i, (d, part) in enumerate(zip(devices, parts, strict=True)) if part > 0
        ]

    def _check_room(self, placed: list[tuple[int, SimDevice, float]], need: int) -> None:
        """Each device's share must be free on it, or the load fails as llama.cpp's does."""
        shares = split_bytes(need, [part for _, _, part in placed])
        for (index, device, _), share in zip(placed, shares, strict=True):
            if device.free_bytes(exclude={os.getpid()}) >= share:
                continue
            self.process.die(
                f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {share / (1 << 20):.2f} "
                f"MiB on device {index}: cudaMalloc failed: out of memory\n"
                f"llama_model_load: error loading model: unable to allocate CUDA{index} buffer\n"
                f"srv    load_model: failed to load model, '{self.args.model}'\n"
                "main: exiting due to model loading error"
            )

    def _arm_idle(self) -> None:
        if self.args.sleep_idle_seconds <= 0:
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.args.sleep_idle_seconds, self._idle_check)
        self.engine.on_idle = self._arm_idle

    def _idle_check(self) -> None:
        if self.engine.busy or self.sleeping or self.regions is None:
            return
        self.say("srv  handle_sleep: entering sleeping state")
        self.sleeping = True
        self.engine.set_admitting(False)
        self.regions.release(list(self.regions.sizes))

    async def _wake(self) -> None:
        self.say("srv  handle_sleep: exiting sleeping state, reloading the model")
        await asyncio.sleep(self.behaviour.load_seconds)
        assert self.regions is not None
        self.regions.restore(list(self.regions.sizes))
        self.sleeping = False
        self._waking = None
        self.engine.woken()
        self.engine.set_admitting(True)

    def fatal(self, reason: str) -> None:
        self.process.die(f"GGML_ASSERT failed: {reason}\nAborted (core dumped)", 134)

    async def shutdown(self) -> None:
        self.say("srv    operator(): operator(): cleaning up before exit...")
        self.engine.abort_all()

    # Routes -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def props(self, request: Request) -> Response:
        n_ctx = self.args.ctx_size // self.args.parallel
        return JSONResponse(
            {
                "default_generation_settings": {"n_ctx": n_ctx, "params": {"n_predict": -1}},
                "total_slots": self.args.parallel,
                "model_path": self.args.model,
                "chat_template": "{{ messages }}",
                "modalities": {"vision": False, "audio": False},
                "build_info": self.fingerprint,
                "is_sleeping": self.sleeping,
            }
        )

    async def slots(self, request: Request) -> Response:
        if not self.args.slots:
            return _not_supported("slots endpoint", "--slots")
        running = list(self.engine.running.values())
        if request.query_params.get("fail_on_no_slot") == "1" and len(running) >= self.engine.slots:
            return self.error(503, "no slot available", "unavailable_error")
        n_ctx = self.args.ctx_size // self.args.parallel
        return JSONResponse(
            [
                {
                    "id": i,
                    "id_task": running[i].key if i < len(running) else -1,
                    "n_ctx": n_ctx,
                    "speculative": False,
                    "is_processing": i < len(running),
                    "params": {},
                    "next_token": {
                        "has_next_token": i < len(running),
                        "n_decoded": running[i].completion_tokens if i < len(running) else 0,
                    },
                }
                for i in range(self.engine.slots)
            ]
        )

    async def metrics(self, request: Request) -> Response:
        if not self.args.metrics:
            return _not_supported("metrics endpoint", "--metrics")
        stats, engine, out = self.engine.stats, self.engine, Exposition()
        counters = {
            "prompt_tokens_total": stats.prompt_tokens,
            "prompt_seconds_total": 0.0,
            "tokens_predicted_total": stats.generation_tokens,
            "tokens_predicted_seconds_total": stats.e2e.total,
            "n_decode_total": stats.generation_tokens,
        }
        for name, value in counters.items():
            out.counter(f"llamacpp:{name}", name.replace("_", " ") + ".", [({}, value)], "")
        gauges = {
            "prompt_tokens_seconds": 0.0,
            "predicted_tokens_seconds": self.behaviour.tokens_per_second,
            "requests_processing": len(engine.running),
            "requests_deferred": len(engine.waiting),
            "n_tokens_max": self.args.ctx_size,
            "n_busy_slots_per_decode": float(len(engine.running)),
        }
        for name, value in gauges.items():
            out.gauge(f"llamacpp:{name}", name.replace("_", " ") + ".", [({}, value)])
        return PlainTextResponse(out.text(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        meta = None
        if self.ready:
            meta = {
                "vocab_type": 2,
                "n_vocab": 151936,
                "n_ctx_train": 40960,
                "n_embd": 4096,
                "n_params": self.model_size * 2,
                "size": self.model_size,
            }
        card = {
            "id": self.args.alias or self.args.model,
            "object": "model",
            "created": self.started,
            "owned_by": "llamacpp",
            "meta": meta,
            "architecture": decisions.architecture(self.decision_type),
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def webui(self, request: Request) -> Response:
        if self.args.no_webui:
            return self.error(404, "File Not Found", "not_found_error")
        return HTMLResponse("<!doctype html><title>llama.cpp (simulated)</title>")


class LoadingGate:
    """While the model loads every path but /models answers 503 `Loading model`."""

    def __init__(self, app: ASGIApp, front: LlamaFrontend) -> None:
        self.app = app
        self.front = front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loading = scope["type"] == "http" and not self.front.ready
        if loading and scope["path"] not in ("/models", "/v1/models"):
            await JSONResponse(LOADING, status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(front: LlamaFrontend) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add = app.add_api_route
    for path in ("/health", "/v1/health"):
        add(path, front.health, methods=["GET"])
    add("/props", front.props, methods=["GET"])
    add("/slots", front.slots, methods=["GET"])
    add("/metrics", front.metrics, methods=["GET"])
    for path in ("/models", "/v1/models"):
        add(path, front.models, methods=["GET"])
    add_generation(app, front, GENERATION_PREFIXES)
    for api in (tokenize_api, pooling_api, audio_api, responses_api, messages_api):
        api.register_llamacpp(add, front)
    add("/v1/systemone", front.decide, methods=["POST"])
    add("/", front.webui, methods=["GET"])
    add_hot_paths(app, front, GENERATION_PREFIXES)
    if front.args.api_keys:
        body = {
            "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
        }
        app.add_middleware(
            BearerAuth,
            keys=front.args.api_keys,
            also_x_api_key=True,
            guarded=lambda path: path not in PUBLIC_PATHS,
            refusal=lambda: JSONResponse(body, status_code=401),
        )
    app.add_middleware(LoadingGate, front=front)
    return app
