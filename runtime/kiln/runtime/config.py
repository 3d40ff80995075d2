"""Engine-wide settings (the flags of ``kiln serve`` / arguments of ``LLM``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    """Everything needed to start an engine.

    Units: tokens for lengths and budgets, blocks for ``num_kv_blocks``, a fraction of
    total device memory for ``kv_cache_memory_fraction`` (CUDA), bytes for
    ``cpu_kv_cache_bytes`` (CPU pool size when ``num_kv_blocks`` is not given).
    """

    model: str | None = None  # builtin:<name>, a .gguf file or a HF folder
    engine: str | None = None  # a Kiln engine folder (from ``kiln build``)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.85
    num_kv_blocks: int | None = None
    cpu_kv_cache_bytes: int = 1 << 30
    scheduler_policy: str = "max_utilization"
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # auto | dummy (random weights of the model's shape)
    seed: int = 0
    served_model_name: str | None = None
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
    # machine 1 avoids OpenMP barrier thrash.  Env: KILN_CPU_THREADS.
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
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
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.scheduler_policy not in ("max_utilization", "guaranteed_no_evict"):
            raise ValueError(
                f"scheduler_policy must be max_utilization or guaranteed_no_evict, got {self.scheduler_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
