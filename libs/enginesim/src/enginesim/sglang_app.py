"""SGLang's HTTP API: health by generation, info routes, memory release and resume, aborts.

The tokenizer manager's per-request state (`rid_to_state`) as SGLang keeps it: a request is
held from its arrival until the scheduler's output saying it finished comes back (one
scheduler step after an abort). `/abort_request` answers 200 with an empty body for any rid;
with one tokenizer worker an abort of a rid not held is dropped, and every other abort is
counted in `sglang:num_aborted_requests_total` (a hang-up's own abort, 2 s or 4 s late, too).
From 0.5.20 `/v1/loads` answers in its own shape (timestamp, version, `loads` per DP rank);
`/get_load` keeps the older list.

`/v1/systemone` answers System One decisions (`enginesim.decisions`) by the model folder's
head: a decision checkpoint (`decision_config.json`, at most 16 questions), a Clef joint
head, or label reading for a chat model (each answer adds `x_label_mass`). A decision
checkpoint is refused (400) on a server started with --chat-template, speculative decoding
or --allow-auto-truncate. A decision runs to its end whatever the client does, and no
`/abort_request` by rid reaches it (sgl-project/sglang#45842); bad input is a 422 `detail`.

Release and resume need --enable-memory-saver (without it they answer 200 and do nothing).
Releasing while requests run crashes the scheduler (the process exits non-zero) or answers
400, per the `release_while_busy` fault; resuming a tag that was not released is a 500
KeyError. While memory is released, new requests wait or fail (`generate_while_released`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from enginesim import (
    audio_api,
    decisions,
    messages_api,
    pooling_api,
    responses_api,
    sglang_metrics,
    tokenize_api,
)
from enginesim.auth import BearerAuth
from enginesim.behaviour import Behaviour, version_tuple
from enginesim.engine import Engine, Token, Work
from enginesim.kvconnector import CachingFrontend, KvConnector
from enginesim.memory import Regions
from enginesim.openai_chat import Dialect, GenerationRequest, JsonDict, ModelRequest
from enginesim.process import Process
from enginesim.serving import add_generation, add_hot_paths

if TYPE_CHECKING:
    from enginesim.sglang import SglangArgs

log = logging.getLogger("sglang.srt.entrypoints.http_server")
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
ADMIN_PATHS = (
    "/update_weights",
    "/init_weights_update_group",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/abort_request",
    "/flush_cache",
    "/set_internal_state",
    "/pause_generation",
    "/continue_generation",
    "/start_profile",
    "/stop_profile",
)
BUSY_RELEASE = (
    "AssertionError: release_memory_occupation should be called only when no ongoing request."
)


class SglangFrontend(CachingFrontend):
    decisions_run_to_end = True

    def __init__(
        self,
        args: SglangArgs,
        version: str,
        behaviour: Behaviour,
        process: Process,
        regions: Regions,
        kv: KvConnector | None = None,
    ) -> None:
        engine = Engine(behaviour, args.max_running_requests, self.fatal)
        super().__init__(engine, behaviour, process)
        self.kv = kv
        self.args = args
        self.version = version
        self.regions = regions
        self.status = "Starting"
        self.started = int(time.time())
        self.rid_to_state: dict[str, Work] = {}
        self.aborts_counted = 0
        self.checkpoint = decisions.hf_checkpoint(Path(args.model_path))
        self.dialect = Dialect(
            reasoning_fields=("reasoning_content",),
            new_tool_call_id=lambda: f"call_{uuid.uuid4().hex[:24]}",
            choice_extras={"matched_stop": None},
            prompt_details=kv.prompt_details if kv is not None else None,
        )

    # Frontend hooks ---------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str = "BadRequest") -> Response:
        body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        return JSONResponse(body, status_code=status)

    def precheck(self, request: Request) -> Response | None:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return self.error(400, "Unsupported Media Type: Only 'application/json' is allowed")
        return None

    def request_ids(
        self, request: Request, body: GenerationRequest, prefix: str
    ) -> tuple[str, str]:
        rid = body.rid or uuid.uuid4().hex
        return rid, rid

    def model_name(self, body: ModelRequest) -> str:
        return body.model or self.args.served_model_name

    def reasoning_on(self) -> bool:
        return self.args.reasoning_parser is not None

    def tools_on(self) -> bool:
        return self.args.tool_call_parser is not None

    def disconnect_lag(self, stream: bool) -> float:
        lag = self.behaviour.faults.disconnect_abort_lag
        return lag.stream if stream else lag.non_stream

    def submit(self, work: Work) -> None:
        self.rid_to_state[work.rid] = work
        super().submit(work)
        self.process.spawn(self._forget(work))

    async def _forget(self, work: Work) -> None:
        """The request leaves the per-request state when its last output comes back."""
        await work.done.wait()
        await asyncio.sleep(min(0.5, 1.0 / self.behaviour.tokens_per_second))
        if self.rid_to_state.get(work.rid) is work:
            del self.rid_to_state[work.rid]

    def abort_gone(self, work: Work) -> None:
        self.abort_rid(work.rid)

    def abort_rid(self, rid: str) -> None:
        """`TokenizerManager.abort_request(rid)`: dropped for a rid not held (one worker)."""
        if self.args.tokenizer_worker_num == 1 and rid not in self.rid_to_state:
            return
        self.aborts_counted += 1
        self.engine.abort_rid(rid)

    async def admit(self) -> Response | None:
        released = self.regions.off_device()
        if released and self.behaviour.faults.generate_while_released == "error":
            return self.error(
                500, f"memory is released ({', '.join(released)})", "InternalServerError"
            )
        return None

    # Decisions --------------------------------------------------------------------------

    def decision_limits(self) -> decisions.Limits:
        if self.checkpoint == "decision_config":
            return decisions.Limits(max_questions=decisions.MAX_CHECKPOINT_QUESTIONS)
        return decisions.Limits()

    def decision_invalid(self, problems: list[decisions.Problem]) -> Response:
        """FastAPI's 422: each problem's place in the body, its message and kind."""
        detail = [{"loc": ["body", *p.loc], "msg": p.msg, "type": p.type} for p in problems]
        return JSONResponse({"detail": detail}, status_code=422)

    def decision_refusal(self, body: decisions.DecisionRequest) -> Response | None:
        if body.model is None:
            return self.decision_invalid(
                [decisions.Problem(("model",), "Field required", "missing")]
            )
        names = {self.args.served_model_name, *decisions.JEV_ALIASES}
        if body.model not in names:
            return self.error(404, f"The model '{body.model}' does not exist", "NotFoundError")
        if body.images:
            return self.error(400, "/v1/systemone images require a model served with images")
        if self.checkpoint == "chat":
            return None
        refused = {
            "--chat-template": self.args.chat_template is not None,
            "--speculative-algorithm": self.args.speculative_algorithm is not None,
            "--allow-auto-truncate": self.args.allow_auto_truncate,
        }
        for flag, given in refused.items():
            if given:
                return self.error(
                    400, f"/v1/systemone cannot serve this decision checkpoint with {flag}"
                )
        return None

    def decision_body(self, body: decisions.DecisionRequest, work: Work) -> JsonDict:
        answer = decisions.response(body, body.model or "", work.prompt_tokens)
        answer["usage"]["decision_count"] = len(body.questions)
        if self.checkpoint == "chat":  # read from the labels' probabilities
            state = decisions.state_text(body.state)
            for qid, found in answer["answers"].items():
                found["x_label_mass"] = decisions.label_mass(state, qid)
        return answer

    # Life -------------------------------------------------------------------------------

    async def warm_up(self) -> None:
        if not self.args.skip_server_warmup:
            await asyncio.sleep(self.behaviour.warmup_seconds)
        if self.status == "Starting":
            self.status = "Up"
            log.info("The server is fired up and ready to roll!")

    def fatal(self, reason: str) -> None:
        self.process.die(
            f"Scheduler hit an exception: {reason}\nReceived sigquit from a child "
            "process. It usually means the child failed."
        )

    async def shutdown(self) -> None:
        self.status = "Shutdown"
        self.engine.abort_all()

    # Health and info --------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.status in ("Starting", "Shutdown"):
            return Response(status_code=503)
        cheap = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
        if request.url.path == "/health" and cheap in ("0", "false"):
            return Response(status_code=200)
        healthy = await self._generate_one()
        if not healthy:
            self.status = "UnHealthy"
        elif self.status == "UnHealthy":
            self.status = "Up"
        return Response(status_code=200 if healthy else 503)

    async def _generate_one(self) -> bool:
        if self.regions.off_device() and self.behaviour.faults.generate_while_released == "error":
            return False
        work = Work(f"HEALTH_CHECK_{time.time()}", 1, [Token("content", "ok")], "length")
        self.engine.submit(work)
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        try:
            await asyncio.wait_for(work.done.wait(), timeout)
        except TimeoutError:
            self.engine.abort(work)
            return False
        return work.finish == "length"

    async def ping(self, request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        if request.url.path.startswith("/get_"):
            log.warning("Endpoint %s is deprecated; use /model_info", request.url.path)
        return JSONResponse(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def server_info(self, request: Request) -> Response:
        if request.url.path.startswith("/get_"):
            log.warning("Endpoint %s is deprecated; use /server_info", request.url.path)
        state = {
            "last_gen_throughput": 0.0,
            "memory_usage": {
                name: round(size / (1 << 30), 2) for name, size in self.regions.sizes.items()
            },
        }
        return JSONResponse(
            {**asdict(self.args), "version": self.version, "internal_states": [state]}
        )

    async def load(self, request: Request) -> Response:
        if request.url.path == "/v1/loads" and version_tuple(self.version) >= (0, 5, 20):
            return JSONResponse(sglang_metrics.loads(self.engine, self.args, self.version))
        load = {
            "dp_rank": 0,
            "num_reqs": len(self.engine.running),
            "num_waiting_reqs": len(self.engine.waiting),
            "num_tokens": 0,
        }
        return JSONResponse([load])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        wanted = request.path_params["model_id"]
        if wanted != self.args.served_model_name:
            inner = {
                "message": f"The model '{wanted}' does not exist",
                "param": "model",
                "type": "invalid_request_error",
                "code": "model_not_found",
            }
            return JSONResponse({"error": inner}, status_code=404)
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        name = self.args.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "sglang",
            "root": name,
            "max_model_len": self.args.context_length,
        }

    async def metrics(self, request: Request) -> Response:
        text = sglang_metrics.exposition(self.engine, self.args, self.aborts_counted)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # Control ----------------------------------------------------------------------------

    async def flush_cache(self, request: Request) -> Response:
        if self.engine.busy:
            text = (
                "Cache not flushed. Please check backend logs for more details. (When "
                "there are running or waiting requests, the operation will not be performed.)\n"
            )
            return PlainTextResponse(text, status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation "
            "will not be performed.)\n"
        )

    async def abort_request(self, request: Request) -> Response:
        data = await _json(request)
        if data.get("abort_all"):
            self.aborts_counted += 1
            self.engine.abort_all()
        elif data.get("rid"):
            self.abort_rid(str(data["rid"]))
        return Response(status_code=200)

    async def release(self, request: Request) -> Response:
        tags = await _tags(request)
        if not self.args.enable_memory_saver:
            return JSONResponse(None)
        if self.engine.busy:
            if self.behaviour.faults.release_while_busy == "crash":
                self.fatal(BUSY_RELEASE)
            return JSONResponse({"error": {"message": BUSY_RELEASE}}, status_code=400)
        await asyncio.sleep(self.behaviour.sleep_seconds)
        backup = ["weights"] if self.args.enable_weights_cpu_backup else []
        self.regions.release(tags, to_host=backup)
        self.engine.set_admitting(False)
        return JSONResponse(None)

    async def resume(self, request: Request) -> Response:
        tags = await _tags(request)
        if not self.args.enable_memory_saver:
            return JSONResponse(None)
        awake = [tag for tag in tags if self.regions.place.get(tag) == "gpu"]
        if awake:
            return JSONResponse({"error": {"message": f"KeyError: '{awake[0]}'"}}, status_code=500)
        await asyncio.sleep(self.behaviour.wake_seconds)
        if "weights" in tags and self.regions.is_gone("weights"):
            self.engine.weights_stale = True  # until /update_weights_from_disk
        self.regions.restore(tags)
        if not self.regions.off_device():
            self.engine.woken()
            self.engine.set_admitting(True)
        return JSONResponse(None)

    async def update_weights(self, request: Request) -> Response:
        await asyncio.sleep(self.behaviour.wake_seconds)
        self.engine.weights_stale = False
        return JSONResponse(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def pause_generation(self, request: Request) -> Response:
        mode = (await _json(request)).get("mode", "abort")
        self.engine.set_admitting(False)
        if mode == "abort":
            self.engine.abort_all()
        self.engine.set_producing(False)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        if not self.regions.off_device():
            self.engine.set_admitting(True)
        self.engine.set_producing(True)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def _json(request: Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.body() or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


async def _tags(request: Request) -> list[str]:
    tags = (await _json(request)).get("tags")
    return [str(tag) for tag in tags] if tags else list(ALL_TAGS)


def build_app(front: SglangFrontend) -> FastAPI:
    app = FastAPI(title="SGLang (simulated)")
    add = app.add_api_route
    for path in ("/health", "/health_generate"):
        add(path, front.health, methods=["GET"])
    add("/ping", front.ping, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        add(path, front.model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        add(path, front.server_info, methods=["GET"])
    for path in ("/get_load", "/v1/loads"):
        add(path, front.load, methods=["GET"])
    add("/flush_cache", front.flush_cache, methods=["GET", "POST"])
    add("/abort_request", front.abort_request, methods=["POST"])
    add("/release_memory_occupation", front.release, methods=["GET", "POST"])
    add("/resume_memory_occupation", front.resume, methods=["GET", "POST"])
    add("/update_weights_from_disk", front.update_weights, methods=["POST"])
    add("/pause_generation", front.pause_generation, methods=["POST"])
    add("/continue_generation", front.continue_generation, methods=["POST"])
    add_generation(app, front)
    add("/v1/models", front.models, methods=["GET"])
    add("/v1/models/{model_id:path}", front.model, methods=["GET"])
    add("/v1/systemone", front.decide, methods=["POST"])
    for api in (tokenize_api, pooling_api, audio_api, responses_api, messages_api):
        api.register_sglang(add, front)
    if front.args.enable_metrics:
        add("/metrics", front.metrics, methods=["GET"])
    add_hot_paths(app, front)
    _add_auth(app, front.args)
    return app


def _add_auth(app: FastAPI, args: SglangArgs) -> None:
    def refusal() -> Response:
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    def public(path: str) -> bool:
        return path.startswith(("/health", "/metrics"))

    def admin(path: str) -> bool:
        return path.startswith(ADMIN_PATHS)

    if args.admin_api_key:
        app.add_middleware(BearerAuth, keys=[args.admin_api_key], guarded=admin, refusal=refusal)
    if args.api_key:
        skip = admin if args.admin_api_key else (lambda path: False)
        app.add_middleware(
            BearerAuth,
            keys=[args.api_key],
            refusal=refusal,
            guarded=lambda path: not public(path) and not skip(path),
        )
