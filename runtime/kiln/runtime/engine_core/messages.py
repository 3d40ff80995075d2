"""What crosses the ZeroMQ boundary between API server processes and the engine core.

Every message is one msgpack frame (msgspec), tagged by its type; structs are encoded as
arrays (``array_like``) so a step's outputs for a few hundred sequences stay a few KB.

Client -> core: :class:`AddRequests`, :class:`AbortRequests`, :class:`ApiStats`, :class:`Shutdown`.
Core -> client: :class:`CoreOutputs` (one per step, per client that owns a request in it).

Times are ``time.monotonic()`` seconds: CLOCK_MONOTONIC is system-wide on Linux, so an
arrival time stamped in an API process is comparable with the core's clocks.
"""

from __future__ import annotations

import msgspec

from ..sampling_params import SamplingParams


class CoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence for the engine core (a request with ``n`` completions is ``n`` of these,
    ids ``<request id>#<index>``).

    Fields:
        request_id: unique among the core's live requests.
        prompt_token_ids: the prompt, already validated against the vocabulary and context.
        params: sampling settings (``n`` is handled by the API process).
        max_tokens: tokens to generate at most (resolved from ``params`` and the context).
        arrival_time: when the HTTP request arrived (monotonic seconds).
        seed: this sequence's generator seed (None: the shared generator).
        record_metrics: count this sequence in the request histograms (the first
            completion of a request only, so ``n > 1`` counts one request).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    seed: int | None = None
    record_metrics: bool = True
    # The LoRA adapter (its name) that computes this sequence; None: the base model.
    lora_name: str | None = None


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Abort these sequences now (blocks freed before the next step).  ``finish_reason`` is
    what the request's metrics record: "abort" (client gone) or "stop" (a stop string
    matched in the API process)."""

    request_ids: list[str]
    finish_reason: str = "abort"


class ApiStats(msgspec.Struct, tag=True, array_like=True):
    """Counters an API process adds to the core's metrics (deltas since its last report)
    and its own resource use (absolute).

    Fields:
        process: the API process's label ("api-0", "api-1", ...).
        failures: ``{reason: count}`` of requests that failed in the API process.
        detokenize_seconds: time spent detokenizing and checking stop strings.
        cpu_seconds: the process's user + system CPU time so far.
        rss_bytes: the process's resident memory.
    """

    process: str
    failures: dict[str, int]
    detokenize_seconds: float
    cpu_seconds: float
    rss_bytes: int


class LoRAControl(msgspec.Struct, tag=True, array_like=True):
    """Load (``op`` "load", from the PEFT folder ``path``) or unload (``op`` "unload") the
    LoRA adapter ``name``; the core answers the sender with a :class:`LoRAReply` carrying
    ``token``, and sends every client the new adapter list."""

    token: int
    op: str
    name: str
    path: str = ""


class LoRAAdapter(msgspec.Struct, array_like=True):
    """One loaded adapter, as ``/v1/models`` lists it (``created``: Unix seconds)."""

    name: str
    path: str
    rank: int
    created: int


class LoRAReply(msgspec.Struct, array_like=True):
    """The answer to a :class:`LoRAControl`: HTTP ``status`` (200, 400, 404), a
    ``message`` and the adapter error's ``reason`` (``NotFound``, ``RankTooLarge``, ...)."""

    token: int
    status: int
    message: str
    reason: str = ""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop the core (after this message nothing more is read)."""


ClientMessage = AddRequests | AbortRequests | ApiStats | LoRAControl | Shutdown


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence got in one step.

    Fields:
        request_id: the sequence (``<request id>#<index>``).
        new_token_ids: tokens sampled this step (one per step today).
        new_logprobs: per new token ``(sampled logprob, [(token id, logprob), ...])`` from the
            model's raw distribution when ``params.logprobs`` is set, else None.
        finish_reason: "stop" (EOS or a stop token id), "length", or None while running.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        first_scheduled_time: when the core first scheduled it (monotonic seconds).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


class Rejected(msgspec.Struct, array_like=True):
    """A sequence the core refused at admission; ``message`` says why (an HTTP 400)."""

    request_id: str
    message: str
    status: int = 400  # 404: the request names a LoRA adapter that is not loaded


class CoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One step's results for one client, and admissions since the last message.

    Fields:
        outputs: sequences that progressed.
        accepted: ids of sequences admitted since the last message.
        rejected: sequences refused since the last message.
        timestamp: when the core sent it (monotonic seconds).
        lora_reply: the answer to this client's ``LoRAControl``, if any.
        lora_adapters: the loaded LoRA adapters, sent when they changed (None: unchanged).
    """

    outputs: list[CoreOutput] = []
    accepted: list[str] = []
    rejected: list[Rejected] = []
    timestamp: float = 0.0
    lora_reply: LoRAReply | None = None
    lora_adapters: list[LoRAAdapter] | None = None


class CoreInfo(msgspec.Struct):
    """What the core tells the API processes once it is ready (the handshake).

    Fields:
        served_model_name: the name clients use.
        model_ref: the source's spelling (``builtin:...``, a path).
        max_model_len: the served context (tokens).
        vocab_size: the model's vocabulary size (token ids are below it).
        num_kv_blocks: KV pool size (blocks); block_size: tokens per block.
        max_num_seqs / max_num_batched_tokens: the scheduler's budgets.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        tokenizer: how the API process loads the same tokenizer: ``("engine", folder)``,
            ``("source", ref)``, ``("synthetic", vocab_size)`` or ``("none", "")``.
        pid: the core process's id (the API processes watch it).
        startup_seconds: model load + warm-up time.
    """

    served_model_name: str
    model_ref: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: list[int]
    tokenizer: tuple[str, str]
    pid: int = 0
    startup_seconds: float = 0.0
    lora_enabled: bool = False  # --enable-lora / --lora-modules
    lora_adapters: list[LoRAAdapter] = []  # the adapters loaded at start


_ENCODER = msgspec.msgpack.Encoder()
_CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
_CORE_DECODER = msgspec.msgpack.Decoder(CoreOutputs)


def encode(msg: msgspec.Struct) -> bytes:
    """One message as msgpack bytes."""
    return _ENCODER.encode(msg)


def decode_client_message(data: bytes) -> ClientMessage:
    """Raises msgspec.DecodeError / ValidationError for a malformed frame."""
    return _CLIENT_DECODER.decode(data)


def decode_core_outputs(data: bytes) -> CoreOutputs:
    """Raises msgspec.DecodeError / ValidationError for a malformed frame."""
    return _CORE_DECODER.decode(data)
