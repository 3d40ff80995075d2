"""What every serving class shares: the engine, the server's limits, and running a request
while watching its client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from ..errors import InvalidRequestError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_llm import AsyncLLM
from .http_utils import ClientGoneError, ModelNotFoundError, TokenText, read_json_body, validate_model


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the HTTP server (flags of ``kiln serve``).

    Fields:
        max_request_sequences: prompts x ``n`` of one request at most.
        max_chat_messages: messages of one chat at most.
        max_body_bytes: request body size at most (bytes; larger -> 413).
        body_timeout: seconds a request body may take to arrive (slower -> 408).
    """

    max_request_sequences: int = 256
    max_chat_messages: int = 1024
    max_body_bytes: int = 16 << 20
    body_timeout: float = 60.0


class ServingBase:
    """A serving class's access to the engine and the limits."""

    def __init__(self, llm: AsyncLLM, limits: ServerLimits):
        self.llm = llm
        self.limits = limits
        self.token_text = TokenText(llm.tokenizer) if llm.tokenizer is not None else None

    @property
    def model_name(self) -> str:
        return self.llm.served_model_name

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model).

        Raises:
            ModelNotFoundError (-> 404): neither the base model nor a loaded adapter.
        """
        if not name or name == self.llm.served_model_name:
            return None
        if any(a.name == name for a in self.llm.lora_adapters):
            return name
        served = [self.llm.served_model_name] + [a.name for a in self.llm.lora_adapters]
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves "
                                 f"{', '.join(repr(s) for s in served)}")

    async def parse(self, request: Request, cls):
        """The body validated as ``cls`` (see ``read_json_body`` for the errors)."""
        body = await read_json_body(request, self.limits.max_body_bytes, self.limits.body_timeout)
        return validate_model(cls, body)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Raises InvalidRequestError when prompts x n exceeds ``max_request_sequences``."""
        if num_prompts * n > self.limits.max_request_sequences:
            raise InvalidRequestError(
                f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; this "
                f"server takes at most {self.limits.max_request_sequences} per request "
                f"(--max-request-sequences)")

    async def start_all(self, request: Request, prompts: list, params: SamplingParams,
                        ids: list[str], lora_name: str | None = None) -> list[AsyncIterator[RequestOutput]]:
        """Submit every prompt at once (so they are batched together), wait until the core
        accepted all of them, and watch the client: when it disconnects, every iterator
        raises ClientGoneError at once and its sequences are aborted.

        Raises:
            InvalidRequestError / EngineDeadError: a prompt was refused or the core is gone
                (the others are aborted).
        """
        started = await asyncio.gather(*(self.llm.submit(p, params, rid, lora_name)
                                         for p, rid in zip(prompts, ids)),
                                       return_exceptions=True)
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            for s, rid in zip(started, ids):
                if not isinstance(s, BaseException):
                    await self.llm.abort(rid)
            raise errors[0]
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        waiters = [w for w, _ in started]

        def on_gone(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                for w in waiters:
                    w.queue.put_nowait(ClientGoneError())

        watcher.add_done_callback(on_gone)
        live = {"n": len(started)}
        return [_watched(self.llm.iterate(rid, w), watcher, live) for (w, rid) in started]


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _watched(it: AsyncIterator[RequestOutput], watcher: asyncio.Future,
                   live: dict[str, int]) -> AsyncIterator[RequestOutput]:
    """``it``, with the disconnect watcher cancelled once the last of ``live["n"]``
    iterators ends."""
    try:
        async for out in it:
            yield out
    finally:
        await it.aclose()
        live["n"] -= 1
        if live["n"] == 0 and not watcher.done():
            watcher.cancel()


async def collect(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each generation (raises ClientGoneError when the client left)."""

    async def last(g: AsyncIterator[RequestOutput]) -> RequestOutput:
        out = None
        async for out in g:
            pass
        return out

    tasks = [asyncio.ensure_future(last(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
