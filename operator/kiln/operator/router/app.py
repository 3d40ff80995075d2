"""``kiln router``: one OpenAI- and KServe-v2-compatible endpoint in front of every
InferenceEngine it may see, routing by the request's ``model``.

Routes:
    POST /v1/{completions, chat/completions, ...}   body ``model`` selects the engine
    GET  /v1/models                                 every served model and adapter (engines at zero too)
    POST /v2/models/{name}/{generate, generate_stream, infer}
    GET  /v2/models/{name}[/ready]                  forwarded to a ready replica (never held)
    GET  /health, /v2/health/live                   the process is alive
    GET  /ready, /v2/health/ready                   discovery has listed everything once
    GET  /metrics                                   Prometheus (kiln_router_*)

Entry points: ``run_router(argparse.Namespace) -> int`` (the ``kiln router`` subcommand),
``build_app(config, api=None) -> Starlette`` (tests run it under uvicorn in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .activity import ActivitySignal
from .balance import make_policy
from .config import RouterConfig, config_from_args
from .discovery import ApiClient, Discovery
from .metrics import RouterMetrics
from .proxy import Proxy, error
from .table import ModelTable

log = logging.getLogger("kiln.router")

MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body past this is refused (413)


class RouterState:
    """What one router process holds: the table, the proxy, discovery and the signal."""

    def __init__(self, config: RouterConfig, api: ApiClient | None):
        self.config, self.api = config, api
        self.table = ModelTable()
        self.metrics = RouterMetrics()
        self.activity = ActivitySignal(api if not config.backends else None, config.activity_seconds)
        self.proxy = Proxy(self.table, make_policy(config.policy, config.load_factor), config, self.metrics,
                           self.activity)
        self.discovery = Discovery(api, self.table, config.namespaces) if api is not None and not config.backends \
            else None
        self.started = time.time()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for model, urls in self.config.backends.items():
            self.table.set_fixed(model, urls)
        if self.discovery is not None:
            self.discovery.start()
            self._tasks.append(asyncio.create_task(self._synced()))
        else:
            self.table.synced = True
        self._tasks.append(asyncio.create_task(self.activity.run(1.0, self.proxy.busy)))

    async def _synced(self) -> None:
        await self.discovery.wait_synced()  # type: ignore[union-attr]
        log.info("discovery synced: %d engines, %d models", len(self.table.engines), len(self.table.models()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        await self.proxy.aclose()
        if self.api is not None:
            await self.api.aclose()


async def _json_body(request: Request) -> tuple[bytes, dict | None, Response | None]:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return body, None, error(413, "request_too_large", f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        parsed = json.loads(body) if body else None
    except ValueError as e:
        return body, None, error(400, "invalid_json", f"the request body is not JSON: {e}")
    if parsed is not None and not isinstance(parsed, dict):
        return body, None, error(400, "invalid_json", "the request body must be a JSON object")
    return body, parsed, None


def build_app(config: RouterConfig, api: ApiClient | None = None) -> Starlette:
    """The router's ASGI app.  ``api`` (None with ``config.backends``) reaches the API server."""
    state = RouterState(config, api)

    async def openai(request: Request) -> Response:
        body, parsed, bad = await _json_body(request)
        if bad is not None:
            return bad
        model = (parsed or {}).get("model")
        if not isinstance(model, str) or not model:
            return error(400, "model_required", "the request body needs a \"model\" (GET /v1/models lists them)")
        return await state.proxy.forward(request, model, request.url.path, body, parsed)

    async def v2_post(request: Request) -> Response:
        body, parsed, bad = await _json_body(request)
        if bad is not None:
            return bad
        return await state.proxy.forward(request, request.path_params["name"], request.url.path, body, parsed)

    async def v2_get(request: Request) -> Response:
        name = request.path_params["name"]
        engine = state.table.lookup(name)
        if engine is None:
            return error(404, "model_not_found", f"model {name!r} is not served here")
        if not state.table.ready(engine):  # metadata and readiness never wake an engine
            return error(503, "no_ready_replica", f"model {name!r} has no ready replica now")
        return await state.proxy.forward(request, name, request.url.path, b"", None)

    async def models(_: Request) -> Response:
        data = [{"id": m, "object": "model", "created": int(state.started), "owned_by": "kiln",
                 "engine": eng.key, "ready_replicas": len(state.table.ready(eng))}
                for m, eng in state.table.models()]
        return JSONResponse({"object": "list", "data": data})

    async def alive(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        if not state.table.synced:
            return JSONResponse({"status": "discovering"}, status_code=503)
        return JSONResponse({"status": "ready", "models": len(state.table.models())})

    async def metrics(_: Request) -> Response:
        for eng in list(state.table.engines.values()):
            state.metrics.replicas.labels(eng.namespace, eng.name).set(len(state.table.ready(eng)))
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    routes = [
        Route("/health", alive), Route("/v2/health/live", alive),
        Route("/ready", ready), Route("/v2/health/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/{rest:path}", openai, methods=["POST"]),
        Route("/v2/models/{name}/{verb:str}", v2_post, methods=["POST"]),
        Route("/v2/models/{name}", v2_get), Route("/v2/models/{name}/ready", v2_get),
    ]
    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown paths and methods answer in the OpenAI error shape, as every other error does.
        if exc.status_code == 405:
            return error(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}")
        if exc.status_code == 404:
            return error(404, "not_found", f"no route {request.url.path} (POST /v1/..., GET /v1/models, /v2/...)")
        return error(exc.status_code, "http_error", str(exc.detail))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.router = state
    return app


def run_router(ns: argparse.Namespace) -> int:
    """``kiln router``: serve until SIGTERM / Ctrl-C.  A bad setting is a one-line error (exit 2)."""
    import uvicorn

    config = config_from_args(ns)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    api = None
    if not config.backends:
        from kubernetes.config import ConfigException
        try:
            api = ApiClient.from_kubeconfig(config.kubeconfig, config.context)
        except ConfigException as e:
            raise ValueError(f"no Kubernetes configuration ({e}); give --kubeconfig, run in a pod, or use "
                             "--backend MODEL=URL") from None
    app = build_app(config, api)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           access_log=False, lifespan="on", timeout_graceful_shutdown=30))
    log.info("starting on http://%s:%d (%s)", config.host, config.port,
             f"fixed backends: {', '.join(config.backends)}" if config.backends else "discovering InferenceEngines")
    server.run()
    return 0
