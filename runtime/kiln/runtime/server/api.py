"""The FastAPI application: OpenAI-compatible endpoints, health, readiness and metrics.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON, wrong types and a body not sent as ``application/json`` included; the
message carries the real numbers), 401 for a missing or wrong API key, 404 for an unknown
model or path, 405 for a wrong method (with ``Allow``), 500/503 when the engine is broken or
not ready.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..engine import InvalidRequestError, LLMEngine
from ..outputs import CompletionOutput, RequestOutput, TokenLogprobs
from .async_engine import AsyncEngine
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class _AuthError(Exception):
    """Missing or wrong API key (-> 401)."""


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected; its request was aborted."""


class _ModelNotFound(Exception):
    """A request names a model this server does not serve (-> 404 ``model_not_found``, as
    OpenAI and vLLM answer)."""


def _json_type(value) -> str:
    """JSON's name for the type of a decoded JSON value (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def error_body(message: str, etype: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def _error(status: int, message: str, etype: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, etype, code), status_code=status)


def _served_routes(app: FastAPI) -> str:
    """The app's endpoints as ``METHOD /path``, the ``/v1`` ones first (for a 404's message)."""
    routes = sorted((r for r in app.routes if isinstance(r, APIRoute)), key=lambda r: not r.path.startswith("/v1/"))
    return ", ".join(f"{'|'.join(sorted(r.methods))} {r.path}" for r in routes)


def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's and FastAPI's HTTP errors in OpenAI's body instead of ``{"detail": ...}``:
    the router's 404 (no such path) and 405 (no such method on the path; its ``Allow``
    header is kept) name what the server does serve; any other keeps its detail as message."""
    status = exc.status_code
    if status < 200 or status in (204, 304):  # statuses that carry no body
        return Response(status_code=status, headers=exc.headers)
    try:
        default = exc.detail == HTTPStatus(status).phrase  # raised by the router, not by an endpoint
    except ValueError:  # a status http.HTTPStatus does not know
        default = False
    if status == 404 and default:
        message = f"no route {request.method} {request.url.path}; the server serves {_served_routes(request.app)}"
    elif status == 405 and default:
        allow = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; it takes {allow}"
    else:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    etype = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, etype), status_code=status, headers=exc.headers)


def _validation_message(exc: ValidationError | RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', msg)}"
        got = err.get("input")
        got_s = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        parts.append(f"{loc or 'body'}: {msg}{got_s}")
    return "; ".join(parts) or "invalid request"


def build_app(engine: LLMEngine, api_key: str | None = None, warmup: bool = True) -> FastAPI:
    """Create the app around a loaded engine.

    Args:
        engine: the loaded :class:`LLMEngine` (its model is already in memory).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        warmup: run one request through the engine before ``/ready`` turns true.
    """
    metrics = Metrics(engine.served_model_name)
    token_text = _TokenText(engine.tokenizer)
    engine.stat_logger = metrics
    aengine = AsyncEngine(engine)
    model_names = {engine.served_model_name}  # as vLLM: --served-model-name replaces the source name
    created = int(time.time())

    # Refresh gauges after every step.
    orig_step = engine.step

    def step_with_gauges() -> list[RequestOutput]:
        outs = orig_step()
        metrics.update_gauges(engine.scheduler)
        return outs

    engine.step = step_with_gauges  # type: ignore[method-assign]
    aengine.on_change = lambda: metrics.update_gauges(engine.scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        if warmup:
            await aengine.warmup()
        else:
            aengine.ready = True
        log.info("kiln server ready: model %s", engine.served_model_name)
        yield
        await aengine.stop()

    app = FastAPI(title="Kiln", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = aengine
    app.state.metrics = metrics

    @app.exception_handler(HTTPException)  # FastAPI's HTTPException is a subclass
    async def _on_http(request: Request, exc: HTTPException):
        return _http_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(request: Request, exc: InvalidRequestError):
        return _error(400, str(exc))

    @app.exception_handler(_ClientGone)
    async def _on_gone(request: Request, exc: _ClientGone):
        # Nobody reads this (nginx's 499 "client closed request"); no traceback in the log.
        return Response(status_code=499)

    @app.exception_handler(_ModelNotFound)
    async def _on_no_model(request: Request, exc: _ModelNotFound):
        return _error(404, str(exc), "invalid_request_error", "model_not_found")

    @app.exception_handler(ClientDisconnect)
    async def _on_disconnect(request: Request, exc: ClientDisconnect):
        # The client closed the connection while sending its body: nothing to answer, no traceback.
        return Response(status_code=499)

    @app.exception_handler(_AuthError)
    async def _on_auth(request: Request, exc: _AuthError):
        return _error(401, "invalid or missing API key (Authorization: Bearer <key>)",
                      "authentication_error", "invalid_api_key")

    def _check_key(request: Request) -> None:
        """Bearer-token check for /v1/* (a dependency, not an HTTP middleware: Starlette's
        BaseHTTPMiddleware would hide client disconnects from the endpoints)."""
        if api_key:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), api_key.encode()):
                raise _AuthError()

    auth = [Depends(_check_key)]

    @app.get("/health")
    async def health():
        if aengine.errored is not None:
            return _error(500, f"engine failed: {aengine.errored!r}", "server_error")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if aengine.ready and aengine.errored is None:
            return {"status": "ready", "model": engine.served_model_name}
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{
            "id": engine.served_model_name, "object": "model", "created": created, "owned_by": "kiln",
            "max_model_len": engine.max_model_len,
        }]}

    def _check_model(name: str | None) -> None:
        if name and name not in model_names:
            raise _ModelNotFound(f"the model {name!r} does not exist; this server serves {engine.served_model_name!r}")

    async def _parse(request: Request, cls):
        """The request's JSON body validated as ``cls``.

        Raises:
            InvalidRequestError (-> 400): a body not sent as ``application/json`` (as vLLM
                answers: a JSON body sent as ``text/plain`` or a form is refused, not
                guessed at), malformed JSON, a JSON value that is not an object, or fields
                ``cls`` rejects.
        """
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            sent = f"as {ctype!r}" if ctype else "without a content type"
            raise InvalidRequestError(f"the request body was sent {sent}; send application/json")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"malformed JSON body: {e}") from e
        except RecursionError as e:
            raise InvalidRequestError("malformed JSON body: nested too deeply") from e
        if not isinstance(body, dict):
            raise InvalidRequestError(f"the request body must be a JSON object, got {_json_type(body)}")
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise InvalidRequestError(_validation_message(e)) from e
        except RecursionError as e:
            raise InvalidRequestError("request body nested too deeply") from e

    async def _collect(gen: AsyncIterator[RequestOutput], request: Request) -> RequestOutput:
        """Drain a generation, aborting it if the client disconnects."""
        last = None
        it = gen.__aiter__()
        loop = asyncio.get_running_loop()
        next_check = loop.time() + 1.0
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while not nxt.done():
                await asyncio.wait({nxt}, timeout=1.0)
                # Check the connection about once a second, whether tokens are flowing or not.
                if loop.time() >= next_check:
                    next_check = loop.time() + 1.0
                    if await request.is_disconnected():
                        nxt.cancel()
                        await asyncio.gather(nxt, return_exceptions=True)
                        await it.aclose()
                        raise _ClientGone()
            try:
                last = nxt.result()
            except StopAsyncIteration:
                return last
            if loop.time() >= next_check:
                next_check = loop.time() + 1.0
                if await request.is_disconnected():
                    await it.aclose()
                    raise _ClientGone()

    async def _start(prompt, params, rid: str) -> AsyncIterator[RequestOutput]:
        """Submit and wait until the engine accepted the request (so 400s surface here)."""
        gen = aengine.generate(prompt, params, rid)
        first = await gen.__anext__()

        async def chained():
            yield first
            async for o in gen:
                yield o
        return chained()

    # ---- /v1/completions -------------------------------------------------------------
    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req: CompletionRequest = await _parse(request, CompletionRequest)
        _check_model(req.model)
        try:
            params = req.to_sampling_params()
            prompts = req.prompts()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        base = f"cmpl-{uuid.uuid4().hex}"
        # Submit every prompt at once so they are batched together (not one after another).
        started = await asyncio.gather(*(_start(p, params, f"{base}-{i}") for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        errors = [g for g in started if isinstance(g, BaseException)]
        if errors:
            for g in started:
                if not isinstance(g, BaseException):
                    await g.aclose()
            raise errors[0]
        gens = list(started)
        model = req.model or engine.served_model_name
        # echo: the prompt's text before each choice's (decoded when given as token ids)
        echoes = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if req.echo and engine.tokenizer else ""
                  for p in prompts]
        if req.stream:
            return StreamingResponse(_stream_completions(base, model, gens, params.n, req, echoes),
                                     media_type="text/event-stream")
        finals = await asyncio.gather(*(_collect(g, request) for g in gens))
        choices, ptoks, ctoks = [], 0, 0
        for pi, out in enumerate(finals):
            ptoks += len(out.prompt_token_ids)
            for c in out.outputs:
                ctoks += len(c.token_ids)
                choices.append({"index": pi * params.n + c.index, "text": echoes[pi] + c.text,
                                "logprobs": (_completion_logprobs(c.logprobs, token_text, _Offsets(len(echoes[pi])),
                                                                  len(echoes[pi]) + len(c.text))
                                             if req.logprobs is not None else None),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": base, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices,
                "usage": _usage(ptoks, ctoks)}

    async def _stream_completions(base, model, gens, n, req: CompletionRequest, echoes: list[str]):
        created_ts = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        ptoks = ctoks = 0

        async def pump(pi, g):
            try:
                async for o in g:
                    await queue.put((pi, o))
            finally:
                await queue.put((pi, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(gens)
        finished_sent: set[int] = set()
        offsets: dict[int, _Offsets] = {}  # choice index -> its running text_offset
        sent: dict[int, int] = {}  # choice index -> characters of its text sent so far
        try:
            for pi, text in enumerate(echoes):
                for i in range(n if text else 0):
                    chunk = {"id": base, "object": "text_completion", "created": created_ts, "model": model,
                             "choices": [{"index": pi * n + i, "text": text, "logprobs": None, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            while remaining:
                pi, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                if out.finished:
                    ptoks += len(out.prompt_token_ids)
                for c in out.outputs:
                    idx = pi * n + c.index
                    if out.finished:
                        ctoks += len(c.token_ids)
                    # A chunk for new text, for new logprobs (a token may add no text yet:
                    # a partial UTF-8 character, or text held back by a stop string), and
                    # once for the choice's finish.
                    lps = c.delta_logprobs if req.logprobs is not None else None
                    final = c.finish_reason is not None and idx not in finished_sent
                    if not c.delta_text and not lps and not final:
                        continue
                    if final:
                        finished_sent.add(idx)
                    lp_obj = None
                    if req.logprobs is not None:
                        if idx not in offsets:
                            offsets[idx] = _Offsets(len(echoes[pi]))
                            sent[idx] = len(echoes[pi])
                        sent[idx] += len(c.delta_text)
                        lp_obj = _completion_logprobs(c.delta_logprobs, token_text, offsets[idx], sent[idx])
                    chunk = {"id": base, "object": "text_completion", "created": created_ts, "model": model,
                             "choices": [{"index": idx, "text": c.delta_text,
                                          "logprobs": lp_obj,
                                          "finish_reason": c.finish_reason if final else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            if req.stream_options and req.stream_options.include_usage:
                usage = {"id": base, "object": "text_completion", "created": created_ts, "model": model, "choices": [],
                         "usage": _usage(ptoks, ctoks)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                try:
                    await g.aclose()
                except RuntimeError:  # generator still closing from the cancelled pump
                    pass

    # ---- /v1/chat/completions --------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request):
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        _check_model(req.model)
        try:
            params = req.to_sampling_params()
            conv = req.conversation()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        prompt_ids = await aengine.run_tokenizer(engine.apply_chat_template, conv)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await _start(prompt_ids, params, rid)
        model = req.model or engine.served_model_name
        if req.stream:
            return StreamingResponse(_stream_chat(rid, model, gen, params.n, req), media_type="text/event-stream")
        out = await _collect(gen, request)
        ctoks = sum(len(c.token_ids) for c in out.outputs)
        ptoks = len(out.prompt_token_ids)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c.logprobs, token_text) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices,
                "usage": _usage(ptoks, ctoks)}

    async def _stream_chat(rid, model, gen, n, req: ChatCompletionRequest):
        created_ts = int(time.time())
        started = set()
        finished_sent: set[int] = set()
        final = None
        try:
            for i in range(n):
                started.add(i)
                head = {"id": rid, "object": "chat.completion.chunk", "created": created_ts, "model": model,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}
                yield f"data: {json.dumps(head)}\n\n"
            async for out in gen:
                final = out
                for c in out.outputs:
                    lps = c.delta_logprobs if req.logprobs else None
                    ends = c.finish_reason is not None and c.index not in finished_sent
                    if not c.delta_text and not lps and not ends:
                        continue
                    if ends:
                        finished_sent.add(c.index)
                    choice = {"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                              "logprobs": _chat_logprobs(c.delta_logprobs, token_text) if req.logprobs else None,
                              "finish_reason": c.finish_reason if ends else None}
                    yield f"data: {json.dumps({'id': rid, 'object': 'chat.completion.chunk', 'created': created_ts, 'model': model, 'choices': [choice]})}\n\n"
            if req.stream_options and req.stream_options.include_usage and final is not None:
                ctoks = sum(len(c.token_ids) for c in final.outputs)
                ptoks = len(final.prompt_token_ids)
                usage = {"id": rid, "object": "chat.completion.chunk", "created": created_ts, "model": model,
                         "choices": [], "usage": _usage(ptoks, ctoks)}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object (tokens)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (Radford et al. 2019, ``encoder.py``): the
    printable characters byte-level BPE vocabularies use for the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


class _TokenText:
    """Per-token text for logprobs: a token's own UTF-8 bytes (a byte-level BPE token can be a
    fragment of a character, which ``decode([id])`` turns into U+FFFD), cached per token id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            text = self.tokenizer.decode([token_id])
            b = text.encode("utf-8", "replace")
            if "\ufffd" in text:  # a fragment: read the bytes from the vocabulary entry
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and piece and all(c in _BYTE_LEVEL for c in piece):
                    b = bytes(_BYTE_LEVEL[c] for c in piece)
                elif isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    b = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
            self._bytes[token_id] = b
        return b

    def completion_token(self, token_id: int) -> str:
        """The token as text, or OpenAI's ``bytes:\\xNN...`` form when it is not whole UTF-8."""
        b = self.bytes_of(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class _Offsets:
    """Running ``text_offset`` of one choice: characters completed so far (an incremental
    UTF-8 decoder holds a character split across tokens until its last byte)."""

    def __init__(self, start: int = 0):
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, b: bytes) -> int:
        """Offset where a token with bytes ``b`` starts; then moves past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(b))
        return at


def _completion_logprobs(lps: list[TokenLogprobs] | None, text: _TokenText, offsets: _Offsets,
                         text_len: int) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object.  Tokens that are not whole UTF-8 show as
    ``bytes:\\xNN`` (OpenAI's form), so distinct byte tokens stay distinct keys of
    ``top_logprobs``; ``text_offset[i]`` is the character offset in the choice's text where
    token i starts (a token inside a split character points at that character), at most
    ``text_len`` (the text returned so far: the tokens of a matched stop string, whose text
    is cut, point at its end)."""
    if lps is None:
        return None
    return {
        "tokens": [text.completion_token(x.token_id) for x in lps],
        "token_logprobs": [x.logprob for x in lps],
        # the sampled token is always listed too (up to logprobs + 1 entries, as OpenAI and vLLM)
        "top_logprobs": [{**{text.completion_token(t.token_id): t.logprob for t in x.top},
                          text.completion_token(x.token_id): x.logprob} for x in lps],
        "text_offset": [min(offsets.advance(text.bytes_of(x.token_id)), text_len) for x in lps],
    }


def _chat_logprobs(lps: list[TokenLogprobs] | None, text: _TokenText) -> dict[str, Any] | None:
    """The chat ``logprobs`` object; ``bytes`` is each token's own UTF-8 bytes (a fragment of a
    character included), ``token`` their text with U+FFFD for an incomplete character."""
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        b = text.bytes_of(token_id)
        return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in x.top]}
                        for x in lps]}
