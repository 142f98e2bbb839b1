"""TensorFold's HTTP API and its GPU memory, as CapyCTL assumes them (see `enginesim.tensorfold`:
this imitates assumptions, not a verified engine).

Routes: `GET /health` (503 `{"status": "loading"}` until the model is loaded and warmed up,
then 200 `{"status": "ok"}`), `GET /v1/models`, `POST /v1/chat/completions` and
`POST /v1/completions` (OpenAI's wire format, streamed or not). There is no `/metrics`. At most
`--parallel` requests generate at once, the rest wait; a client that hangs up cancels its
request at once. With `TENSORFOLD_API_KEY` every route but `GET /health` needs the key.

Memory with a simulated GPU: the weights are the `*.safetensors` files of the model folder
(their sizes), the KV cache `--context-length` x `--parallel` x 64 KiB. With
`TENSORFOLD_CUDA_MEMORY_LIMIT_GB` it claims min(limit, weights + KV) on the device (a limit
below the weights is CUDA out of memory, exit 1); without it, 90% of the device's free
memory, as an engine that grabs the card. Nothing is claimed in host RAM; the claim goes
when the process exits.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from enginesim.auth import BearerAuth
from enginesim.behaviour import Behaviour
from enginesim.engine import Engine
from enginesim.gpu import GIB, LocalHolder, NoDevice, NoHolder, find_device, with_cuda
from enginesim.memory import Regions, finish_loading
from enginesim.openai_chat import Dialect, GenerationRequest, ModelRequest
from enginesim.process import Process
from enginesim.serving import Frontend, add_hot_paths

if TYPE_CHECKING:
    from enginesim.tensorfold import TensorFoldArgs

log = logging.getLogger("tensorfold")
KV_PER_TOKEN_SLOT = 64 << 10  # KV bytes per token of context, per parallel slot
GRAB_SHARE = (9, 10)  # without a limit: 9/10 of the device's free memory
LIMIT_ENV = "TENSORFOLD_CUDA_MEMORY_LIMIT_GB"
UNAUTHORIZED = {
    "error": {"message": "invalid api key", "type": "authentication_error", "code": 401}
}


def safetensors_bytes(model: Path) -> int:
    """The sizes of the folder's `*.safetensors` files (st_size: sparse files stand in)."""
    return sum(f.stat().st_size for f in model.glob("*.safetensors") if f.is_file())


class TensorFoldFrontend(Frontend):
    def __init__(self, args: TensorFoldArgs, behaviour: Behaviour, process: Process) -> None:
        super().__init__(Engine(behaviour, args.parallel, self.fatal), behaviour, process)
        self.args = args
        self.ready = False
        self.regions: Regions | None = None
        self.started = int(time.time())
        self.dialect = Dialect(
            reasoning_fields=("reasoning_content",),
            new_tool_call_id=lambda: f"call_{uuid.uuid4().hex[:24]}",
        )

    # Frontend hooks ---------------------------------------------------------------------

    def error(self, status: int, message: str, kind: str = "invalid_request_error") -> Response:
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return JSONResponse(body, status_code=status)

    def check(self, body: GenerationRequest) -> Response | None:
        if body.model is not None and body.model != self.args.served_model_name:
            return self.error(404, f"The model `{body.model}` does not exist.", "NotFoundError")
        return None

    async def admit(self) -> Response | None:
        if not self.ready:
            return self.error(503, "the model is loading", "unavailable_error")
        return None

    def model_name(self, body: ModelRequest) -> str:
        return self.args.served_model_name

    def fatal(self, reason: str) -> None:
        self.process.die(f"tensorfold: fatal: {reason}", 1)

    async def shutdown(self) -> None:
        log.info("tensorfold: shutting down")
        self.engine.abort_all()

    # Loading ----------------------------------------------------------------------------

    async def load(self) -> None:
        model = Path(self.args.model)
        log.info(f"tensorfold: loading {model}")
        if not model.is_dir():
            self.process.die(f"tensorfold: error: the model folder {model} does not exist")
        weights = safetensors_bytes(model)
        if weights == 0:
            self.process.die(f"tensorfold: error: no *.safetensors weights in {model}")
        limit = self.args.memory_limit
        if limit is not None and limit < weights:
            self.process.die(
                f"CUDA out of memory: {LIMIT_ENV}={self.args.memory_limit_text} is below the "
                f"model's weights ({weights / GIB:.2f} GiB)"
            )
        kv = self.args.context_length * self.args.parallel * KV_PER_TOKEN_SLOT
        self.regions = self._plan_memory(weights, kv)
        self.regions.loading(weights)
        if not await finish_loading(self.process, self.behaviour, self.regions):
            return
        if await self.process.pause(self.behaviour.warmup_seconds):
            return
        self.ready = True
        log.info(f"tensorfold: model loaded, {self.args.parallel} parallel slots, ready")
        self.arm_death()

    def _plan_memory(self, weights: int, kv: int) -> Regions:
        """The weights, and the rest of what it takes as the KV cache."""
        limit = self.args.memory_limit
        try:
            device = find_device(os.environ)
        except NoDevice as exc:
            self.process.die(f"CUDA error: no CUDA-capable device is detected ({exc})")
        if device is None:
            take = weights + kv if limit is None else min(limit, weights + kv)
            unclaimed = with_cuda(self.process, NoHolder())
            self.process.at_exit(unclaimed.close)
            return Regions.of(
                unclaimed, {"weights": weights, "kv_cache": take - weights}, self.behaviour
            )
        free = device.free_bytes(exclude={os.getpid()})
        take = free * GRAB_SHARE[0] // GRAB_SHARE[1] if limit is None else min(limit, weights + kv)
        if take > free or take < weights:
            self.process.die(
                f"CUDA out of memory: tried to allocate {max(take, weights) / GIB:.2f} GiB on "
                f"device 0 ({free / GIB:.2f} GiB free)"
            )
        holder = with_cuda(self.process, LocalHolder(device, self.behaviour.memory_lag_seconds))
        self.process.at_exit(holder.close)
        sizes = {"weights": weights, "kv_cache": take - weights}
        return Regions.of(holder, sizes, self.behaviour)

    # Routes -----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.args.served_model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "tensorfold",
        }
        return JSONResponse({"object": "list", "data": [card]})


class KeyCheck(BearerAuth):
    """Every request but `GET /health` needs `Authorization: Bearer <key>` (OPTIONS too)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        public = scope.get("method") == "GET" and scope.get("path") == "/health"
        if scope["type"] == "http" and not public and not self._allowed(scope):
            await self.refusal()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(front: TensorFoldFrontend) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", front.chat, methods=["POST"])
    app.add_api_route("/v1/completions", front.completions, methods=["POST"])
    add_hot_paths(app, front)
    if front.args.api_key:
        app.add_middleware(
            KeyCheck,
            keys=[front.args.api_key],
            guarded=lambda path: True,
            refusal=lambda: JSONResponse(UNAUTHORIZED, status_code=401),
        )
    return app
