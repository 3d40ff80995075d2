"""The step's token bitmask: filled on the host on a worker thread while the step loop's
thread goes on, uploaded to the device without blocking, applied by the sampler.

``BitmaskFiller.start`` hands the grammar states of a step's constrained rows to one worker
thread, which fills rows ``0..G-1`` of a persistent host buffer with xgrammar's
``BatchGrammarMatcher.batch_fill_next_token_bitmask`` (one call for the batch; xgrammar's
calls release the GIL through tvm-ffi, and the batch call spreads its rows over ``threads``
C++ threads).  Meanwhile the step loop launches the forward pass, reads back the previous
step and plans the next one; the sampler's launch then waits for the fill
(``GrammarMask.to_device``).  That wait is the fill time the overlap did not hide, counted
in ``wait_seconds`` beside the fill's own time ``fill_seconds``.

A sequence that verifies drafts (speculative decoding) gets one row per position: the legal
tokens after its last token and after each draft, filled by advancing its grammar over the
drafts on the worker and rolling it back after (``BitmaskFiller.start``'s ``draft_runs``).

The worker needs the interpreter lock to start a fill, and the step loop holds it while it
runs Python (handing out outputs, planning); at CPython's default switch interval (5 ms) the
worker would get it only when the step loop blocks, which is at the wait for the mask
itself, and nothing would overlap.  A filler therefore lowers the process's switch interval
to ``FILL_SWITCH_INTERVAL_S`` (``benchmarks/fill_start_latency.py`` measures the start
delay at both intervals).

Two host buffers are used in turn.  Before the worker writes one it waits for the CUDA
event recorded after that buffer's last host -> device copy, so a step's mask can be filled
while the previous step's copy is still queued; at most one step is in flight, so the other
buffer's copy (two steps back) is always complete by then.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


#: The interpreter's thread switch interval (seconds) while a bitmask filler exists: how long
#: a worker that was handed a fill waits at most for the step loop to let it run.
FILL_SWITCH_INTERVAL_S = 1e-4


def default_fill_threads() -> int:
    """C++ threads of one batch fill: a quarter of this process's CPUs, 1 to 4 (the step
    loop's thread, the tokenizer and the compile threads need the others)."""
    try:
        ncpu = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ncpu = os.cpu_count() or 1
    return max(1, min(4, ncpu // 4))


class GrammarMask:
    """One step's bitmask, possibly still being filled.

    Row ``i < len(request_ids)`` of the bitmask (int32 ``[G, ceil(V/32)]``, xgrammar's
    layout: bit ``t % 32`` of word ``t // 32`` is 1 when token t may come next) belongs to
    ``request_ids[i]``; the rows after them belong to sequences that verify drafts:
    ``draft_rows[id] = (first row, k + 1)``, one row per position (rows after a draft the
    grammar refuses are all ones: that draft is rejected, so they are never read).  A sampled
    row without an entry here is not constrained.
    """

    def __init__(self, filler: "BitmaskFiller", slot: int, request_ids: list[str], buffer: torch.Tensor,
                 future: Future, draft_rows: dict[str, tuple[int, int]] | None = None):
        self.request_ids = request_ids
        self.draft_rows = draft_rows or {}
        self._filler = filler
        self._slot = slot
        self._buffer = buffer
        self._future = future
        self._device: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        """The fill has ended (``result()`` returns without waiting)."""
        return self._future.done()

    def result(self) -> torch.Tensor:
        """The filled host rows int32 [G, W] (a view of the persistent buffer); waits for the
        fill, the wait counted in the filler's ``wait_seconds``.

        Raises:
            RuntimeError: xgrammar refused the fill (its message).
        """
        if not self._future.done():
            t0 = time.perf_counter()
            self._future.result()
            self._filler.wait_seconds += time.perf_counter() - t0
        else:
            self._future.result()  # its exception, if any
        return self._buffer

    def to_device(self, device: torch.device) -> torch.Tensor:
        """The bitmask on ``device``: ``result()`` then a non-blocking copy from pinned memory
        (CUDA, once: later calls return the same tensor), after which an event marks when the
        host buffer may be written again; on the CPU the host rows themselves."""
        host = self.result()
        if device.type != "cuda":
            return host
        if self._device is None:
            self._device = host.to(device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._filler._copied[self._slot] = ev
        return self._device


def fill_draft_rows(matcher, drafts: list[int], buf: torch.Tensor, first: int) -> None:
    """Rows ``first .. first + len(drafts)`` of ``buf`` (int32 [R, W], host): the legal next
    tokens of ``matcher`` (an xgrammar ``GrammarMatcher``) now and after each draft in turn.
    After a draft the grammar refuses, or once it ended (a stop token accepted), the rows
    left are all ones (no draft after it can be accepted, so they are never read).  The
    matcher is rolled back over the drafts it accepted, so it ends where it began."""
    accepted = 0
    j = 0
    for j in range(len(drafts) + 1):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(buf, first + j)
        if j == len(drafts):
            j += 1
            break
        if not matcher.accept_token(int(drafts[j])):
            j += 1
            break
        accepted += 1
    if j <= len(drafts):
        buf[first + j: first + len(drafts) + 1].fill_(-1)
    if accepted:
        matcher.rollback(accepted)


class BitmaskFiller:
    """Persistent host bitmask buffers and the worker thread that fills them (making one
    lowers the interpreter's switch interval to ``FILL_SWITCH_INTERVAL_S``, see the module
    docstring).

    Args:
        width: int32 words per row (``ceil(vocab_size / 32)``).
        pin_memory: allocate the buffers in pinned memory (CUDA: asynchronous uploads).
        threads: C++ threads of one batch fill (default ``default_fill_threads()``).
    """

    def __init__(self, width: int, pin_memory: bool = False, threads: int | None = None):
        import xgrammar as xgr  # noqa: PLC0415

        self.width = width
        self.pin_memory = pin_memory
        self.threads = threads or default_fill_threads()
        self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
        if sys.getswitchinterval() > FILL_SWITCH_INTERVAL_S:  # process-wide; only ever lowered
            sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-bitmask")
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        #: fills started; seconds the worker spent filling; seconds the step loop waited for one
        self.num_fills = 0
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0

    def _buffer(self, slot: int, rows: int) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < rows:
            cap = max(8, rows, 2 * (buf.shape[0] if buf is not None else 0))
            buf = torch.empty((cap, self.width), dtype=torch.int32, pin_memory=self.pin_memory)
            self._buffers[slot] = buf
            self._copied[slot] = None  # a new buffer: no copy reads it
        return buf

    def start(self, request_ids: list[str], matchers: list,
              draft_runs: list[tuple[str, object, list[int]]] = ()) -> GrammarMask:
        """Start filling the rows of ``request_ids`` (one xgrammar ``GrammarMatcher`` each,
        none terminated) and of ``draft_runs`` (``(id, matcher, drafts)``: ``len(drafts) + 1``
        rows each, the legal tokens after the sequence's last token and after each draft) on
        the worker; returns at once.  The matchers must not advance until the mask's
        ``result()`` returned (the engine core accepts a step's tokens only after that step
        sampled, which waits for its mask); a draft run's matcher is back where it was once
        the fill ended."""
        draft_rows: dict[str, tuple[int, int]] = {}
        row = len(matchers)
        for rid, _, drafts in draft_runs:
            draft_rows[rid] = (row, len(drafts) + 1)
            row += len(drafts) + 1
        slot = self._turn = 1 - self._turn
        buf = self._buffer(slot, row)[:row]
        copied = self._copied[slot]
        self._copied[slot] = None
        self.num_fills += 1
        runs = [(m, list(d), draft_rows[rid][0]) for rid, m, d in draft_runs]

        def fill() -> None:
            t0 = time.perf_counter()
            if copied is not None:
                copied.synchronize()  # the buffer's previous upload is done reading it
            if matchers:
                self._batch.batch_fill_next_token_bitmask(matchers, buf[: len(matchers)])
            with torch.inference_mode():  # the buffer may be an inference tensor (made in a step)
                for m, drafts, first in runs:
                    fill_draft_rows(m, drafts, buf, first)
            self.fill_seconds += time.perf_counter() - t0

        return GrammarMask(self, slot, list(request_ids), buf, self._pool.submit(fill), draft_rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
