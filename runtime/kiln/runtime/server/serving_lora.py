"""LoRA adapter endpoints, named as vLLM names them: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``),
behind the API key; and the adapter entries of ``GET /v1/models`` (``parent``: the base).

Answers: 200 ``{"object": "lora_adapter", "id", "status"}``; 400 for an adapter that cannot
be served (missing files, a rank above ``--max-lora-rank``, shapes of another base; the
message says which, ``code`` is the reason) or a server without LoRA; 404
``model_not_found`` to unload a name that is not loaded.  A failed load changes nothing.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .async_llm import AsyncLLM
from .http_utils import error_response, read_json_body, validate_model
from .serving import ServerLimits


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM clients send it; Kiln names adapters by lora_name alone


def model_cards(llm: AsyncLLM, created: int) -> list[dict]:
    """``/v1/models`` entries: the base, then each adapter with ``parent`` = the base."""
    base = {"id": llm.served_model_name, "object": "model", "created": created, "owned_by": "kiln",
            "root": llm.served_model_name, "parent": None, "max_model_len": llm.max_model_len}
    cards = [base]
    for a in llm.lora_adapters:
        cards.append({"id": a.name, "object": "model", "created": a.created, "owned_by": "kiln", "root": a.path,
                      "parent": llm.served_model_name, "max_model_len": llm.max_model_len, "lora_rank": a.rank})
    return cards


def add_lora_routes(app: FastAPI, llm: AsyncLLM, limits: ServerLimits, auth) -> None:
    async def control(request: Request, cls, op: str):
        body = await read_json_body(request, limits.max_body_bytes, limits.body_timeout)
        req = validate_model(cls, body)
        if req.lora_name == llm.served_model_name:
            return error_response(400, f"{req.lora_name!r} is the base model's name; give the adapter another name")
        reply = await llm.lora_control(op, req.lora_name, getattr(req, "lora_path", ""))
        if reply.status != 200:
            code = "model_not_found" if reply.status == 404 else reply.reason or None
            return error_response(reply.status, reply.message, "invalid_request_error", code)
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name,
                             "status": "loaded" if op == "load" else "unloaded", "message": reply.message})

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(request: Request):
        return await control(request, LoadLoRAAdapterRequest, "load")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(request: Request):
        return await control(request, UnloadLoRAAdapterRequest, "unload")
