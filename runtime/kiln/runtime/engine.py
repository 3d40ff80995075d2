"""The engine loop: ``step()`` = scheduler.schedule() -> model runner -> scheduler update ->
stop checks -> detokenization (nano-vllm's ``LLMEngine.step``).  Only the scheduler touches
the KV cache manager.  A request with ``n > 1`` fans out into ``n`` child sequences that
share the prompt's KV blocks through the prefix cache (``parallel_sampling``)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Protocol

import torch

from . import loader
from .config import EngineArgs, resolve_batch_limits
from .core.config import SchedulerConfig
from .core.request import Request, RequestStatus
from .core.sched_output import SchedulerOutput
from .core.scheduler import Scheduler
from .detokenizer import IncrementalDetokenizer
from .model.config import ModelConfig
from .model_runner import ModelRunner, PendingStep, StepResult
from .outputs import Logprob, RequestOutput, TokenLogprobs
from .parallel_sampling import ChildSequence, ParentRequest, mix_seed
from .sampler import SamplingRow
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine refuses (maps to HTTP 400); the message carries the numbers."""


class StatLogger(Protocol):
    """Receives per-request timings (seconds) and counts; the server's Prometheus metrics
    implement it."""

    def on_scheduled(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_token(self, itl_seconds: float) -> None: ...
    def on_finish(self, e2e_seconds: float, num_prompt_tokens: int, num_generation_tokens: int,
                  finish_reason: str) -> None: ...
    def on_step(self, num_prompt_tokens: int, num_generation_tokens: int) -> None: ...


def _check_max_model_len(args: EngineArgs, cfg: ModelConfig) -> None:
    """Raises ValueError when ``max_model_len`` is below 2 or exceeds the model's context (vLLM
    refuses that too: positions past the trained RoPE range give garbage), before any weight
    is loaded.  None means the default."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), "
                         f"got {args.max_model_len}")
    if args.max_model_len and args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {args.max_model_len} is larger than the model's context length "
                         f"({cfg.max_position_embeddings} tokens, max_position_embeddings)")


class LLMEngine:
    """Owns the tokenizer, scheduler and model runner.

    Args:
        args: engine settings.
        stat_logger: optional metrics sink.
    Raises:
        loader.ModelSourceError, UnsupportedModelError, ValueError: bad model or settings.
    """

    def __init__(self, args: EngineArgs, stat_logger: StatLogger | None = None):
        self.args = args
        self.stat_logger = stat_logger
        self._max_token_chars: int | None = None  # longest vocabulary entry (characters), lazily
        t0 = time.perf_counter()
        engine_limit = 0  # an engine's build max_seq_len (tokens)
        if args.engine:
            from .engine_folder import open_engine  # noqa: PLC0415  (kiln build's output)

            folder = open_engine(args.engine)
            self.model_config: ModelConfig = folder.model_config
            _check_max_model_len(args, self.model_config)
            # the engine's build limit (TensorRT-LLM's max_seq_len): serve at most that context
            engine_limit = int((folder.manifest.get("limits") or {}).get("max_seq_len") or 0)
            if engine_limit and args.max_model_len and args.max_model_len > engine_limit:
                raise ValueError(f"max_model_len {args.max_model_len} is larger than the engine's build limit "
                                 f"({engine_limit} tokens, build max_seq_len / build.maxSeqLen); rebuild with a "
                                 f"larger --max-seq-len or serve a shorter context")
            args = self.args = resolve_batch_limits(args, folder.manifest.get("limits"))
            self.tokenizer = folder.load_tokenizer()
            self.model_ref = folder.model_ref
            self.runner = ModelRunner(self.model_config, args)
            folder.load_into(self.runner)
        else:
            args = self.args = resolve_batch_limits(args)
            src = loader.materialize_gguf(loader.resolve_source(args.model))
            self.model_ref = src.ref
            self.model_config = loader.load_model_config(src)
            _check_max_model_len(args, self.model_config)
            self.tokenizer = loader.load_tokenizer(src)
            self.runner = ModelRunner(self.model_config, args)
            if args.load_format == "dummy":
                self.runner.init_dummy_weights(args.seed)
            else:
                self.runner.load_weights(loader.iter_weights(src))
        cfg = self.model_config
        self.max_model_len = min(args.max_model_len or min(cfg.max_position_embeddings, 4096),
                                 cfg.max_position_embeddings)
        if engine_limit:
            self.max_model_len = min(self.max_model_len, engine_limit)
        num_blocks = self.runner.profile_num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        if args.kernel_warmup:
            self.runner.warmup_kernels(args.max_num_batched_tokens, self.max_model_len, args.max_num_seqs)
        self.runner.capture_cuda_graphs(self.max_model_len)
        # asynchronous scheduling pays only where the forward pass runs on a device stream
        self.async_scheduling = (args.async_scheduling if args.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, 1),
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            num_kv_blocks=num_blocks,
            policy=args.scheduler_policy,
            enable_prefix_caching=args.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
        ))
        # The step launched last, not yet read back: (its plan, its pending result).
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None
        # Live requests whose sampling reads their own history (penalties): while any is
        # present, steps run synchronously so the history holds no placeholder.
        self._num_history_requests = 0
        self.eos_token_ids = set(cfg.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self.served_model_name = args.served_model_name or self.model_ref
        self._parents: dict[str, ParentRequest] = {}
        self._child_of: dict[str, tuple[ParentRequest, ChildSequence]] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        # True: step() returns an output for every request that progressed (streaming);
        # False: only for requests that finished (LLM.generate sets this).
        self.stream_outputs = True
        log.info("engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
                 time.perf_counter() - t0, self.model_ref, self.runner.device, self.runner.dtype,
                 num_blocks, args.block_size, self.max_model_len)

    # -- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)``; strings are encoded as ``tokenizer(prompt)`` would."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids as the prompt")
            self._check_text_length(len(prompt))
            self._check_unicode(prompt, "the prompt")
            try:
                return prompt, list(self.tokenizer.encode(prompt))
            except Exception as e:  # e.g. a lone UTF-16 surrogate the tokenizer cannot encode
                raise InvalidRequestError(f"the prompt cannot be tokenized (invalid Unicode?): {e}") from e
        return None, [int(t) for t in prompt]

    @staticmethod
    def _check_unicode(text: str, what: str) -> None:
        """Raises InvalidRequestError for text that is not valid Unicode (a lone UTF-16
        surrogate from a JSON ``\\ud800`` escape), which no tokenizer can encode."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(f"{what} is not valid Unicode: a lone surrogate "
                                      f"{text[e.start]!r} at character {e.start}") from None

    def _check_text_length(self, num_chars: int) -> None:
        """Refuse, without tokenizing it, text that cannot fit the context: no token covers more
        than ``L`` characters, L the longest vocabulary entry (twice that, for decoders that add
        characters), so ``num_chars > max_model_len * 2L`` means more tokens than the context.

        Raises:
            InvalidRequestError: the text is certainly too long.
        """
        if self._max_token_chars is None:
            try:
                self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
            except Exception:  # a tokenizer without a vocabulary listing: no early check
                self._max_token_chars = 0
        bound = self.max_model_len * 2 * self._max_token_chars
        if self._max_token_chars and num_chars > bound:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_chars} characters, more than {self.max_model_len} tokens of this tokenizer can hold")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, rendered with the tokenizer's chat template.

        Raises:
            InvalidRequestError: malformed messages, no chat template, or text certainly
                longer than the context.
        """
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise InvalidRequestError(f"model {self.served_model_name} has no chat template")
        self._check_text_length(sum(len(str(m.get("content") or "")) for m in messages))
        for i, m in enumerate(messages):
            self._check_unicode(str(m.get("content") or ""), f"messages[{i}].content")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model's limits; returns the effective max_tokens.

        Raises:
            InvalidRequestError: empty prompt, prompt or prompt+max_tokens beyond the
                context, token ids outside the vocabulary.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{n} tokens (at least one token must remain for the completion)")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        for what, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"and max_tokens is {max_tokens}, {n + max_tokens} in total")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens this request can generate "
                f"(maximum context length {self.max_model_len}, prompt {n} tokens)")
        need = -(-(n + 1) // self.args.block_size)
        if need > self.runner.num_kv_blocks:
            raise InvalidRequestError(
                f"the prompt needs {need} KV blocks but the cache has only {self.runner.num_kv_blocks}")
        return max_tokens

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id.  Raises InvalidRequestError (nothing queued)."""
        request_id = request_id or self.new_request_id()
        if request_id in self._parents:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            gen = None
            if params.seed is not None and not params.greedy:
                gen = torch.Generator(device=self.runner.device)
                gen.manual_seed(mix_seed(params.seed, i))
            req = Request(request_id=f"{request_id}#{i}", prompt_token_ids=list(ids), max_tokens=max_tokens,
                          arrival_time=arrival)
            if self.tokenizer is None and (params.detokenize or params.stop):
                params.detokenize = False
                if params.stop:
                    raise InvalidRequestError("stop strings need a tokenizer; this model has none")
            children.append(ChildSequence(
                index=i, request=req,
                detok=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop),
                generator=gen, logprobs=[] if params.logprobs is not None else None,
            ))
        parent = ParentRequest(request_id, text, list(ids), params, arrival, children)
        try:
            for c in children:  # validate every child before queueing any of them
                self.scheduler.check_request(c.request)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        for c in children:
            self.scheduler.add_request(c.request)
        self._parents[request_id] = parent
        if params.has_penalties:
            self._num_history_requests += 1
        for c in children:
            self._child_of[c.request.request_id] = (parent, c)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drop a request (client gone): frees its blocks; unknown or finished ids are ignored."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        if parent.params.has_penalties:
            self._num_history_requests -= 1
        for c in parent.children:
            self.scheduler.finish_request(c.request.request_id, RequestStatus.FINISHED_ABORTED)
            self._child_of.pop(c.request.request_id, None)
            if c.finish_reason is None:
                c.finish_reason = "abort"
        if self.stat_logger:
            self.stat_logger.on_finish(time.monotonic() - parent.arrival_time, len(parent.prompt_token_ids),
                                       sum(c.request.num_output_tokens for c in parent.children), "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_requests(self) -> int:
        return len(self._parents)

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return outputs of requests that progressed.

        With asynchronous scheduling, this plans and launches step N, then reads back and
        processes step N-1 (stop checks, detokenization) while step N runs on the device;
        the outputs returned are step N-1's.
        """
        if not self.async_scheduling:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            return self._process(out, self.runner.execute(out, self._sampling_rows(out)))
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._num_history_requests:
            outputs += self._drain()  # penalties read the previous token on the host
        out = self.scheduler.schedule()
        launched = None
        if out.scheduled:
            launched = (out, self.runner.execute_async(out, self._sampling_rows(out)))
        if self._in_flight is not None:
            outputs += self._drain()
        self._in_flight = launched
        return outputs

    def _drain(self) -> list[RequestOutput]:
        out, pending = self._in_flight
        self._in_flight = None
        return self._process(out, pending.result())

    def _sampling_rows(self, out: SchedulerOutput) -> dict[str, SamplingRow]:
        now = time.monotonic()
        rows: dict[str, SamplingRow] = {}
        for sr in out.scheduled:
            parent, child = self._child_of[sr.request.request_id]
            if not child.scheduled_logged:
                child.scheduled_logged = True
                if self.stat_logger and child.index == 0:
                    self.stat_logger.on_scheduled(now - parent.arrival_time)
            if sr.needs_sample:
                req = sr.request
                hist = req.output_token_ids
                if parent.params.has_penalties and req.num_output_placeholders:
                    hist = hist[: req.num_real_output_tokens]
                banned = None
                if parent.params.min_tokens:
                    # tokens generated before the one sampled now (async scheduling has already
                    # appended this step's placeholder)
                    before = len(req.output_token_ids) - (1 if self.scheduler.config.async_scheduling else 0)
                    if before < parent.params.min_tokens:
                        banned = list(parent.params.stop_token_ids)
                        if not parent.params.ignore_eos:
                            banned += sorted(self.eos_token_ids)
                rows[req.request_id] = SamplingRow(parent.params, parent.prompt_token_ids, hist, child.generator, banned)
        return rows

    def _process(self, out: SchedulerOutput, res: StepResult) -> list[RequestOutput]:
        """Apply a finished step: scheduler update, stop checks, detokenization, outputs."""
        self.scheduler.update_from_output(out, res.sampled)
        self.num_steps += 1
        now = time.monotonic()
        touched: dict[str, ParentRequest] = {}
        num_gen = 0
        num_prompt = 0
        for sr in out.scheduled:
            rid = sr.request.request_id
            tok = res.sampled.get(rid)
            pc = self._child_of.get(rid)
            if tok is None or pc is None or pc[1].request is not sr.request:
                continue  # no sample this step, or aborted (or its id reused) while in flight
            parent, child = pc
            if child.finish_reason is not None:  # stopped one step earlier: discard
                continue
            num_gen += 1
            if child.first_token_time is None and child.index == 0:
                num_prompt += len(parent.prompt_token_ids)
            self._on_token(parent, child, tok, res.logprobs.get(rid), now)
            touched[parent.request_id] = parent
        if self.stat_logger:
            self.stat_logger.on_step(num_prompt, num_gen)
        # Streaming consumers (the server) want every step's deltas; the offline API only
        # the finished requests, which saves building per-step outputs for every sequence.
        outputs = [p.make_output() for p in touched.values() if self.stream_outputs or p.finished]
        for p in touched.values():
            if p.finished:
                self._retire(p, now)
        return outputs

    def _on_token(self, parent: ParentRequest, child: ChildSequence, tok: int, lp, now: float) -> None:
        params = parent.params
        req = child.request
        if child.first_token_time is None:
            child.first_token_time = now
            if self.stat_logger and child.index == 0:
                self.stat_logger.on_first_token(now - parent.arrival_time)
        elif self.stat_logger and child.index == 0:
            self.stat_logger.on_token(now - child.last_token_time)
        child.last_token_time = now
        child.pending_tokens.append(tok)
        if lp is not None and child.logprobs is not None:
            sampled_lp, top = lp
            dec = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else str
            tl = TokenLogprobs(tok, sampled_lp, [Logprob(t, v, dec(t)) for t, v in top])
            child.logprobs.append(tl)
            child.pending_logprobs.append(tl)
        status = None
        if req.num_real_output_tokens < params.min_tokens:  # no stop before min_tokens (EOS/stop ids are masked)
            if params.detokenize:
                child.detok.add_token(tok, check_stop=False)
            if req.num_real_output_tokens >= req.max_tokens \
                    or req.num_prompt_tokens + req.num_real_output_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        elif not params.ignore_eos and tok in self.eos_token_ids:
            status, child.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif tok in params.stop_token_ids:
            status, child.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        else:
            matched = child.detok.add_token(tok) if params.detokenize else None
            if matched is not None:
                status, child.stop_reason = RequestStatus.FINISHED_STOPPED, matched
            elif (req.num_real_output_tokens >= req.max_tokens
                  or req.num_prompt_tokens + req.num_real_output_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if params.detokenize and (status == RequestStatus.FINISHED_LENGTH or child.stop_reason is None
                                      or isinstance(child.stop_reason, int)):
                child.detok.flush()
            child.finish_reason = status.finish_reason
            self.scheduler.finish_request(req.request_id, status)

    def _retire(self, p: ParentRequest, now: float) -> None:
        if self._parents.pop(p.request_id, None) is not None and p.params.has_penalties:
            self._num_history_requests -= 1
        for c in p.children:
            self._child_of.pop(c.request.request_id, None)
        if self.stat_logger:
            c0 = p.children[0]
            self.stat_logger.on_finish(now - p.arrival_time, len(p.prompt_token_ids),
                                       sum(c.request.num_output_tokens for c in p.children), c0.finish_reason or "stop")
