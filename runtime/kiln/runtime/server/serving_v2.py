"""Triton Inference Server / KServe v2 protocol: health, server and model metadata, and
Triton's generate extension (``/generate`` and ``/generate_stream``, as TensorRT-LLM's
backend serves them).  Errors use Triton's body ``{"error": "<message>"}``: 400 for bad
input, 404 for an unknown model, 500 when the engine core is gone, 503 while not ready."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ..errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from .http_utils import (BodyTimeoutError, BodyTooLargeError, ClientGoneError, json_response, read_json_body, sse,
                         validation_message)
from .protocol import GenerateChunk, GenerateRequest, GenerateResponse
from .serving import ServingBase, collect

SERVER_NAME = "kiln"
SERVER_VERSION = "0.1.0"
MODEL_VERSION = "1"


def v2_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class TritonServing(ServingBase):
    """The v2 endpoints for the one model this server serves."""

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["generate"]}

    def live(self) -> Response:
        return Response(status_code=200) if self.llm.errored is None else v2_error(500, str(self.llm.errored))

    def ready(self) -> Response:
        return Response(status_code=200) if self.llm.ready and self.llm.errored is None \
            else v2_error(503, "not ready")

    def _unknown(self, name: str, version: str | None) -> JSONResponse | None:
        if name != self.model_name:
            return v2_error(404, f"unknown model {name!r}; this server serves {self.model_name!r}")
        if version not in (None, "", MODEL_VERSION):
            return v2_error(404, f"unknown version {version!r} of model {name!r}; it has version {MODEL_VERSION}")
        return None

    def model_metadata(self, name: str, version: str | None = None) -> Response | dict[str, Any]:
        bad = self._unknown(name, version)
        if bad is not None:
            return bad
        return {"name": self.model_name, "versions": [MODEL_VERSION], "platform": "kiln",
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]},
                           {"name": "max_tokens", "datatype": "INT32", "shape": [1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}

    def model_ready(self, name: str, version: str | None = None) -> Response:
        bad = self._unknown(name, version)
        if bad is not None:
            return bad
        return self.ready()

    async def generate(self, request: Request, name: str, version: str | None, stream: bool) -> Response:
        bad = self._unknown(name, version)
        if bad is not None:
            return bad
        try:
            body = await read_json_body(request, self.limits.max_body_bytes, self.limits.body_timeout)
            req = GenerateRequest.from_body(body)
            if req.stream is not None and req.stream != stream:
                raise InvalidRequestError(f"stream: {str(req.stream).lower()} does not match this endpoint; use "
                                          f"{'generate_stream' if req.stream else 'generate'}")
            params = req.to_sampling_params()
            rid = f"gen-{uuid.uuid4().hex}"
            (gen,) = await self.start_all(request, [req.text_input], params, [rid])
        except ValidationError as e:
            return self._fail(400, validation_message(e))
        except (InvalidRequestError, ValueError) as e:
            return self._fail(400, str(e))
        except BodyTooLargeError as e:
            return self._fail(413, str(e))
        except BodyTimeoutError as e:
            return self._fail(408, str(e))
        except EngineDeadError as e:
            return self._fail(500, str(e))
        if stream:
            return StreamingResponse(self._stream(gen), media_type="text/event-stream")
        try:
            (out,) = await collect([gen])
        except EngineDeadError as e:
            return self._fail(500, str(e))
        except ServerShuttingDownError as e:
            return self._fail(503, str(e))
        c = out.outputs[0]
        return json_response(GenerateResponse(self.model_name, MODEL_VERSION, c.text, c.finish_reason,
                                              len(out.prompt_token_ids), len(c.token_ids)))

    def _fail(self, status: int, message: str) -> JSONResponse:
        self.llm.count_failure({400: "bad_request", 408: "timeout", 413: "too_large"}.get(status, "engine_error"))
        return v2_error(status, message)

    async def _stream(self, gen):
        try:
            async for out in gen:
                c = out.outputs[0]
                if not c.delta_text and c.finish_reason is None:
                    continue
                yield sse(GenerateChunk(self.model_name, MODEL_VERSION, c.delta_text, c.finish_reason))
        except (EngineDeadError, ServerShuttingDownError) as e:
            yield sse({"error": str(e)})
        except ClientGoneError:
            return
        finally:
            await gen.aclose()
