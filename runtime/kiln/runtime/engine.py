"""The in-process engine behind the offline ``LLM``: input processor -> engine core ->
output processor, stepped by the caller (vLLM V1's three parts in one process).

``kiln serve`` runs the same engine core in its own process instead
(``kiln.runtime.engine_core.proc``), with the processors in the API server processes.
"""

from __future__ import annotations

import itertools
from typing import Any

from .config import EngineArgs
from .hub import download_model_args
from .engine_core.core import EngineCore, StatLogger
from .errors import InvalidRequestError
from .outputs import RequestOutput
from .processing.input import InputProcessor, ModelLimits
from .processing.output import OutputProcessor
from .sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "LLMEngine"]


class LLMEngine:
    """Owns the tokenizer, the engine core and the two processors.

    Args:
        args: engine settings.
        stat_logger: optional metrics sink (the core's ``StatLogger``).
    Raises:
        ModelSourceError, UnsupportedModelError, ValueError: bad model or settings.
    """

    def __init__(self, args: EngineArgs, stat_logger: StatLogger | None = None):
        args = download_model_args(args)
        self.core = EngineCore(args, stat_logger)
        lm = self.core.loaded
        self.args = self.core.args
        self.tokenizer = lm.tokenizer
        self.model_ref = lm.model_ref
        self.model_config = lm.model_config
        self.max_model_len = self.core.max_model_len
        self.served_model_name = args.served_model_name or self.model_ref
        if self.served_model_name in self.args.lora_modules:
            raise ValueError(f"lora_modules: {self.served_model_name!r} is the base model's name; "
                             "give the adapter another name")
        self.input = InputProcessor(self.tokenizer, ModelLimits(
            self.max_model_len, self.model_config.vocab_size, self.args.block_size, self.runner.num_kv_blocks,
            self.served_model_name))
        self.output = OutputProcessor(self.tokenizer, stream_outputs=True)
        self._ids = itertools.count()

    # -- the parts, for callers that inspect them (benchmarks, tests) -----------------------
    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def eos_token_ids(self) -> set[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value: set[int]) -> None:
        self.core.eos_token_ids = set(value)

    @property
    def stream_outputs(self) -> bool:
        """True: ``step()`` returns an output for every request that progressed (streaming);
        False: only for requests that finished (``LLM.generate`` sets this)."""
        return self.output.stream_outputs

    @stream_outputs.setter
    def stream_outputs(self, value: bool) -> None:
        self.output.stream_outputs = value

    # -- requests ----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` (see ``InputProcessor.tokenize_prompt``)."""
        return self.input.tokenize_prompt(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat (see ``InputProcessor.apply_chat_template``)."""
        return self.input.apply_chat_template(messages)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The effective max_tokens (see ``InputProcessor.validate``)."""
        return self.input.validate(prompt_token_ids, params)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora_name: str | None = None) -> str:
        """Queue a request (computed by the LoRA adapter ``lora_name`` when given); returns its
        id.  Raises InvalidRequestError (nothing queued; ``LoRAError`` for an unknown adapter)."""
        request_id = request_id or self.new_request_id()
        if self.output.get(request_id) is not None:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        text, ids, seqs = self.input.process(request_id, prompt, params, arrival_time, lora_name)
        added: list[str] = []
        try:
            for s in seqs:
                self.core.add_request(s)
                added.append(s.request_id)
        except InvalidRequestError:
            self.core.abort_requests(added)
            raise
        self.output.add_request(request_id, text, ids, params, seqs[0].arrival_time)
        return request_id

    # -- LoRA adapters -------------------------------------------------------------------------
    @property
    def lora(self):
        """The engine's ``LoRAManager`` (None without ``enable_lora`` / ``lora_modules``)."""
        return self.core.runner.lora

    def add_lora(self, name: str, path: str):
        """Load a PEFT adapter under ``name`` (``LoRAManager.add_adapter``; LoRAError)."""
        if self.lora is None:
            from .lora import LoRAError  # noqa: PLC0415

            raise LoRAError("this engine was started without LoRA (enable_lora=True or lora_modules)")
        return self.lora.add_adapter(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``; its running requests finish first (LoRAError if unknown)."""
        if self.lora is None:
            from .lora import LoRAError  # noqa: PLC0415

            raise LoRAError(f"no adapter named {name!r} is loaded", "NotFound")
        self.lora.remove_adapter(name)

    def abort_request(self, request_id: str) -> None:
        """Drop a request (client gone): frees its blocks; unknown or finished ids are ignored."""
        self.core.abort_requests(self.output.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return len(self.output) > 0

    @property
    def num_requests(self) -> int:
        return len(self.output)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that progressed (see
        ``EngineCore.step`` for the asynchronous-scheduling offset)."""
        outputs, to_abort = self.output.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort, "stop")
        _, refused = self.core.take_admissions()
        if refused:  # a grammar that failed or took too long in the core: gone there already
            for rid, _msg in refused:
                self.abort_request(rid.rsplit("#", 1)[0])  # the request (its other sequences too)
            raise InvalidRequestError(f"request {refused[0][0]}: {refused[0][1]}")
        return outputs

