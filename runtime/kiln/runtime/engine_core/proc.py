"""The engine core's process: load the model, warm up, then step continuously and talk to the
API server processes over ZeroMQ.

Sockets: one ROUTER at ``address`` (``ipc://``) that every API process's DEALER connects
to, carrying :mod:`.messages` both ways (a sequence's outputs go back to the client that
added it); one REP at ``metrics_address`` answered by a thread, so ``GET /metrics`` is served
while a long step runs.  Start-up reports over a ``multiprocessing`` pipe: ``("ready",
CoreInfo bytes)`` or ``("error", one line, exit code)``.

The process ignores SIGTERM and SIGINT: a signal sent to the whole process group (Ctrl-C, a
process supervisor) must let the API processes drain their requests for
``--shutdown-timeout`` while the core keeps stepping.  It ends when its launcher sends
SIGUSR1 (after the API processes stopped), on :class:`Shutdown`, or when its parent dies
(``PR_SET_PDEATHSIG``), so no core outlives its server.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from ..config import EngineArgs
from ..errors import InvalidRequestError
from . import messages as m

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:  # no libc.so.6 (musl): the parent's shutdown path still stops us
            pass


def one_line_error(e: BaseException) -> tuple[str, int]:
    """``(message, exit code)`` for a start-up failure: 2 for bad input (a model source,
    settings, a file), 1 for anything else."""
    from ..loader import ModelSourceError  # noqa: PLC0415
    from ..model.config import UnsupportedModelError  # noqa: PLC0415

    if isinstance(e, (ModelSourceError, UnsupportedModelError, ValueError, FileNotFoundError, PermissionError)):
        return str(e), 2
    return f"{type(e).__name__}: {e}", 1


def _serve_metrics(ctx: zmq.Context, address: str, render, stop: threading.Event) -> None:
    """Answer metrics requests (any frame -> the Prometheus text) until ``stop`` is set.
    The request frame, when not empty, is an :class:`ApiStats` to apply first."""
    sock = ctx.socket(zmq.REP)
    sock.linger = 0
    sock.bind(address)
    try:
        while not stop.is_set():
            try:
                if sock.poll(200):
                    sock.send(render(sock.recv()))
            except zmq.ZMQError:  # the context is terminating
                break
    finally:
        sock.close()


def _warmup(core, max_model_len: int) -> None:
    """One real sequence through the core, so readiness means a step has run."""
    from ..sampling_params import SamplingParams  # noqa: PLC0415

    core.add_request(m.CoreRequest("warmup#0", [1], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
                                   max_tokens=1, arrival_time=time.monotonic(), record_metrics=False))
    while core.has_unfinished_requests():
        core.step()


def run_engine_core(args: EngineArgs, address: str, metrics_address: str, conn, log_level: str = "INFO") -> None:
    """The core process's entry point (``multiprocessing`` target); exits with its status."""
    die_with_parent()
    stop = {"flag": False}

    def _on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s core: %(message)s")
    try:
        from ..server.metrics import Metrics  # noqa: PLC0415
        from .core import EngineCore  # noqa: PLC0415

        core = EngineCore(args)
        name = args.served_model_name or core.loaded.model_ref
        if name in args.lora_modules:
            raise ValueError(f"--lora-modules: {name!r} is the base model's name; give the adapter another name")
        metrics = Metrics(name)
        _warmup(core, core.max_model_len)
        core.stat_logger = metrics
        lm = core.loaded
        info = m.CoreInfo(
            served_model_name=name, model_ref=lm.model_ref, max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size, num_kv_blocks=core.runner.num_kv_blocks,
            block_size=core.args.block_size, max_num_seqs=core.args.max_num_seqs,
            max_num_batched_tokens=core.args.max_num_batched_tokens, eos_token_ids=sorted(core.eos_token_ids),
            tokenizer=lm.tokenizer_source, pid=os.getpid(), startup_seconds=core.startup_seconds,
            lora_enabled=core.runner.lora is not None, lora_adapters=lora_adapter_list(core))
    except BaseException as e:  # noqa: BLE001  (start-up failure: one line to the launcher)
        msg, code = one_line_error(e)
        if code == 1:
            log.exception("engine core failed to start")
        conn.send(("error", msg, code))
        conn.close()
        os._exit(code)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(address)
    metrics_stop = threading.Event()

    def render(frame: bytes) -> bytes:
        if frame:
            try:
                metrics.on_api_stats(msgspec.msgpack.decode(frame, type=m.ApiStats))
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("malformed metrics request ignored")
        return metrics.render()

    t = threading.Thread(target=_serve_metrics, args=(ctx, metrics_address, render, metrics_stop),
                         name="kiln-core-metrics", daemon=True)
    t.start()
    conn.send(("ready", m.encode(info)))
    conn.close()
    try:
        CoreLoop(core, sock, metrics).run(stop)
    except BaseException:  # noqa: BLE001
        from ..distributed import parallel  # noqa: PLC0415

        parallel.exit_if_worker_died(core.runner.tp)  # a dead rank: its one line, not this traceback
        log.exception("engine core crashed")
        os._exit(1)
    finally:
        metrics_stop.set()
        t.join(2)
    sock.close()
    ctx.term()
    core.runner.close()  # tensor-parallel workers
    os._exit(0)


def lora_adapter_list(core) -> list[m.LoRAAdapter]:
    """The core's loaded LoRA adapters as messages (empty without LoRA)."""
    lora = core.runner.lora
    if lora is None:
        return []
    return [m.LoRAAdapter(a.name, a.path, a.rank, a.created) for a in lora.adapters()]


def apply_lora_control(core, msg: m.LoRAControl) -> m.LoRAReply:
    """Load or unload an adapter in the core; the reply carries the HTTP status."""
    from ..lora import LoRAError  # noqa: PLC0415

    lora = core.runner.lora
    if lora is None:
        return m.LoRAReply(msg.token, 400, "this server was started without LoRA: add --enable-lora (or "
                                           "--lora-modules) to kiln serve", "LoRADisabled")
    try:
        if msg.op == "load":
            lora.add_adapter(msg.name, msg.path)
            return m.LoRAReply(msg.token, 200, f"LoRA adapter {msg.name!r} loaded")
        if msg.op == "unload":
            lora.remove_adapter(msg.name)
            return m.LoRAReply(msg.token, 200, f"LoRA adapter {msg.name!r} unloaded")
        return m.LoRAReply(msg.token, 400, f"unknown LoRA operation {msg.op!r}", "InvalidRequest")
    except LoRAError as e:
        status = 404 if e.reason == "NotFound" and msg.op == "unload" else 400
        return m.LoRAReply(msg.token, status, str(e), e.reason)


class CoreLoop:
    """The busy loop: apply client messages, step, send each client its outputs."""

    def __init__(self, core, sock: zmq.Socket, metrics):
        self.core = core
        self.sock = sock
        self.metrics = metrics
        self.owner: dict[str, bytes] = {}  # sequence id -> client identity
        self.clients: set[bytes] = set()  # every client seen (they get LoRA adapter list changes)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)

    def run(self, stop: dict) -> None:
        core = self.core
        while not stop["flag"]:
            busy = core.has_unfinished_requests()
            if self.poller.poll(0 if busy else 500):
                if self._drain_inputs():
                    return
            if not core.has_unfinished_requests():
                continue
            outputs = core.step()
            self._send_admissions()
            if outputs:
                self._send_outputs(outputs)

    def _drain_inputs(self) -> bool:
        """Apply every waiting message; True on Shutdown."""
        acks: dict[bytes, m.CoreOutputs] = {}
        changed = False
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = m.decode_client_message(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("malformed message from a client ignored: %s", e)
                continue
            if ident not in self.clients:
                self.clients.add(ident)
                if self.core.runner.lora is not None:  # it may have missed changes since the handshake
                    self.sock.send_multipart([ident, m.encode(m.CoreOutputs(
                        outputs=[], accepted=[], rejected=[], timestamp=time.monotonic(),
                        lora_adapters=lora_adapter_list(self.core)))], copy=False)
            if isinstance(msg, m.LoRAControl):
                self._on_lora_control(ident, msg)
            elif isinstance(msg, m.AddRequests):
                ack = acks.setdefault(ident, m.CoreOutputs(outputs=[], accepted=[], rejected=[]))
                for req in msg.requests:
                    try:
                        admitted = self.core.add_request(req)
                    except InvalidRequestError as e:
                        status = 404 if getattr(e, "reason", "") == "NotFound" else 400
                        ack.rejected.append(m.Rejected(req.request_id, str(e), status))
                        continue
                    self.owner[req.request_id] = ident
                    if admitted:  # else its verdict waits for its grammar (``_send_admissions``)
                        ack.accepted.append(req.request_id)
            elif isinstance(msg, m.AbortRequests):
                changed = True
                self.core.abort_requests(msg.request_ids, msg.finish_reason)
                for rid in msg.request_ids:
                    self.owner.pop(rid, None)
            elif isinstance(msg, m.ApiStats):
                self.metrics.on_api_stats(msg)
            elif isinstance(msg, m.Shutdown):
                return True
        if changed or acks:
            self.core.report_stats()
        now = time.monotonic()
        for ident, ack in acks.items():
            ack.timestamp = now
            self.sock.send_multipart([ident, m.encode(ack)], copy=False)
        return False

    def _on_lora_control(self, ident: bytes, msg: m.LoRAControl) -> None:
        """Apply a load/unload, answer the sender, send every client the new list."""
        reply = apply_lora_control(self.core, msg)
        adapters = lora_adapter_list(self.core)
        now = time.monotonic()
        for client in self.clients:
            out = m.CoreOutputs(outputs=[], accepted=[], rejected=[], timestamp=now, lora_adapters=adapters,
                                lora_reply=reply if client == ident else None)
            self.sock.send_multipart([client, m.encode(out)], copy=False)

    def _send_admissions(self) -> None:
        """The verdicts on sequences that waited for their grammar (before any of their
        outputs): accepted, or rejected with a 400 (the grammar failed or took too long)."""
        admitted, refused = self.core.take_admissions()
        if not admitted and not refused:
            return
        acks: dict[bytes, m.CoreOutputs] = {}
        for rid in admitted:
            ident = self.owner.get(rid)
            if ident is not None:
                acks.setdefault(ident, m.CoreOutputs(outputs=[], accepted=[], rejected=[])).accepted.append(rid)
        for rid, msg in refused:
            ident = self.owner.pop(rid, None)
            if ident is not None:
                acks.setdefault(ident, m.CoreOutputs(outputs=[], accepted=[], rejected=[])).rejected.append(
                    m.Rejected(rid, msg, 400))
        now = time.monotonic()
        for ident, ack in acks.items():
            ack.timestamp = now
            self.sock.send_multipart([ident, m.encode(ack)], copy=False)

    def _send_outputs(self, outputs: list[m.CoreOutput]) -> None:
        by_client: dict[bytes, list[m.CoreOutput]] = {}
        for out in outputs:
            ident = self.owner.get(out.request_id)
            if ident is None:
                continue
            by_client.setdefault(ident, []).append(out)
            if out.finish_reason is not None:
                self.owner.pop(out.request_id, None)
        now = time.monotonic()
        for ident, outs in by_client.items():
            self.sock.send_multipart([ident, m.encode(m.CoreOutputs(outputs=outs, accepted=[], rejected=[],
                                                                    timestamp=now))], copy=False)
