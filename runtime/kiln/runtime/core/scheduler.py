"""In-flight (continuous) batching scheduler with chunked prefill and preemption.

The top layer (**Scheduler** -> KVCacheManager -> BlockPool), shaped after vLLM V1's
``vllm/v1/core/sched/scheduler.py``: one token budget per step, no separate prefill and
decode phases.  Each step:

  1. Running requests, oldest first, get ``min(tokens left to compute, budget left)``
     tokens: 1 for a decode, a chunk for a prefill still in progress.  When the KV pool
     cannot hold them, the *newest* running request is preempted (recompute: its blocks
     are freed and it goes back to the front of the waiting queue, keeping its output
     tokens) and the allocation is retried (``max_utilization``).
  2. If nothing was preempted, waiting requests are admitted first come first served
     while ``max_num_seqs`` and the budget allow, starting from their cached prefix
     (prefix caching).  The queue head blocks those behind it (no starvation).

Policies (TensorRT-LLM's capacity scheduler): ``max_utilization`` admits whenever this
step's blocks fit; ``guaranteed_no_evict`` admits only when the request's whole future
(prompt + max_tokens) fits beside the future needs of every running request, so running
requests never need preemption.

Stop conditions are not decided here: after ``update_from_output`` the engine calls
``finish_request``.  Plain Python, no torch import.

Asynchronous scheduling (``async_scheduling``; vLLM V1's async scheduling, SGLang's overlap
scheduler): ``schedule`` itself advances ``num_computed_tokens`` and appends a placeholder
token for every request that samples, so step N+1 can be planned and launched while step N
still runs on the device (its decode inputs are read from step N's sampled ids on the
device).  ``update_from_output`` later fills the placeholders and registers full blocks in
the prefix cache.  A request is not scheduled past ``max_tokens``; a request that stops on
EOS or a stop string computes one discarded extra token.

Speculative decoding (vLLM V1's layout: proposers outside, verification in the sampler,
rollback here): a decoding request whose ``spec_token_ids`` holds drafts computes its last
token and up to ``k`` drafts in one step (``k`` capped by the token budget and by
``max_tokens``), with KV slots allocated for all of them.  ``update_from_output`` then gets
the verified run (the accepted drafts and one token from the target) and advances
``num_computed_tokens`` by its length only; blocks allocated past the verified tokens go back
to the pool (``KVCacheManager.trim``) and only fully verified blocks reach the prefix cache.
Steps that verify drafts are planned synchronously (``schedule(async_step=False)``).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from .config import SchedulerConfig
from .kv_cache_manager import KVCacheManager, cdiv
from .request import Request, RequestStatus
from .sched_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    Sources: vLLM V1 ``Scheduler`` (token budget, ``allocate_slots`` or preempt-newest
    loop), nano-vllm ``Scheduler`` (waiting/running deques, preempt to the front),
    TensorRT-LLM (``MAX_UTILIZATION`` / ``GUARANTEED_NO_EVICT``).

    Usage per step: ``out = schedule()``; run the model on ``out.scheduled``;
    ``update_from_output(out, {request_id: sampled_token})``; then ``finish_request`` for
    requests that hit a stop condition.  Call ``update_from_output`` before the next
    ``schedule``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        """Create the scheduler and its :class:`KVCacheManager` (``kv_cache_manager``)."""
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        # Unfinished requests by id (waiting, preempted or running).
        self.requests: dict[str, Request] = {}
        # Queue of requests to admit; preempted requests are put at the front.
        self.waiting: deque[Request] = deque()
        # Running requests in admission order (oldest first; the newest is preempted first).
        self.running: list[Request] = []
        self._num_preemptions_total = 0
        if config.kv_pool_tokens < config.max_model_len:
            logger.warning(
                "KV pool holds %d tokens (%d blocks of %d) < max_model_len %d: requests whose prompt + "
                "max_tokens exceed the pool are rejected by add_request",
                config.kv_pool_tokens, config.num_kv_blocks, config.block_size, config.max_model_len,
            )

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests holding KV blocks and being stepped (sequences)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, including preempted ones (sequences)."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of KV blocks referenced by requests."""
        return self.kv_cache_manager.usage

    @property
    def num_preemptions_total(self) -> int:
        """Preemptions (recompute) since start."""
        return self._num_preemptions_total

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def max_blocks_needed(self, request: Request) -> int:
        """Blocks the request holds at most over its life (blocks): KV of prompt +
        max_tokens - 1 tokens (the last sampled token is never computed)."""
        max_kv_tokens = max(request.max_num_tokens - 1, request.num_tokens)
        return cdiv(max_kv_tokens, self.config.block_size)

    # ---- requests in and out --------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise if ``add_request`` would reject this request; queue nothing.

        Raises:
            ValueError: empty prompt; ``max_tokens < 1``; prompt + max_tokens longer than
                ``max_model_len``; or a request whose whole future cannot fit the KV pool
                even alone ("needs N KV blocks ..., pool has M blocks") — it would never
                finish.
        """
        cfg = self.config
        rid = request.request_id
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid}: empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens must be >= 1, got {request.max_tokens}")
        if request.max_num_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {request.max_num_tokens} tokens exceeds max_model_len "
                f"{cfg.max_model_len}"
            )
        need = self.max_blocks_needed(request)
        if need > cfg.num_kv_blocks:
            raise ValueError(
                f"the request needs {need} KV blocks of {cfg.block_size} tokens (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} tokens), but the pool "
                f"has {cfg.num_kv_blocks} blocks ({cfg.kv_pool_tokens} tokens)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING, at the back of the queue).

        Raises:
            ValueError: a duplicate request id, or anything ``check_request`` raises.
        """
        self.check_request(request)
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid}: a request with this id is already queued or running")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a waiting or running request: remove it from its queue, free its blocks,
        set its status.  Unknown or already finished ids are ignored (idempotent).

        Raises:
            ValueError: if ``status`` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request: {status!r} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.drop_placeholders()
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = status

    # ---- the step -------------------------------------------------------------------
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: free all blocks, forget computed tokens (outputs are
        kept), put the request at the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions_total += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)

    def _future_blocks_of_running(self) -> int:
        """Blocks the running requests may still allocate before they finish (blocks)."""
        kv = self.kv_cache_manager
        total = 0
        for req in self.running:
            total += max(0, self.max_blocks_needed(req) - kv.num_blocks_held(req.request_id))
        return total

    def _fits_whole_future(self, request: Request, computed_blocks: list[int]) -> bool:
        """``guaranteed_no_evict`` admission test: after taking the cache hits, the free
        pool covers the rest of this request's life plus the future of every running
        request."""
        kv = self.kv_cache_manager
        num_hit_evictable = sum(1 for b in computed_blocks if kv.pool.is_evictable(b))
        need = self.max_blocks_needed(request) - len(computed_blocks)
        return kv.num_free_blocks - num_hit_evictable >= need + self._future_blocks_of_running()

    def _lora_fits(self, request: Request) -> bool:
        """Admitting ``request`` keeps at most ``max_loras`` distinct adapters running."""
        if not request.lora_id:
            return True
        running = {r.lora_id for r in self.running if r.lora_id}
        return request.lora_id in running or len(running) < self.config.max_loras

    def _record(self, out: SchedulerOutput, sr: ScheduledRequest) -> None:
        out.num_spec_tokens += sr.num_spec_tokens
        if out.async_step:
            req = sr.request
            req.num_computed_tokens += sr.num_new_tokens
            if sr.needs_sample:
                req.append_placeholder()
        out.scheduled.append(sr)
        out.num_batched_tokens += sr.num_new_tokens
        if sr.is_decode:
            out.num_decode_tokens += sr.num_new_tokens
        else:
            out.num_prefill_tokens += sr.num_new_tokens

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Drafts of ``req.spec_token_ids`` to verify this step (tokens): only for a decode
        (one known token left to compute), within the budget and ``max_tokens``."""
        if not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        return max(0, min(len(req.spec_token_ids), budget - 1, req.max_tokens - req.num_output_tokens - 1))

    def schedule(self, async_step: bool | None = None) -> SchedulerOutput:
        """Plan one step.

        Args:
            async_step: plan asynchronously (None: ``config.async_scheduling``).  A step
                verifying drafts must be synchronous: drafts are taken only when False (or
                None with asynchronous scheduling off).

        Raises:
            RuntimeError: a synchronous step while a request still waits for the tokens of a
                step in flight (the caller must read that step back first).

        Returns:
            A :class:`SchedulerOutput`; ``num_batched_tokens <= max_num_batched_tokens`` and
            ``len(scheduled) <= max_num_seqs`` always hold.  It may be empty (nothing to run
            or nothing fits this step).
        """
        cfg = self.config
        kv = self.kv_cache_manager
        out = SchedulerOutput(async_step=cfg.async_scheduling if async_step is None else async_step)
        if not out.async_step and cfg.async_scheduling and any(r.num_output_placeholders for r in self.running):
            raise RuntimeError("a synchronous step was planned while a step in flight has not been read back")
        budget = cfg.max_num_batched_tokens

        # 1. Running requests, oldest first.  (The loop body runs once per running request
        # and step, hundreds of times: the common decode reads plain attributes only.)
        i = 0
        running = self.running
        allocate = kv.allocate_slots
        async_step = out.async_step
        while i < len(running) and budget > 0:
            req = running[i]
            num_output = len(req.output_token_ids)
            num_new = min(len(req.prompt_token_ids) + num_output - req.num_computed_tokens, budget)
            if num_new <= 0 or num_output >= req.max_tokens:
                # nothing to compute: the engine did not finish it yet (or, asynchronous,
                # its last token is still being sampled)
                if req.spec_token_ids:
                    req.spec_token_ids = []
                i += 1
                continue
            drafts: list[int] = []
            if req.spec_token_ids:
                num_drafts = 0 if async_step else self._num_drafts(req, budget)
                drafts, req.spec_token_ids = req.spec_token_ids[:num_drafts], []
                if drafts and allocate(req, num_new + len(drafts)) is None:
                    drafts = []  # no room for the drafts: decode plainly (or preempt below)
                num_new += len(drafts)
            blocked = False
            while allocate(req, num_new) is None:
                if cfg.policy == "guaranteed_no_evict":
                    logger.warning(
                        "guaranteed_no_evict: request %s could not grow (%d free blocks); preempting",
                        req.request_id,
                        kv.num_free_blocks,
                    )
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    blocked = True
                    break
            if blocked:
                break
            table = kv.get_block_ids(req.request_id)
            self._record(out, ScheduledRequest(req, req.num_computed_tokens, num_new, table, spec_token_ids=drafts))
            budget -= num_new
            i += 1

        # 2. Admit waiting requests FCFS (not in a step that had to preempt).
        while (
            not out.preempted_request_ids
            and self.waiting
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting[0]
            req.spec_token_ids = []  # a prefill step verifies nothing
            if cfg.max_loras and not self._lora_fits(req):
                break  # the device slots hold other adapters' running requests
            computed_blocks, num_cached = kv.get_computed_blocks(req)
            if cfg.policy == "guaranteed_no_evict" and not self._fits_whole_future(req, computed_blocks):
                break
            num_new = min(req.num_tokens - num_cached, budget)
            if kv.allocate_slots(req, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            out.new_request_ids.append(req.request_id)
            table = kv.get_block_ids(req.request_id)
            self._record(out, ScheduledRequest(req, num_cached, num_new, table, num_cached_tokens=num_cached))
            budget -= num_new
        return out

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]) -> None:
        """Apply a finished step: advance ``num_computed_tokens``, register newly full
        blocks in the prefix cache, append the sampled token where ``needs_sample``.

        ``sampled_token_ids[request_id]`` is one token, or for a step that verified drafts
        the verified run (accepted drafts, then the target's token; 1 to ``k + 1`` tokens,
        fewer when the engine cut it at a stop token).  Only the run's tokens count as
        computed; KV blocks allocated past them are returned.

        Requests finished (e.g. aborted) since ``schedule`` are skipped.

        Raises:
            KeyError: if a request that needs a sample has none in ``sampled_token_ids``.
            ValueError: a verified run longer than the drafts + 1 or empty.
        """
        kv = self.kv_cache_manager
        if output.async_step:
            self._update_async(output, sampled_token_ids)
            return
        for sr in output.scheduled:
            req = sr.request
            if req.status != RequestStatus.RUNNING or self.requests.get(req.request_id) is not req:
                continue
            if req.num_computed_tokens != sr.num_computed_tokens:  # stale output; ignore
                continue
            if not sr.needs_sample:
                req.num_computed_tokens += sr.num_new_tokens
                kv.cache_blocks(req, req.num_computed_tokens)
                continue
            got = _sampled_token(sampled_token_ids, req)
            tokens = got if isinstance(got, list) else [got]
            if not 1 <= len(tokens) <= sr.num_spec_tokens + 1:
                raise ValueError(f"update_from_output: request {req.request_id} verified {sr.num_spec_tokens} "
                                 f"drafts but got {len(tokens)} tokens")
            # the last known token and the accepted drafts are computed; the run's last
            # token is the new last known token (not computed yet)
            req.num_computed_tokens += sr.num_new_tokens - sr.num_spec_tokens + len(tokens) - 1
            req.append_output_tokens(tokens)  # before hashing: accepted drafts fill blocks
            if sr.num_spec_tokens:
                kv.trim(req, req.num_computed_tokens)
            kv.cache_blocks(req, req.num_computed_tokens)

    def _update_async(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]]) -> None:
        """``update_from_output`` under asynchronous scheduling: fill each sampled request's
        placeholder (also when it was preempted since: its outputs are kept) and register
        the blocks the step filled.  Finished or unknown requests are skipped."""
        kv = self.kv_cache_manager
        for sr in output.scheduled:
            req = sr.request
            if self.requests.get(req.request_id) is not req:  # finished (e.g. aborted) since
                continue
            if sr.needs_sample:
                req.fill_placeholder(sr.num_tokens, _sampled_token(sampled_token_ids, req))
            end = sr.num_computed_tokens + sr.num_new_tokens
            if req.status == RequestStatus.RUNNING and req.num_computed_tokens >= end:
                kv.cache_blocks(req, end)


def _sampled_token(sampled_token_ids: dict[str, int | list[int]], req: Request) -> int | list[int]:
    try:
        return sampled_token_ids[req.request_id]
    except KeyError:
        raise KeyError(
            f"update_from_output: request {req.request_id} finished its tokens this step "
            "but no sampled token was given"
        ) from None
