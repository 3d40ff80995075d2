"""HTTP helpers shared by the serving classes: OpenAI's error body, JSON body parsing with
size and time limits, ``usage`` and ``logprobs`` objects, and SSE framing."""

from __future__ import annotations

import asyncio
import codecs
import json
from http import HTTPStatus

import msgspec
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..errors import InvalidRequestError
from ..outputs import TokenLogprobs


class BodyTooLargeError(Exception):
    """A request body above the server's limit (-> 413)."""


class BodyTimeoutError(Exception):
    """A request body that did not arrive in time (-> 408)."""


class ClientGoneError(Exception):
    """The client of a non-streaming request disconnected; its request was aborted."""


class ModelNotFoundError(Exception):
    """A request names a model this server does not serve (-> 404 ``model_not_found``, as
    OpenAI and vLLM answer)."""


class AuthError(Exception):
    """Missing or wrong API key (-> 401)."""


_JSON = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying ``obj`` (a response struct or plain data) as JSON."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` (a response struct or plain data) as an ``application/json`` response."""
    return Response(_JSON.encode(obj), status_code=status, media_type="application/json")


def json_type(value) -> str:
    """JSON's name for the type of a decoded JSON value (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def error_body(message: str, etype: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(status: int, message: str, etype: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, etype, code), status_code=status)


def served_routes(app: FastAPI) -> str:
    """The app's endpoints as ``METHOD /path``, the ``/v1`` ones first (for a 404's message)."""
    routes = sorted((r for r in app.routes if isinstance(r, APIRoute)), key=lambda r: not r.path.startswith("/v1/"))
    return ", ".join(f"{'|'.join(sorted(r.methods))} {r.path}" for r in routes)


def http_error(request: Request, exc: HTTPException) -> Response:
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
        message = f"no route {request.method} {request.url.path}; the server serves {served_routes(request.app)}"
    elif status == 405 and default:
        allow = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; it takes {allow}"
    else:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if request.url.path == "/v2" or request.url.path.startswith("/v2/"):  # Triton's error body
        return JSONResponse({"error": message}, status_code=status, headers=exc.headers)
    etype = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, etype), status_code=status, headers=exc.headers)


def validation_message(exc: ValidationError | RequestValidationError) -> str:
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


async def read_json_body(request: Request, max_bytes: int, timeout: float) -> dict:
    """The request's body as a JSON object.

    Raises:
        InvalidRequestError (-> 400): a body not sent as ``application/json`` (as vLLM
            answers: a JSON body sent as ``text/plain`` or a form is refused, not guessed
            at), malformed JSON, or a JSON value that is not an object.
        BodyTooLargeError (-> 413): more than ``max_bytes`` bytes (by ``Content-Length`` or
            as read).
        BodyTimeoutError (-> 408): the body took longer than ``timeout`` seconds to arrive.
    """
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        sent = f"as {ctype!r}" if ctype else "without a content type"
        raise InvalidRequestError(f"the request body was sent {sent}; send application/json")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise BodyTooLargeError(f"the request body has {int(length)} bytes, more than this server's limit "
                                f"of {max_bytes} (--max-request-body-bytes)")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLargeError(f"the request body has more than this server's limit of {max_bytes} "
                                        f"bytes (--max-request-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout:g} s") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"malformed JSON body: {e}") from e
    except RecursionError as e:
        raise InvalidRequestError("malformed JSON body: nested too deeply") from e
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, got {json_type(body)}")
    return body


def validate_model(cls, body: dict):
    """``cls.model_validate(body)`` with errors as InvalidRequestError (-> 400)."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise InvalidRequestError(validation_message(e)) from e
    except RecursionError as e:
        raise InvalidRequestError("request body nested too deeply") from e


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


class TokenText:
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


class Offsets:
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


def completion_logprobs(lps: list[TokenLogprobs] | None, text: TokenText, offsets: Offsets,
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


def chat_logprobs(lps: list[TokenLogprobs] | None, text: TokenText) -> dict[str, Any] | None:
    """The chat ``logprobs`` object; ``bytes`` is each token's own UTF-8 bytes (a fragment of a
    character included), ``token`` their text with U+FFFD for an incomplete character."""
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        b = text.bytes_of(token_id)
        return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in x.top]}
                        for x in lps]}
