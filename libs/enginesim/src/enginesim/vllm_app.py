"""vLLM's HTTP API: health, models, chat, metrics, and the dev-mode sleep controls.

Version switches: the error envelope is flat up to 0.10.0 and nested from 0.10.1; the
reasoning field is `reasoning_content` up to 0.11.0, both names up to 0.15, `reasoning` from
0.16; `vllm:engine_sleep_state` from 0.11.1; `vllm:gpu_cache_usage_perc` below 0.12; /sleep
takes `mode` (abort by default) and requests while asleep are held from 0.17 on (older:
sleeping with requests in flight, or a request while asleep, kills the engine).

From 0.32.0 `/v1/systemone` answers System One decisions (`enginesim.decisions`) by reading
the text output (the label tokens' logprobs): it needs --logprobs-mode raw_logprobs (the
default) or processed_logprobs, else 501; each answer's `diagnostics` say how much of the
next token's probability the labels held.

Refusals as vLLM words them: a prompt at the context length, or `max_tokens` beyond what is
left of it, is a 400 before anything streams; logprobs above `--max-logprobs` (20) are found
only when the engine takes the request, so a stream has answered 200 and gets the error as
its first event, then `[DONE]` (a request that is not streamed gets the 400).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from enginesim import (
    audio_api,
    decisions,
    messages_api,
    pooling_api,
    responses_api,
    tokenize_api,
    vllm_metrics,
)
from enginesim.auth import BearerAuth
from enginesim.behaviour import Behaviour, version_tuple
from enginesim.engine import Engine, Work
from enginesim.kvconnector import CachingFrontend, KvConnector
from enginesim.memory import Regions
from enginesim.openai_chat import (
    ChatRequest,
    Dialect,
    GenerationRequest,
    JsonDict,
    ModelRequest,
    count_prompt_tokens,
)
from enginesim.process import Process
from enginesim.serving import add_generation, add_hot_paths

if TYPE_CHECKING:
    from enginesim.vllm import VllmArgs

log = logging.getLogger("vllm.entrypoints.openai.api_server")
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
HOLD_MODES = ("abort", "wait", "keep")
MAX_LOGPROBS = 20  # --max-logprobs
DECISIONS_FROM = (0, 32)
READ_MODES = ("raw_logprobs", "processed_logprobs")  # what a decision's read needs


def reasoning_fields(version: tuple[int, ...]) -> tuple[str, ...]:
    if version <= (0, 11, 0):
        return ("reasoning_content",)
    if version < (0, 16):
        return ("reasoning", "reasoning_content")
    return ("reasoning",)


class VllmFrontend(CachingFrontend):
    def __init__(
        self,
        args: VllmArgs,
        version: str,
        behaviour: Behaviour,
        process: Process,
        regions: Regions,
        dev_mode: bool,
        kv: KvConnector | None = None,
    ) -> None:
        super().__init__(Engine(behaviour, args.max_num_seqs, self.fatal), behaviour, process)
        self.kv = kv
        self.args = args
        self.version = version
        self.v = version_tuple(version)
        self.regions = regions
        self.dev_mode = dev_mode
        self.dead = False
        self.paused = False
        self.sleep_level: int | None = None
        self.started = int(time.time())
        self.force_usage = args.enable_force_include_usage
        self.dialect = Dialect(
            reasoning_fields=reasoning_fields(self.v),
            new_tool_call_id=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}",
            choice_extras={"stop_reason": None},
            tool_calls_always_listed=True,
            prompt_details=kv.prompt_details if kv is not None else None,
        )

    # Frontend hooks ---------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str = "BadRequestError") -> Response:
        inner = {"message": message, "type": kind, "param": None, "code": status}
        if self.v <= (0, 10, 0):
            return JSONResponse({"object": "error", **inner}, status_code=status)
        return JSONResponse({"error": inner}, status_code=status)

    def streamed_error(self, message: str) -> Response:
        """An error found once the stream has begun: 200, the error event, `[DONE]`."""
        inner = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        if self.v <= (0, 10, 0):
            inner = {"object": "error", **inner}
        events = [f"data: {json.dumps({'error': inner})}\n\n", "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def unserved(self, model: str | None) -> Response | None:
        """The 404 for a model it does not serve (a request that names none asks for its own)."""
        if model is None or model in self.args.served_names:
            return None
        return self.error(404, f"The model `{model}` does not exist.", "NotFoundError")

    def check(self, body: GenerationRequest) -> Response | None:
        refusal = self.unserved(body.model)
        if refusal is not None:
            return refusal
        auto = isinstance(body, ChatRequest) and body.tools and body.tool_choice in (None, "auto")
        if auto and not (self.args.enable_auto_tool_choice and self.args.tool_call_parser):
            return self.error(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
            )
        return self._context(body) or self._logprobs(body)

    def _context(self, body: GenerationRequest) -> Response | None:
        prompt, most = count_prompt_tokens(body.prompt_text()), self.args.max_model_len
        if prompt >= most:
            return self.error(
                400,
                f"This model's maximum context length is {most} tokens. "
                f"However, your request has {prompt} input tokens. Please reduce "
                "the length of the input messages.",
            )
        wanted = body.limit if isinstance(body, ChatRequest) else body.max_tokens
        if wanted is not None and prompt + wanted > most:
            return self.error(
                400,
                "'max_tokens' or 'max_completion_tokens' is too large: "
                f"{wanted}. This model's maximum context length is {most} tokens "
                f"and your request has {prompt} input tokens ({wanted} > {most} "
                f"- {prompt}).",
            )
        return None

    def _logprobs(self, body: GenerationRequest) -> Response | None:
        extra = body.model_extra or {}
        wanted = (
            extra.get("top_logprobs") if isinstance(body, ChatRequest) else extra.get("logprobs")
        )
        if not isinstance(wanted, int) or wanted <= MAX_LOGPROBS:
            return None
        message = (
            f"Requested sample logprobs of {wanted}, which is greater than max "
            f"allowed: {MAX_LOGPROBS}"
        )
        return self.streamed_error(message) if body.stream else self.error(400, message)

    def request_ids(
        self, request: Request, body: GenerationRequest, prefix: str
    ) -> tuple[str, str]:
        base = request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex
        return f"{prefix}{base}", f"{prefix}{base}"

    def response_headers(self, request: Request) -> dict[str, str]:
        if not self.args.enable_request_id_headers:
            return {}
        return {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}

    def model_name(self, body: ModelRequest) -> str:
        return self.args.served_names[0]

    def reasoning_on(self) -> bool:
        return self.args.reasoning_parser is not None

    async def admit(self) -> Response | None:
        if not self.dead and self.asleep and self._asleep_policy() == "crash":
            self.fatal("CUDA error: an illegal memory access was encountered")
        if self.dead:
            return self.error(
                500,
                "EngineCore encountered an issue. See stack trace for the root cause.",
                "InternalServerError",
            )
        return None

    # Decisions --------------------------------------------------------------------------

    def decisions_unsupported(self) -> Response | None:
        if self.args.logprobs_mode in READ_MODES:
            return None
        return self.error(
            501,
            "Structured decisions need --logprobs-mode raw_logprobs or processed_logprobs, "
            f"not {self.args.logprobs_mode}",
            "NotImplementedError",
        )

    def decision_refusal(self, body: decisions.DecisionRequest) -> Response | None:
        return self.unserved(body.model)

    def decision_body(self, body: decisions.DecisionRequest, work: Work) -> JsonDict:
        state = decisions.state_text(body.state)
        read = {"argmax_is_label": True}
        return {
            "id": f"decision-{uuid.uuid4().hex}",
            "object": "structured_decision",
            **decisions.response(body, body.model or self.args.served_names[0], work.prompt_tokens),
            "diagnostics": {
                qid: {"label_mass": decisions.label_mass(state, qid), **read}
                for qid in body.questions
            },
        }

    # Life and death ---------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return bool(self.regions.off_device())

    def _asleep_policy(self) -> str:
        chosen = self.behaviour.faults.request_while_asleep
        return chosen or ("hold" if self.v >= (0, 17) else "crash")

    def fatal(self, reason: str) -> None:
        """The EngineCore died: /health answers 503, then the API server exits non-zero."""
        if self.dead:
            return
        self.dead = True
        log.error("EngineCore encountered a fatal error. %s", reason)
        self.engine.fail_all("EngineCore encountered an issue. See stack trace for the root cause.")
        self.regions.holder.close()
        self.process.later(
            0.5, lambda: self.process.die("vllm.v1.engine.exceptions.EngineDeadError: " + reason)
        )

    async def shutdown(self) -> None:
        log.info("Shutting down FastAPI HTTP server.")
        if self.args.shutdown_timeout > 0:
            await self.engine.drain(self.args.shutdown_timeout)
        self.engine.abort_all()

    def paths(self, app: FastAPI) -> list[str]:
        return [route.path for route in app.routes if isinstance(route, Route)]

    # Always-on routes -------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.dead else 200)

    async def version_route(self, request: Request) -> Response:
        return JSONResponse({"version": self.version})

    async def load(self, request: Request) -> Response:
        load = len(self.engine.all_work()) if self.args.enable_server_load_tracking else 0
        return JSONResponse({"server_load": load})

    async def models(self, request: Request) -> Response:
        cards = [self._card(name) for name in self.args.served_names]
        return JSONResponse({"object": "list", "data": cards})

    def _card(self, name: str) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": self.started,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": self.args.model,
            "parent": None,
            "max_model_len": self.args.max_model_len,
            "permission": [permission],
        }

    async def metrics(self, request: Request) -> Response:
        text = vllm_metrics.exposition(self.engine, self.args, self.v, self.sleep_level)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # Dev-mode routes (VLLM_SERVER_DEV_MODE=1) ---------------------------------------------

    def _no_sleep_mode(self) -> Response | None:
        if self.args.enable_sleep_mode:
            return None
        return self.error(
            500, "Sleep mode is not enabled in the model config", "InternalServerError"
        )

    async def _hold_all(self, mode: str) -> None:
        self.engine.set_admitting(False)
        if mode == "abort":
            self.engine.abort_all()
        elif mode == "wait":
            await self.engine.drain()
        self.engine.set_producing(False)

    def _maybe_resume(self) -> None:
        if self.asleep or self.paused:
            return
        if self.sleep_level is not None:
            self.engine.woken()
            self.sleep_level = None
        self.engine.set_admitting(True)
        self.engine.set_producing(True)

    async def sleep(self, request: Request) -> Response:
        refusal = self._no_sleep_mode()
        if refusal is not None:
            return refusal
        query = request.query_params
        level = int(query.get("level", "1"))
        mode = query.get("mode", "abort")
        if mode not in HOLD_MODES or level not in (0, 1, 2):
            return self.error(400, f"invalid sleep level {level} or mode {mode!r}")
        if self.v < (0, 17) and self.engine.running:
            self.fatal("CUDA error: an illegal memory access was encountered")
            return self.error(500, "EngineCore died while going to sleep", "InternalServerError")
        await self._hold_all(mode if self.v >= (0, 17) else "keep")
        if level == 0:
            self.paused = True
            return Response(status_code=200)
        await asyncio.sleep(self.behaviour.sleep_seconds)
        names = query.getlist("tags") or list(self.regions.sizes)
        self.regions.release(names, to_host=["weights"] if level == 1 else [])
        self.sleep_level = level
        log.info("It took %.6f seconds to fall asleep.", self.behaviour.sleep_seconds)
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        refusal = self._no_sleep_mode()
        if refusal is not None:
            return refusal
        tags = request.query_params.getlist("tags") or list(self.regions.sizes)
        await asyncio.sleep(self.behaviour.wake_seconds)
        if "weights" in tags and self.regions.is_gone("weights"):
            self.engine.weights_stale = True  # discarded weights must be reloaded
        self.regions.restore(tags)
        self._maybe_resume()
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": self.asleep or self.paused})

    async def collective_rpc(self, request: Request) -> Response:
        try:
            data = await request.json()
        except ValueError:
            data = None
        method = data.get("method") if isinstance(data, dict) else None
        if not method:
            return self.error(400, "Missing 'method' in request body")
        if method == "reload_weights":
            await asyncio.sleep(self.behaviour.wake_seconds)
            self.engine.weights_stale = False
            return JSONResponse({"results": [None] * self.args.tensor_parallel_size})
        return self.error(
            500,
            f"AttributeError: 'Worker' object has no attribute '{method}'",
            "InternalServerError",
        )

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in HOLD_MODES:
            return self.error(400, f"invalid mode {mode!r}")
        await self._hold_all(mode)
        self.paused = True
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.paused = False
        self._maybe_resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.paused})

    async def empty(self, request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        return JSONResponse({"vllm_config": repr(self.args), "version": self.version})


def build_app(front: VllmFrontend) -> FastAPI:
    app = FastAPI(title="vLLM API server (simulated)")
    add = app.add_api_route
    add("/health", front.health, methods=["GET"])
    add("/ping", front.health, methods=["GET", "POST"])
    add("/version", front.version_route, methods=["GET"])
    add("/load", front.load, methods=["GET"])
    add("/metrics", front.metrics, methods=["GET"])
    add("/v1/models", front.models, methods=["GET"])
    add_generation(app, front)
    add("/v1/embeddings", front.embeddings, methods=["POST"])
    for api in (tokenize_api, pooling_api, audio_api, responses_api, messages_api):
        api.register_vllm(add, front)
    if front.v >= DECISIONS_FROM:
        add("/v1/systemone", front.decide, methods=["POST"])
    if front.dev_mode:
        add("/sleep", front.sleep, methods=["POST"])
        add("/wake_up", front.wake_up, methods=["POST"])
        add("/is_sleeping", front.is_sleeping, methods=["GET"])
        add("/collective_rpc", front.collective_rpc, methods=["POST"])
        for path in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
            add(path, front.empty, methods=["POST"])
        add("/pause", front.pause, methods=["POST"])
        add("/resume", front.resume, methods=["POST"])
        add("/is_paused", front.is_paused, methods=["GET"])
        add("/server_info", front.server_info, methods=["GET"])
    add_hot_paths(app, front)
    if front.args.api_keys:
        app.add_middleware(
            BearerAuth,
            keys=front.args.api_keys,
            guarded=lambda path: path.startswith(GUARDED_PREFIXES),
            refusal=lambda: JSONResponse({"error": "Unauthorized"}, status_code=401),
        )
    for dotted in front.args.middleware:
        _apply_middleware(app, dotted)
    return app


def _apply_middleware(app: FastAPI, dotted: str) -> None:
    """As vLLM does: a class is ASGI middleware, a coroutine function an http middleware."""
    module_path, name = dotted.rsplit(".", 1)
    imported: Any = getattr(importlib.import_module(module_path), name)
    if inspect.isclass(imported):
        factory: Any = imported
        app.add_middleware(factory)
    elif inspect.iscoroutinefunction(imported):
        app.middleware("http")(imported)
    else:
        raise ValueError(f"Invalid middleware {dotted}. Must be a function or a class.")
