"""Engine-wide settings (the flags of ``kiln serve`` / arguments of ``LLM``).

One of the two entry points (with the CLI) that read the environment: ``KILN_CPU_THREADS``
(``env_cpu_threads``) is the default of ``EngineArgs.cpu_threads`` and of ``kiln build``'s
thread count; ``KILN_CACHE_DIR`` (``env_cache_dir``) is where converted models and the
synthetic tokenizers are kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.kernels.options import KernelOptions


def env_cpu_threads() -> int | None:
    """``KILN_CPU_THREADS`` as a positive integer, None when unset, empty or 0.

    Raises:
        ValueError: a value that is not a non-negative integer.
    """
    raw = os.environ.get("KILN_CPU_THREADS", "").strip()
    try:
        value = int(raw or 0)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"KILN_CPU_THREADS must be a non-negative integer, got {raw!r}")
    return value or None


def env_cache_dir() -> Path:
    """``$KILN_CACHE_DIR``, else ``~/.cache/kiln``."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def env_hub_options(download_dir: str | None = None):
    """The Hugging Face Hub options from the environment: ``HF_ENDPOINT`` (a mirror),
    ``HF_TOKEN``, and the download cache ``download_dir`` or ``$HF_HUB_CACHE`` or
    ``$HF_HOME/hub`` (None: huggingface_hub's default, ``~/.cache/huggingface/hub``)."""
    from .hub import HubOptions  # noqa: PLC0415

    cache = download_dir or os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    return HubOptions(endpoint=(os.environ.get("HF_ENDPOINT") or "").strip().rstrip("/") or None,
                      token=(os.environ.get("HF_TOKEN") or "").strip() or None,
                      cache_dir=Path(cache).expanduser() if cache else None)


@dataclass
class EngineArgs:
    """Everything needed to start an engine.

    Units: tokens for lengths and budgets, blocks for ``num_kv_blocks``, a fraction of
    total device memory for ``kv_cache_memory_fraction`` (CUDA), bytes for
    ``cpu_kv_cache_bytes`` (CPU pool size when ``num_kv_blocks`` is not given).
    """

    model: str | None = None  # builtin:<name>, a .gguf file or a HF folder
    engine: str | None = None  # a Kiln engine folder (from ``kiln build``)
    # hash every weight file of ``engine`` against its manifest at load (sizes are always checked)
    verify_checksums: bool = True
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    # None: the serving default (64 sequences, 2048 tokens), capped by an engine's build limits
    # (max_batch_size, max_num_tokens); an explicit value above an engine's limit is an error
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.85
    num_kv_blocks: int | None = None
    cpu_kv_cache_bytes: int = 1 << 30
    scheduler_policy: str = "max_utilization"
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | dummy (random weights of the model's shape)
    # With load_format dummy only: quantize the random weights at load by rounding to nearest
    # (none | fp8 | int8-smoothquant | int4-awq | int4-gptq; int4 groups of 128 columns), so a
    # benchmark runs the quantized kernels without an engine.  A real model is quantized by
    # ``kiln build``; an engine carries its own quantization.
    quantization: str = "none"
    # auto: the model dtype, or an engine's own FP8 KV cache (kiln build --kv-cache-dtype fp8).
    # fp8: an FP8 (E4M3) KV cache, half the bytes per token: an engine built with calibrated
    # KV scales, or random weights (load_format dummy) with scales set for their init.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    # How to reach the Hugging Face Hub for a ``model`` ``hf://org/name[@rev]`` or ``org/name``
    # (a ``hub.HubOptions``; default: HF_ENDPOINT, HF_TOKEN, HF_HOME from env_hub_options)
    hub: Any = field(default_factory=env_hub_options)
    enable_cuda_graphs: bool = True
    # Compile the Triton kernel variants serving can reach at start-up (CUDA; ModelRunner.
    # warmup_kernels), so no request waits for a JIT compile.
    kernel_warmup: bool = True
    # Plan and launch step N+1 while step N runs on the device (sampled ids stay on the
    # device; the host reads them one step later).  Requests with repetition / presence /
    # frequency penalties make the steps they are in synchronous.  None (default): on for a
    # CUDA device, off on the CPU, where the forward pass runs inside the launch call, so
    # nothing overlaps and every token would reach its client one step late.  True / False
    # force it (tests run the asynchronous path on the CPU).
    async_scheduling: bool | None = None
    # CPU intra-op threads for torch (None: torch's default, one per core).  On a loaded
    # machine 1 avoids OpenMP barrier thrash.  Default: KILN_CPU_THREADS (env_cpu_threads).
    cpu_threads: int | None = field(default_factory=env_cpu_threads)
    # Kernel choices (CUDA), turned into one KernelOptions at engine start (kernel_options()):
    # programmatic dependent launch on Hopper; rotary embedding and KV-cache write in one
    # kernel; the token count from which an int4 GEMM dequantizes its weight for cuBLAS.
    pdl: bool = True
    # Ranks of tensor parallelism (one process each; rank 0 is the engine core): NCCL on CUDA,
    # gloo on the CPU (``distributed.parallel``).
    tensor_parallel_size: int = 1
    fused_rope_kv: bool = True
    w4a16_dequant_min_m: int = 65
    # Multi-LoRA serving (``kiln.runtime.lora``): adapters loaded at start (``{name: PEFT
    # folder}``), device slots (``max_loras``: distinct adapters per step), the slots' rank
    # (``max_lora_rank``, 1..64) and the host cache (``max_cpu_loras``; None: max_loras).
    # LoRA is on when ``enable_lora`` is set or ``lora_modules`` is not empty.
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # ``lora_dir``: adapter paths (``lora_modules``, the load API) resolve under it and may not
    # leave it.  ``lora_modules_file``: a JSON object ``{name: folder}`` of adapters loaded at
    # start where each one that cannot be served is skipped with a warning (the operator's
    # list, which it also loads and reports itself); ``lora_modules`` must all load.
    lora_dir: str | None = None
    lora_modules_file: str | None = None
    # Structured output: a grammar still compiling this many seconds after its request
    # arrived is refused (HTTP 400).
    grammar_compile_timeout: float = 10.0
    # Speculative decoding (``kiln.runtime.spec_decode``): ``speculative_method`` ngram |
    # draft | eagle (None: off); drafts per step (None: 4); the draft model or EAGLE head
    # (``draft``/``eagle``: a model source, or an engine folder for ``draft``); the n-gram
    # window (tokens); running sequences above which the engine decodes without drafts
    # (None: the measured default per method, ``spec_decode.config``).
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model: str | None = None
    prompt_lookup_min: int | None = None  # None: 2 (ngram only)
    prompt_lookup_max: int | None = None  # None: 5 (ngram only)
    speculative_disable_by_batch_size: int | None = None

    @property
    def speculative(self):
        """The ``SpeculativeConfig`` of the speculative fields, or None when off
        (ValueError for an invalid combination)."""
        from .spec_decode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig  # noqa: PLC0415

        lookup = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if self.speculative_method is None:
            if self.speculative_model or self.num_speculative_tokens is not None or lookup \
                    or self.speculative_disable_by_batch_size is not None:
                raise ValueError("speculative_model / num_speculative_tokens / prompt_lookup_min / "
                                 "prompt_lookup_max / speculative_disable_by_batch_size need speculative_method "
                                 "(ngram, draft or eagle)")
            return None
        if lookup and self.speculative_method != "ngram":
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max apply to speculative method ngram only, not "
                             f"{self.speculative_method}")
        return SpeculativeConfig(
            self.speculative_method,
            DEFAULT_NUM_SPECULATIVE_TOKENS if self.num_speculative_tokens is None else self.num_speculative_tokens,
            self.speculative_model, 2 if self.prompt_lookup_min is None else self.prompt_lookup_min,
            5 if self.prompt_lookup_max is None else self.prompt_lookup_max, self.speculative_disable_by_batch_size)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules) or self.lora_modules_file is not None

    def lora_config(self):
        """The engine's ``LoRAConfig`` (ValueError for an out-of-range field)."""
        from .lora.manager import LoRAConfig  # noqa: PLC0415  (torch)

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, root=self.lora_dir)

    def lora_modules_from_file(self) -> dict[str, str]:
        """``lora_modules_file``'s ``{name: folder}`` (empty without one).  Raises ValueError
        naming the flag for a file that is missing or not such an object."""
        import json  # noqa: PLC0415

        if self.lora_modules_file is None:
            return {}
        try:
            data = json.loads(Path(self.lora_modules_file).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--lora-modules-file {self.lora_modules_file}: cannot be read as JSON ({e})") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                 for k, v in data.items()):
            raise ValueError(f"--lora-modules-file {self.lora_modules_file}: expected a JSON object "
                             '{"name": "folder", ...} of non-empty strings')
        return data

    def kernel_options(self) -> KernelOptions:
        """The engine's ``KernelOptions`` (ValueError for an out-of-range field)."""
        return KernelOptions(pdl=self.pdl, fused_rope_kv=self.fused_rope_kv,
                             w4a16_dequant_min_m=self.w4a16_dequant_min_m)

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be at least 1 (leave it out for one thread per core), "
                             f"got {self.cpu_threads}")
        if isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.model and self.engine:
            raise ValueError("give either model or engine, not both")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.engine and self.load_format == "dummy":
            raise ValueError("load_format dummy (random weights of a model's shape) applies to a model, not to an "
                             "engine, whose weights are always loaded")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.scheduler_policy not in ("max_utilization", "guaranteed_no_evict"):
            raise ValueError(
                f"scheduler_policy must be max_utilization or guaranteed_no_evict, got {self.scheduler_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        self._check_quantization()
        self._check_kv_cache_dtype()
        if self.lora_enabled:
            self.lora_config()  # refuses max_loras < 1, a rank outside 1..64, too few cpu loras, no lora_dir
        elif self.lora_dir is not None:
            raise ValueError("lora_dir applies to LoRA serving: add enable_lora (or lora_modules)")
        self.kernel_options()  # refuses a w4a16_dequant_min_m below 1
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive (seconds), got {self.grammar_compile_timeout}")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding is not served with tensor_parallel_size > 1 yet (the "
                             "workers verify no drafts)")


    def _check_kv_cache_dtype(self) -> None:
        """``fp8`` needs KV scales: an engine's (checked against its manifest at load) or the
        random init's (ValueError for a model loaded from a checkpoint)."""
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8" and not self.engine and self.load_format != "dummy":
            raise ValueError("kv_cache_dtype fp8 needs calibrated KV scales: build an engine with `kiln build "
                             "--kv-cache-dtype fp8` and serve it (--engine), or use random weights (load_format "
                             "dummy)")

    def _check_quantization(self) -> None:
        """Quantization at load is for random weights only (ValueError otherwise)."""
        from .quantization.base import METHODS  # noqa: PLC0415  (torch; only when an engine starts)

        if self.quantization not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {self.quantization!r}")
        if self.quantization == "none":
            return
        if self.engine:
            raise ValueError(f"quantization {self.quantization} applies to random weights (load_format dummy); an "
                             "engine carries its own quantization (kiln build --quantization)")
        if self.load_format != "dummy":
            raise ValueError(f"quantization {self.quantization} at load applies only to random weights "
                             f"(load_format dummy); quantize a real model with `kiln build --quantization "
                             f"{self.quantization}` and serve the engine")


DEFAULT_MAX_NUM_SEQS = 64  # sequences per step when neither the flag nor an engine says
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step, likewise


def resolve_batch_limits(args: EngineArgs, limits: dict | None = None) -> EngineArgs:
    """``args`` with ``max_num_seqs`` and ``max_num_batched_tokens`` set.

    ``limits`` is an engine manifest's ``limits`` (``max_batch_size``, ``max_num_tokens``;
    None or {} for a model served directly).  A value left None becomes the serving default
    (64 sequences, 2048 tokens) capped by the engine's limit; an explicit value above the
    limit is refused, as TensorRT-LLM's runtime refuses a batch larger than its engine's.

    Raises:
        ValueError: an explicit value above the engine's build limit (names both flags).
    """
    limits = limits or {}
    resolved = {}
    for field, default, key, flag, build in (
            ("max_num_seqs", DEFAULT_MAX_NUM_SEQS, "max_batch_size", "--max-num-seqs",
             "--max-batch-size / build.maxBatchSize"),
            ("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS, "max_num_tokens",
             "--max-num-batched-tokens", "--max-num-tokens / build.maxNumTokens")):
        value, limit = getattr(args, field), int(limits.get(key) or 0)
        if value is None:
            value = min(default, limit) if limit else default
        elif limit and value > limit:
            raise ValueError(f"{flag} {value} is larger than the engine's build limit {limit} ({build}); "
                             f"rebuild the engine with a larger limit or serve at most {limit}")
        resolved[field] = value
    return replace(args, **resolved)
