"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from .http_utils import SSE_DONE, ClientGoneError, chat_logprobs, error_body, json_response, sse
from ..structured_output.tool_parsers import ToolCallStream, get_parser
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut,
                       ChatStreamChoice, ChatToolCallsMessageOut, ChatUsageChunk, usage_of)
from .serving import ServerLimits, ServingBase, collect
from .tool_calling import ToolPlan, plan_tools, prepare_conversation, stop_repeated_calls


class OpenAIServingChat(ServingBase):
    """OpenAI's chat completions, rendered with the model's chat template; tool calls in
    the ``tool_call_parser`` format (``tool_calling``)."""

    def __init__(self, llm, limits: ServerLimits, tool_call_parser: str = "hermes"):
        super().__init__(llm, limits)
        self.tool_call_parser = tool_call_parser

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
        plan = await self.llm.run_tokenizer(plan_tools, req, self.tool_call_parser)
        tools = None
        if plan is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in conv):
            conv, tools = prepare_conversation(conv, plan, self.llm.input.template_supports_tools,
                                               get_parser(self.tool_call_parser))
        if plan is not None and plan.grammar() is not None:
            params.structured_outputs = plan.grammar()
        self.check_sequences(1, params.n)
        prompt_ids = await self.llm.run_tokenizer(self.llm.input.apply_chat_template, conv, tools)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        (gen,) = await self.start_all(request, [prompt_ids], params, [rid], lora_name)
        if plan is not None:
            gen = stop_repeated_calls(gen, plan.parser, params.n)
        model = req.model or self.model_name
        if req.stream:
            return StreamingResponse(self._stream(rid, model, gen, params.n, req, plan),
                                     media_type="text/event-stream")
        (out,) = await collect([gen])
        ctoks = sum(len(c.token_ids) for c in out.outputs)
        choices = []
        for c in out.outputs:
            message, reason = _message(plan, c.text, c.finish_reason)
            choices.append(ChatChoice(c.index, message, chat_logprobs(c.logprobs, self.token_text)
                                      if req.logprobs else None, reason, c.stop_reason))
        return json_response(ChatCompletionResponse(rid, int(time.time()), model, choices,
                                                    usage_of(len(out.prompt_token_ids), ctoks)))

    async def _stream(self, rid, model, gen, n, req: ChatCompletionRequest, plan: ToolPlan | None):
        created_ts = int(time.time())
        finished_sent: set[int] = set()
        final = None
        calls = [ToolCallStream(plan.parser) for _ in range(n)] if plan is not None else None
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
                        delta: dict = {"content": c.delta_text} if c.delta_text else {}
                        reason = c.finish_reason if ends else None
                        if calls is not None:
                            text, new_calls = calls[c.index].feed(c.delta_text, final=ends, cut=reason == "length",
                                                                 full=c.text)
                            delta = {"content": text} if text else {}
                            if new_calls:
                                delta["tool_calls"] = new_calls
                            if ends and calls[c.index].calls_sent and reason == "stop":
                                reason = "tool_calls"
                            if not delta and not lps and not ends:
                                continue
                        choice = ChatStreamChoice(
                            c.index, delta,
                            chat_logprobs(c.delta_logprobs, self.token_text) if req.logprobs else None, reason)
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


def _message(plan: ToolPlan | None, text: str, finish_reason: str | None):
    """``(message, finish_reason)`` of a finished choice: its tool calls parsed when the
    request has tools ("tool_calls" when the output ended normally with calls)."""
    if plan is None:
        return ChatMessageOut(text), finish_reason
    content, calls = plan.parse(text, cut=finish_reason == "length")
    if not calls:
        return ChatMessageOut(content or ""), finish_reason
    return (ChatToolCallsMessageOut(content, [c.to_openai() for c in calls]),
            "tool_calls" if finish_reason == "stop" else finish_reason)
