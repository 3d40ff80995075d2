"""The FastAPI application of an API server process: OpenAI-compatible endpoints, the
Triton / KServe v2 endpoints, health, readiness and metrics.

Errors on ``/v1`` use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400
for bad input (malformed JSON, wrong types and a body not sent as ``application/json``
included; the message carries the real numbers), 401 for a missing or wrong API key, 404
for an unknown model or path, 405 for a wrong method (with ``Allow``), 408 for a body that
does not arrive in time, 413 for a body over the limit, 500/503 when the engine core is
gone or not ready.  ``/v2`` answers in Triton's ``{"error": "<message>"}``.
"""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from .async_llm import AsyncLLM
from .http_utils import (AuthError, BodyTimeoutError, BodyTooLargeError, ClientGoneError, ModelNotFoundError,
                         error_response, http_error, validation_message)
from .serving import ServerLimits
from .serving_chat import OpenAIServingChat
from .serving_completion import OpenAIServingCompletion
from .serving_lora import add_lora_routes, model_cards
from .serving_v2 import TritonServing

log = logging.getLogger(__name__)


def build_app(llm: AsyncLLM, api_key: str | None = None, limits: ServerLimits | None = None,
              protect_metrics: bool = False, tool_call_parser: str = "hermes") -> FastAPI:
    """Create the app around an engine client.

    Args:
        llm: the API process's engine (connected to the core).
        api_key: when set, ``/v1/*`` and the generate endpoints require
            ``Authorization: Bearer <api_key>``.
        limits: per-request limits.
        protect_metrics: also require the key on ``/metrics`` and the API docs pages.
        tool_call_parser: the served model's tool-call format (``tool_parsers.PARSERS``).
    """
    limits = limits or ServerLimits()
    completion = OpenAIServingCompletion(llm, limits)
    chat = OpenAIServingChat(llm, limits, tool_call_parser)
    v2 = TritonServing(llm, limits)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        log.info("kiln API server ready: model %s", llm.served_model_name)
        yield
        await llm.stop()

    app = FastAPI(title="Kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llm = llm

    def _check_key(request: Request) -> None:
        """Bearer-token check (a dependency, not an HTTP middleware: Starlette's
        BaseHTTPMiddleware would hide client disconnects from the endpoints)."""
        if api_key:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), api_key.encode()):
                raise AuthError()

    auth = [Depends(_check_key)]
    ops_auth = auth if protect_metrics else []
    _install_error_handlers(app, llm)

    # HEAD answers as GET (load balancers and probes send HEAD): same status, no body
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if llm.errored is not None:
            return error_response(500, f"engine failed: {llm.errored}", "server_error")
        return {"status": "ok", "engine_core_pid": llm.info.pid}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        if llm.ready and llm.errored is None:
            return {"status": "ready", "model": llm.served_model_name}
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics", dependencies=ops_auth)
    async def prom():
        try:
            text = await llm.render_metrics()
        except (EngineDeadError, TimeoutError) as e:
            return error_response(503, f"metrics unavailable: {e}", "server_error")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", dependencies=ops_auth, include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/docs", dependencies=ops_auth, include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Kiln API")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": model_cards(llm, created)}

    add_lora_routes(app, llm, limits, auth)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await completion.create(request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await chat.create(request)

    _add_v2_routes(app, v2, auth)
    return app


def _add_v2_routes(app: FastAPI, v2: TritonServing, auth) -> None:
    """The v2 routes.  Model names may contain ``/`` (``org/model``), so ``name`` is a path
    parameter and the routes with a suffix come before the bare metadata route."""
    app.add_api_route("/v2", v2.server_metadata, methods=["GET"], response_model=None)
    app.add_api_route("/v2/health/live", v2.live, methods=["GET"], response_model=None)
    app.add_api_route("/v2/health/ready", v2.ready, methods=["GET"], response_model=None)

    async def generate(request: Request, name: str, version: str | None = None):
        return await v2.generate(request, name, version, stream=False)

    async def generate_stream(request: Request, name: str, version: str | None = None):
        return await v2.generate(request, name, version, stream=True)

    for path in ("/v2/models/{name:path}/versions/{version}", "/v2/models/{name:path}"):
        app.add_api_route(path + "/generate", generate, methods=["POST"], dependencies=auth, response_model=None)
        app.add_api_route(path + "/generate_stream", generate_stream, methods=["POST"], dependencies=auth,
                          response_model=None)
        app.add_api_route(path + "/ready", v2.model_ready, methods=["GET"], response_model=None)
    app.add_api_route("/v2/models/{name:path}/versions/{version}", v2.model_metadata, methods=["GET"],
                      response_model=None)
    app.add_api_route("/v2/models/{name:path}", v2.model_metadata, methods=["GET"], response_model=None)


def _install_error_handlers(app: FastAPI, llm: AsyncLLM) -> None:
    def failed(reason: str, response: Response) -> Response:
        llm.count_failure(reason)
        return response

    @app.exception_handler(HTTPException)  # FastAPI's HTTPException is a subclass
    async def _on_http(request: Request, exc: HTTPException):
        return failed("not_found" if exc.status_code == 404 else "bad_request", http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return failed("bad_request", error_response(400, validation_message(exc)))

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(request: Request, exc: InvalidRequestError):
        return failed("bad_request", error_response(400, str(exc)))

    @app.exception_handler(BodyTooLargeError)
    async def _on_too_large(request: Request, exc: BodyTooLargeError):
        return failed("too_large", error_response(413, str(exc)))

    @app.exception_handler(BodyTimeoutError)
    async def _on_body_timeout(request: Request, exc: BodyTimeoutError):
        return failed("timeout", error_response(408, str(exc)))

    @app.exception_handler(EngineDeadError)
    async def _on_dead(request: Request, exc: EngineDeadError):
        return failed("engine_error", error_response(500, str(exc), "server_error"))

    @app.exception_handler(ServerShuttingDownError)
    async def _on_shutdown(request: Request, exc: ServerShuttingDownError):
        return failed("shutdown", error_response(503, str(exc), "server_error"))

    @app.exception_handler(ClientGoneError)
    async def _on_gone(request: Request, exc: ClientGoneError):
        # Nobody reads this (nginx's 499 "client closed request"); no traceback in the log.
        return failed("client_gone", Response(status_code=499))

    @app.exception_handler(ModelNotFoundError)
    async def _on_no_model(request: Request, exc: ModelNotFoundError):
        return failed("not_found", error_response(404, str(exc), "invalid_request_error", "model_not_found"))

    @app.exception_handler(ClientDisconnect)
    async def _on_disconnect(request: Request, exc: ClientDisconnect):
        # The client closed the connection while sending its body: nothing to answer, no traceback.
        return failed("client_gone", Response(status_code=499))

    @app.exception_handler(AuthError)
    async def _on_auth(request: Request, exc: AuthError):
        return failed("unauthorized", error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                                     "authentication_error", "invalid_api_key"))
