"""``POST /v1/completions``."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from .http_utils import SSE_DONE, Offsets, completion_logprobs, error_body, json_response, sse
from .protocol import (CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, CompletionStreamChoice,
                       CompletionUsageChunk, usage_of)
from .serving import ServingBase, collect


class OpenAIServingCompletion(ServingBase):
    """OpenAI's legacy completions: one or more prompts, ``n`` choices each."""

    async def create(self, request: Request):
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        lora_name = self.check_model(req.model)
        try:
            params = req.to_sampling_params()
            prompts = req.prompts()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.check_sequences(len(prompts), params.n)
        base = f"cmpl-{uuid.uuid4().hex}"
        gens = await self.start_all(request, prompts, params, [f"{base}-{i}" for i in range(len(prompts))],
                                    lora_name)
        model = req.model or self.model_name
        tok = self.llm.tokenizer
        # echo: the prompt's text before each choice's (decoded when given as token ids)
        echoes = [(p if isinstance(p, str) else tok.decode(p)) if req.echo and tok is not None else ""
                  for p in prompts]
        if req.stream:
            return StreamingResponse(self._stream(base, model, gens, params.n, req, echoes),
                                     media_type="text/event-stream")
        finals = await collect(gens)
        choices, ptoks, ctoks = [], 0, 0
        for pi, out in enumerate(finals):
            ptoks += len(out.prompt_token_ids)
            for c in out.outputs:
                ctoks += len(c.token_ids)
                lps = (completion_logprobs(c.logprobs, self.token_text, Offsets(len(echoes[pi])),
                                           len(echoes[pi]) + len(c.text)) if req.logprobs is not None else None)
                choices.append(CompletionChoice(pi * params.n + c.index, echoes[pi] + c.text, lps, c.finish_reason,
                                                c.stop_reason))
        return json_response(CompletionResponse(base, int(time.time()), model, choices, usage_of(ptoks, ctoks)))

    async def _stream(self, base, model, gens, n, req: CompletionRequest, echoes: list[str]):
        created_ts = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()
        ptoks = ctoks = 0

        async def pump(pi, g):
            try:
                async for o in g:
                    await queue.put((pi, o))
            except BaseException as e:  # noqa: BLE001  (the core died, or the client left)
                await queue.put((pi, e))
            finally:
                await queue.put((pi, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(gens)
        finished_sent: set[int] = set()
        offsets: dict[int, Offsets] = {}  # choice index -> its running text_offset
        sent: dict[int, int] = {}  # choice index -> characters of its text sent so far
        try:
            for pi, text in enumerate(echoes):
                for i in range(n if text else 0):
                    yield sse(CompletionChunk(base, created_ts, model, [CompletionStreamChoice(pi * n + i, text, None,
                                                                                               None)]))
            while remaining:
                pi, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                if isinstance(out, BaseException):
                    if isinstance(out, (EngineDeadError, ServerShuttingDownError)):
                        yield sse(error_body(str(out), "server_error"))  # no [DONE]: it did not finish
                    return
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
                            offsets[idx] = Offsets(len(echoes[pi]))
                            sent[idx] = len(echoes[pi])
                        sent[idx] += len(c.delta_text)
                        lp_obj = completion_logprobs(c.delta_logprobs, self.token_text, offsets[idx], sent[idx])
                    yield sse(CompletionChunk(base, created_ts, model, [CompletionStreamChoice(
                        idx, c.delta_text, lp_obj, c.finish_reason if final else None)]))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(CompletionUsageChunk(base, created_ts, model, usage_of(ptoks, ctoks)))
            yield SSE_DONE
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                try:
                    await g.aclose()
                except RuntimeError:  # generator still closing from the cancelled pump
                    pass
