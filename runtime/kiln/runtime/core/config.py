"""Scheduler configuration: the knobs of the scheduling core (budgets, KV pool, policy).

Plain Python with no torch import.  Only what the scheduler and the KV cache manager
need lives here (vLLM V1 warns against one giant config every module depends on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Scheduling policies.  ``max_utilization`` admits eagerly and preempts (recompute) the
#: newest running request when KV blocks run out; ``guaranteed_no_evict`` admits a
#: request only if its whole future (prompt + max_tokens) fits next to the reservations of
#: all running requests, so nothing is ever preempted (TensorRT-LLM's two capacity
#: scheduler policies, ``MAX_UTILIZATION`` and ``GUARANTEED_NO_EVICT``).
POLICIES = ("max_utilization", "guaranteed_no_evict")


@dataclass
class SchedulerConfig:
    """Budgets and KV pool shape for :class:`kiln.runtime.core.scheduler.Scheduler`.

    All lengths are in tokens, pool sizes in blocks.  ``num_kv_blocks`` is required and
    keyword-only (it comes from the model runner's memory profiling or ``--num-kv-blocks``).

    Raises:
        ValueError: in ``__post_init__`` when a field is out of range or ``policy`` is
            unknown; the message carries the offending value.
    """

    max_num_seqs: int = 256  # most requests scheduled in one step (sequences)
    max_num_batched_tokens: int = 2048  # token budget per step: prefill chunks + decodes (tokens)
    max_model_len: int = 2048  # most tokens (prompt + output) of one request (tokens)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = field(kw_only=True)  # KV pool size (blocks); required
    policy: str = "max_utilization"  # one of POLICIES
    enable_prefix_caching: bool = True  # reuse hash-matched full blocks across requests
    # Asynchronous scheduling: ``schedule`` advances ``num_computed_tokens`` and appends a
    # placeholder for each token to sample, so the next step can be planned while this one
    # runs on the device; ``update_from_output`` fills the placeholders in.
    async_scheduling: bool = False
    # Most distinct LoRA adapters among running requests (the device slots; 0: no LoRA).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"SchedulerConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
            if value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {value}")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {list(POLICIES)}, got {self.policy!r}")

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the whole KV pool can hold (``num_kv_blocks * block_size``)."""
        return self.num_kv_blocks * self.block_size
