"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from .http_utils import SSE_DONE, ClientGoneError, chat_logprobs, error_body, json_response, sse
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut,
                       ChatStreamChoice, ChatUsageChunk, usage_of)
from .serving import ServingBase, collect


class OpenAIServingChat(ServingBase):
    """OpenAI's chat completions, rendered with the model's chat template."""

    async def create(self, request: Request):
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        lora_name = self.check_model(req.model)
        if len(req.messages) > self.limits.max_chat_messages:
            raise InvalidRequestError(f"the chat has {len(req.messages)} messages; this server takes at most "
                                      f"{self.limits.max_chat_messages} (--max-chat-messages)")
        try:
            params = req.to_sampling_params()
            conv = req.conversation()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        self.check_sequences(1, params.n)
        prompt_ids = await self.llm.run_tokenizer(self.llm.input.apply_chat_template, conv)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        (gen,) = await self.start_all(request, [prompt_ids], params, [rid], lora_name)
        model = req.model or self.model_name
        if req.stream:
            return StreamingResponse(self._stream(rid, model, gen, params.n, req), media_type="text/event-stream")
        (out,) = await collect([gen])
        ctoks = sum(len(c.token_ids) for c in out.outputs)
        choices = [ChatChoice(c.index, ChatMessageOut(c.text),
                              chat_logprobs(c.logprobs, self.token_text) if req.logprobs else None,
                              c.finish_reason, c.stop_reason) for c in out.outputs]
        return json_response(ChatCompletionResponse(rid, int(time.time()), model, choices,
                                                    usage_of(len(out.prompt_token_ids), ctoks)))

    async def _stream(self, rid, model, gen, n, req: ChatCompletionRequest):
        created_ts = int(time.time())
        finished_sent: set[int] = set()
        final = None
        try:
            for i in range(n):
                yield sse(ChatCompletionChunk(rid, created_ts, model, [ChatStreamChoice(
                    i, {"role": "assistant", "content": ""}, None, None)]))
            try:
                async for out in gen:
                    final = out
                    for c in out.outputs:
                        lps = c.delta_logprobs if req.logprobs else None
                        ends = c.finish_reason is not None and c.index not in finished_sent
                        if not c.delta_text and not lps and not ends:
                            continue
                        if ends:
                            finished_sent.add(c.index)
                        choice = ChatStreamChoice(
                            c.index, {"content": c.delta_text} if c.delta_text else {},
                            chat_logprobs(c.delta_logprobs, self.token_text) if req.logprobs else None,
                            c.finish_reason if ends else None)
                        yield sse(ChatCompletionChunk(rid, created_ts, model, [choice]))
            except (EngineDeadError, ServerShuttingDownError) as e:  # no [DONE]: the stream did not finish
                yield sse(error_body(str(e), "server_error"))
                return
            except ClientGoneError:
                return
            if req.stream_options and req.stream_options.include_usage and final is not None:
                ctoks = sum(len(c.token_ids) for c in final.outputs)
                yield sse(ChatUsageChunk(rid, created_ts, model, usage_of(len(final.prompt_token_ids), ctoks)))
            yield SSE_DONE
        finally:
            await gen.aclose()
