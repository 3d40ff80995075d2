"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Any, Sequence

from .config import EngineArgs
from .engine import LLMEngine
from .lora import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Load a model (or a ``kiln build`` engine) and generate in batches.

    Args:
        model: ``builtin:<name>``, a ``.gguf`` file or a Hugging Face folder (default: the
            embedded SmolLM2-135M-Instruct).
        engine: a Kiln engine folder instead of ``model``.
        **kwargs: any :class:`EngineArgs` field (``max_num_seqs``, ``num_kv_blocks``,
            ``max_num_batched_tokens``, ``device``, ``dtype``, ...).
    Raises:
        ModelSourceError / UnsupportedModelError / ValueError for bad sources or settings.
    """

    def __init__(self, model: str | None = None, engine: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineArgs(model=model, engine=engine, **kwargs))
        self.engine.stream_outputs = False
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with in-flight batching.

        Args:
            prompts: one string, a list of strings, or a list of token-id lists.
            sampling_params: one for all prompts, or one per prompt (default: ``SamplingParams()``,
                temperature 1.0 and 16 tokens, as in vLLM).
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base
                model); an adapter given with a ``path`` is loaded first if it is not loaded.
        Returns:
            One finished RequestOutput per prompt, in input order.
        Raises:
            InvalidRequestError: a prompt the model cannot take (nothing is left queued).
        """
        if not isinstance(prompts, (str, list, tuple)):
            raise TypeError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        for p in prompts:
            ok = isinstance(p, str) or (isinstance(p, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p))
            if not ok:
                raise TypeError(f"each prompt must be a string or a list of token ids, got {p!r:.80}")
        if sampling_params is not None and not isinstance(sampling_params, (SamplingParams, list, tuple)):
            raise TypeError(f"sampling_params must be SamplingParams (or a list of them), "
                            f"got {type(sampling_params).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"each sampling_params entry must be SamplingParams, got {type(sp).__name__}")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        for lr in loras:
            if lr is not None and not isinstance(lr, LoRARequest):
                raise TypeError(f"lora_request entries must be LoRARequest or None, got {type(lr).__name__}")
            if lr is not None and lr.path is not None and self.engine.lora is not None \
                    and lr.name not in {a.name for a in self.engine.lora.adapters()}:
                self.engine.add_lora(lr.name, lr.path)
        ids: list[str] = []
        try:
            for p, sp, lr in zip(prompts, params, loras):
                ids.append(self.engine.add_request(None, p, sp, lora_name=lr.name if lr is not None else None))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def add_lora(self, name: str, path: str):
        """Load a PEFT LoRA adapter folder under ``name`` (LoRAError when it cannot be served)."""
        return self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name`` (LoRAError NotFound when unknown)."""
        self.engine.remove_lora(name)

    def list_loras(self) -> list:
        """The loaded adapters (``LoRAInfo``: name, id, path, rank, target modules)."""
        return self.engine.lora.adapters() if self.engine.lora is not None else []

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template of the model)."""
        if not isinstance(messages, list):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages must not be empty: give one conversation (a list of message dicts) "
                             "or a list of them")
        convs = [messages] if isinstance(messages[0], dict) else messages
        if any(not isinstance(c, list) or not c for c in convs):
            raise ValueError("each conversation must be a non-empty list of {'role', 'content'} dicts")
        for conv in convs:
            for m in conv:
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool") \
                        or not isinstance(m.get("content"), str):
                    raise ValueError(f"each message needs a role (system, user, assistant, developer, tool) "
                                     f"and a string content, got {m!r:.80}")
        token_lists = [self.engine.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(token_lists, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        """Step the engine until every request finished; if a step raises, this call's requests
        still in the engine are aborted (their KV blocks freed) before the error propagates, so
        the ``LLM`` stays usable."""
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        return [final[i] for i in ids]
