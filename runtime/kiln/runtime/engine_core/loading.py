"""Loading a model (a source or a ``kiln build`` engine folder) into a ready model runner:
weights, KV pool, kernel warm-up and CUDA graphs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .. import loader
from ..config import EngineArgs, resolve_batch_limits
from ..model.config import ModelConfig
from ..model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model runner with its weights and KV pool, and what the processors need to know.

    Fields:
        args: the engine settings with the batch limits resolved.
        runner: the model runner (weights loaded, KV cache allocated, graphs captured).
        model_config: the architecture.
        model_ref: the source's spelling, or the engine's.
        max_model_len: the served context (tokens).
        eos_token_ids: the model's and the tokenizer's end-of-sequence ids.
        tokenizer: the transformers tokenizer (None: token ids only).
        tokenizer_source: how another process loads the same tokenizer (``CoreInfo.tokenizer``).
        load_seconds: wall time of the load.
    """

    args: EngineArgs
    runner: ModelRunner
    model_config: ModelConfig
    model_ref: str
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer: object
    tokenizer_source: tuple[str, str]
    load_seconds: float


def check_max_model_len(args: EngineArgs, cfg: ModelConfig) -> None:
    """Raises ValueError when ``max_model_len`` is below 2 or exceeds the model's context (vLLM
    refuses that too: positions past the trained RoPE range give garbage), before any weight
    is loaded.  None means the default."""
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 (a prompt token and a generated one), "
                         f"got {args.max_model_len}")
    if args.max_model_len and args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {args.max_model_len} is larger than the model's context length "
                         f"({cfg.max_position_embeddings} tokens, max_position_embeddings)")


def load_tokenizer(source: tuple[str, str]):
    """The tokenizer a :class:`LoadedModel` names in ``tokenizer_source`` (for the API
    processes, which load it themselves).  Raises ModelSourceError for an unreadable one."""
    kind, where = source
    if kind == "engine":
        from ..engine_folder import open_engine  # noqa: PLC0415

        return open_engine(where, verify=False).load_tokenizer()
    if kind == "source":
        return loader.load_tokenizer(loader.materialize_gguf(loader.resolve_source(where)))
    return None


def load_model(args: EngineArgs, tp=None, catch_up_rows: int = 0) -> LoadedModel:
    """Load weights, size and allocate the KV pool, warm the kernels up, capture graphs.

    ``catch_up_rows``: a draft model's multi-token graphs (``DecodeGraphs.run_verify_rows``)
    of up to that many rows per sequence, for its catch-up forwards (0: none).

    The served context is ``max_model_len`` (default: min(model's context, 4096), capped by an
    engine's build ``max_seq_len``).  When the KV pool cannot hold one sequence of that
    length, an explicit ``max_model_len`` is refused with the numbers, and the default is
    capped to what the pool holds (logged).

    With ``args.tensor_parallel_size > 1`` rank 0 (``tp`` None) checks the sizes, starts the
    worker ranks (``distributed.parallel.start_workers``), and every rank loads its shard.

    Raises:
        ModelSourceError, UnsupportedModelError, ValueError: bad model or settings.
    """
    t0 = time.perf_counter()
    if args.tensor_parallel_size > 1 and tp is None:
        tp = _start_tensor_parallel(args)
    engine_limit = 0  # an engine's build max_seq_len (tokens)
    if args.engine:
        from ..engine_folder import open_engine  # noqa: PLC0415  (kiln build's output)

        eng = open_engine(args.engine, verify=args.verify_checksums)
        if args.kv_cache_dtype == "fp8" and eng.kv_cache_dtype != "fp8":
            raise ValueError(f"engine {args.engine} has no FP8 KV scales (built with --kv-cache-dtype "
                             f"{eng.kv_cache_dtype}): rebuild it with `kiln build --kv-cache-dtype fp8`, or serve "
                             f"it with --kv-cache-dtype auto")
        cfg: ModelConfig = eng.model_config
        check_max_model_len(args, cfg)
        # the engine's build limit (TensorRT-LLM's max_seq_len): serve at most that context
        engine_limit = int((eng.manifest.get("limits") or {}).get("max_seq_len") or 0)
        if engine_limit and args.max_model_len and args.max_model_len > engine_limit:
            raise ValueError(f"max_model_len {args.max_model_len} is larger than the engine's build limit "
                             f"({engine_limit} tokens, build max_seq_len / build.maxSeqLen); rebuild with a "
                             f"larger --max-seq-len or serve a shorter context")
        args = resolve_batch_limits(args, eng.manifest.get("limits"))
        tokenizer = eng.load_tokenizer()
        tok_source = ("engine", str(args.engine))
        model_ref = eng.model_ref
        runner = ModelRunner(cfg, args, tp)
        eng.load_into(runner)
    else:
        args = resolve_batch_limits(args)
        src = loader.materialize_gguf(loader.resolve_source(args.model))
        model_ref = src.ref
        cfg = loader.load_model_config(src)
        check_max_model_len(args, cfg)
        tokenizer = loader.load_tokenizer(src)
        tok_source = ("source", str(args.model or loader.DEFAULT_MODEL)) if tokenizer is not None else ("none", "")
        cq = loader.checkpoint_quantization(src) if args.load_format != "dummy" else None
        runner = ModelRunner(cfg, args, tp)
        if args.load_format == "dummy":
            runner.init_dummy_weights(args.seed)
        elif cq is not None:  # compressed-tensors / GPTQ / AWQ: served in its own format
            loader.load_prequantized(runner.model, src, cq)
        else:
            runner.load_weights(loader.iter_weights(src))
    if args.lora_enabled:
        runner.enable_lora(args.lora_config())
        for name, path in args.lora_modules.items():
            runner.lora.add_adapter(name, path)  # LoRAError (a ValueError): exit 2 at start
        _load_listed_adapters(runner.lora, args)
    max_model_len = min(args.max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
    if engine_limit:
        max_model_len = min(max_model_len, engine_limit)
    num_blocks = runner.profile_num_kv_blocks()
    capacity = num_blocks * args.block_size
    if capacity < max_model_len:
        if args.max_model_len:
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens = {capacity} "
                             f"tokens, fewer than max_model_len {args.max_model_len}: raise --num-kv-blocks "
                             f"(or --kv-cache-memory-fraction) or lower --max-model-len")
        log.warning("the KV cache holds %d tokens (%d blocks of %d); serving a context of %d tokens instead of %d",
                    capacity, num_blocks, args.block_size, capacity, max_model_len)
        max_model_len = capacity
    runner.allocate_kv_cache(num_blocks)
    if args.kernel_warmup:
        runner.warmup_kernels(args.max_num_batched_tokens, max_model_len, args.max_num_seqs)
    runner.capture_cuda_graphs(max_model_len, catch_up_rows)
    eos = set(cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    log.info("model loaded in %.1fs: %s on %s/%s, %d KV blocks of %d tokens (%s), max_model_len %d",
             time.perf_counter() - t0, model_ref, runner.device, runner.dtype, num_blocks, args.block_size,
             str(runner.kv_cache_dtype()).removeprefix("torch."), max_model_len)
    return LoadedModel(args, runner, cfg, model_ref, max_model_len, sorted(eos), tokenizer, tok_source,
                       time.perf_counter() - t0)


def _start_tensor_parallel(args: EngineArgs):
    """Check that the model splits over the ranks (before any weight is read: the rule the
    operator checks too, ``kiln.common.tensorparallel``), then start the workers.  Raises
    ValueError for too few GPUs, or a size the model's heads, MLP or int4 groups do not split."""
    from kiln.common.tensorparallel import ParallelShape, check_tensor_parallel  # noqa: PLC0415

    from ..distributed import parallel  # noqa: PLC0415
    from ..model_runner import resolve_device  # noqa: PLC0415

    parallel.check_devices(args.device, args.tensor_parallel_size)
    if args.engine:
        from ..engine_folder import open_engine  # noqa: PLC0415

        shape = ParallelShape.from_manifest(open_engine(args.engine, verify=False).manifest)
    else:
        src = loader.materialize_gguf(loader.resolve_source(args.model))
        cfg = loader.load_model_config(src)
        cq = loader.checkpoint_quantization(src) if args.load_format != "dummy" else None
        group = cq.group_size if cq is not None and cq.method == "int4" else None
        if group == 0:
            raise ValueError(f"{src.ref}: a per-channel int4 checkpoint (one group per row) is served at "
                             f"tensor-parallel size 1 only, not {args.tensor_parallel_size}: quantize it with a "
                             f"group size")
        shape = ParallelShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                              group)
    check_tensor_parallel(shape, args.tensor_parallel_size)
    return parallel.start_workers(args, resolve_device(args.device), load_model)


def _load_listed_adapters(lora, args) -> None:
    """The adapters of ``--lora-modules-file`` (read here, at start: ValueError for a bad
    file): each that cannot be served is skipped with a warning naming its reason, so the base
    model serves whatever an operator's list holds (the operator reports the failure)."""
    from ..lora import LoRAError  # noqa: PLC0415

    for name, path in args.lora_modules_from_file().items():
        if name in args.lora_modules:
            continue  # given on the command line too: loaded above
        if name == args.served_model_name:
            log.warning("LoRA adapter %s from %s skipped: it has the base model's name", name, args.lora_modules_file)
            continue
        try:
            lora.add_adapter(name, path)
        except LoRAError as e:
            log.warning("LoRA adapter %s from %s skipped: %s: %s", name, args.lora_modules_file, e.reason, e)

