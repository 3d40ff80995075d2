"""Tensor parallelism across processes of one host (Megatron-LM's layout; the rank loop of
nano-vllm's model runner and gpt-fast's ``tp.py``).

Rank 0 is the engine core process itself, as in nano-vllm: it owns the scheduler and the
sampler, so no sampled token travels between processes, and a step costs one small broadcast
of the model-runner inputs (a pickled :class:`StepPlan` on a gloo group) to ranks 1..N-1,
which run :func:`worker_main` in their own processes.  Every rank runs the same forward pass
(collectives inside the layers: ``torch.distributed`` on the default group, NCCL on CUDA,
gloo on the CPU); rank 0 samples from the gathered logits and broadcasts the sampled ids, so
each rank holds them as the next step's placeholder inputs (asynchronous scheduling).

A worker that dies takes the core down: a watchdog thread in rank 0 waits on the workers'
sentinels, logs one error line naming the rank and its exit code or signal, stops the other
workers and ends the core process (exit 1); a collective that fails first in rank 0's step
loop (the peer's socket closed) ends the same way, without its traceback
(:func:`exit_if_worker_died`).  The API server then fails ``/health`` and exits through its
existing core-death path.  Workers ask Linux to SIGKILL them when the core exits
(``PR_SET_PDEATHSIG``), so no rank outlives its core.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class TPContext:
    """This process's place in the tensor-parallel group.

    Fields:
        rank: 0 .. size-1 (0: the engine core).
        size: number of ranks (``--tensor-parallel-size``).
        control: the gloo group that carries :class:`StepPlan` objects (the world group on
            the CPU; a separate gloo group beside NCCL on CUDA).
    """

    rank: int = 0
    size: int = 1
    control: object = None
    workers: list = field(default_factory=list)  # rank 0: the worker processes

    @property
    def enabled(self) -> bool:
        return self.size > 1


def check_devices(device: str | torch.device, tp_size: int) -> None:
    """Raises ValueError when the ranks run on CUDA (``cuda``, or ``auto`` where CUDA is
    available) and fewer GPUs are visible than ranks (none at all included)."""
    if str(device) == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        kind = torch.device(device).type
    if kind != "cuda":
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < tp_size:
        raise ValueError(f"tensor parallel size {tp_size} needs {tp_size} GPUs, but {visible} "
                         f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES / nvidia.com/gpu)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, port: int, device: torch.device) -> TPContext:
    """Join the process group (``tcp://127.0.0.1:port``): NCCL on CUDA (rank r on ``cuda:r``)
    plus a gloo control group, gloo alone on the CPU."""
    url = f"tcp://127.0.0.1:{port}"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=url, rank=rank, world_size=size,
                                device_id=torch.device("cuda", rank))
        control = dist.new_group(backend="gloo")
    else:
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=size)
        control = dist.group.WORLD
    return TPContext(rank, size, control)


def start_workers(args, device: torch.device, load) -> TPContext:
    """Rank 0: spawn ranks 1..N-1 (``worker_main``) and join the group with them; ``load`` is
    the module-level function each worker loads its shard with (``load(args, tp=...)``).

    Raises:
        ValueError: more ranks than visible GPUs.
    """
    size = args.tensor_parallel_size
    check_devices(device, size)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(1, size):
        p = ctx.Process(target=worker_main, args=(args, r, port, device, load), name=f"kiln-tp-rank-{r}", daemon=False)
        p.start()
        procs.append(p)
    try:
        tp = init_group(0, size, port, device)
    except BaseException:
        stop_workers(procs)
        raise
    tp.workers = procs
    threading.Thread(target=_watch, args=(procs,), name="kiln-tp-watchdog", daemon=True).start()
    return tp


def stop_workers(procs, timeout: float = 5.0) -> None:
    """Terminate the worker processes and reap them (SIGKILL after ``timeout`` seconds)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(1)


_failing = threading.Lock()  # one report, whether the watchdog or a failed collective sees it first


def _fail(procs, dead) -> None:
    """Log one error line naming the dead worker, stop the others and end the process (exit 1)."""
    with _failing:
        dead.join(1)
        code = dead.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and \
            -code in signal.valid_signals() else f"exited with code {code}"
        log.error("tensor-parallel rank %d (pid %d) %s; the engine cannot continue without it",
                  procs.index(dead) + 1, dead.pid, how)
        stop_workers([p for p in procs if p is not dead], timeout=2.0)
        os._exit(1)


def _watch(procs) -> None:
    """Rank 0's watchdog: the first worker to exit ends the core process (see module doc)."""
    ready = wait([p.sentinel for p in procs])
    dead = next(p for p in procs if p.sentinel in ready)
    if getattr(dead, "_kiln_stopping", False):
        return
    _fail(procs, dead)


def exit_if_worker_died(tp: TPContext, timeout: float = 2.0) -> None:
    """Rank 0, after a step raised: when a worker has ended (or ends within ``timeout``
    seconds: a collective fails the moment a peer's socket closes, a little before its process
    is reaped), report it as the watchdog does, in one line instead of the collective's
    traceback, and end the process; otherwise return (the step failed on its own)."""
    if not tp.enabled or tp.rank != 0 or not tp.workers:
        return
    ready = wait([p.sentinel for p in tp.workers], timeout)
    dead = [p for p in tp.workers if p.sentinel in ready and not getattr(p, "_kiln_stopping", False)]
    if dead:
        _fail(tp.workers, dead[0])


def shutdown(tp: TPContext) -> None:
    """Rank 0: tell the workers to stop (``None`` plan), then reap them."""
    if not tp.enabled or tp.rank != 0:
        return
    for p in tp.workers:
        p._kiln_stopping = True
    try:
        broadcast_plan(tp, None)
    except Exception:  # noqa: BLE001  (a worker already gone)
        pass
    stop_workers(tp.workers)


# -- the per-step plan --------------------------------------------------------------------
@dataclass
class PlannedRequest:
    """What a worker needs of a :class:`Request` to build the same inputs as rank 0: the
    tokens computed this step (placeholders included) and the counts ``ScheduledRequest`` reads."""

    request_id: str
    start: int
    tokens: list[int]
    num_tokens: int
    num_prompt_tokens: int
    lora_id: int = 0  # 0: the base; else rank 0's id of the adapter (its slot set by the plan's writes)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start - self.start:end - self.start]

    def token_at(self, pos: int) -> int:
        return self.tokens[pos - self.start]


def plan_of(out, lora_writes: list[tuple[int, int, str]] | None = None) -> tuple[list[tuple], list]:
    """A ``SchedulerOutput`` reduced to picklable rows for the workers, with the LoRA slot
    writes rank 0 made for it (``LoRAManager.assign_slots``)."""
    rows = []
    for sr in out.scheduled:
        req = sr.request
        start, n = sr.num_computed_tokens, sr.num_new_tokens
        rows.append((req.request_id, start, n, req.token_slice(start, start + n), list(sr.block_ids),
                     sr.num_tokens, req.num_prompt_tokens, req.lora_id))
    return rows, list(lora_writes or [])


def output_of(plan: tuple[list[tuple], list]):
    """The worker's ``(SchedulerOutput, LoRA slot writes)`` rebuilt from :func:`plan_of`."""
    from ..core.sched_output import ScheduledRequest, SchedulerOutput  # noqa: PLC0415

    rows, writes = plan
    scheduled = []
    for rid, start, n, toks, blocks, num_tokens, num_prompt, lora_id in rows:
        req = PlannedRequest(rid, start, toks, num_tokens, num_prompt, lora_id)
        scheduled.append(ScheduledRequest(req, start, n, blocks))
    return SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(r[2] for r in rows)), writes


def broadcast_plan(tp: TPContext, rows):
    """Rank 0 sends ``rows`` (a :func:`plan_of`; None: stop); the other ranks return what
    rank 0 sent."""
    box = [rows]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


def die_with_parent() -> None:
    """SIGKILL this process when its parent (the engine core) exits (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(args, rank: int, port: int, device: torch.device, load) -> None:
    """A rank 1..N-1 process: join the group, load this rank's shard exactly as rank 0 does
    (same KV pool size, warm-up and CUDA graphs, so the collectives line up), then run the
    steps rank 0 broadcasts until it sends None."""
    die_with_parent()
    if os.getppid() == 1:  # the core died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank{rank}: %(message)s")
    tp = init_group(rank, args.tensor_parallel_size, port, device)
    lm = load(replace(args), tp=tp)
    runner = lm.runner
    while True:
        rows = broadcast_plan(tp, None)
        if rows is None:
            break
        out, lora_writes = output_of(rows)
        if lora_writes:
            runner.lora.apply_slot_writes(lora_writes)
        runner.execute_worker(out)
    dist.destroy_process_group()
    os._exit(0)
