"""The development cluster's child processes, and how they end with their owner.

Every long-lived process (plane components, the operator, a process node's pods, the binaries'
build) starts through ``spawn`` in a session of its own, so it is stopped as a process group and
a Ctrl-C in the terminal reaches only its owner, which decides. ``bind=True`` ties a group to
the process that started it (a test run), in three layers:

1. ``interrupt_on_signals()`` turns SIGTERM and SIGHUP into ``KeyboardInterrupt`` (what Ctrl-C
   raises), so ``finally`` blocks and pytest's fixture teardowns run and stop what they started;
2. at interpreter exit (``atexit``) every bound group still alive gets SIGTERM, then SIGKILL:
   what a teardown that never ran (or was interrupted again) left;
3. the kernel signals a bound process when the thread that started it dies (SIGTERM, or the
   ``death_signal`` asked for; ``PR_SET_PDEATHSIG``, set by a small exec wrapper; Linux only),
   which covers an owner killed with SIGKILL. ``preexec_fn`` would do the same but may deadlock
   in a threaded process. Only the group's leader gets it: it must end its own children.

An unbound process (a plane started by ``make cluster-up``, the demo's background node and
operator) outlives its starter by design; ``Plane.down`` and ``Stack.down`` stop it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO

# Run as `python -I -S -c _PDEATHSIG_EXEC OWNER_PID SIGNAL ARGV...`: asks for SIGNAL when the
# parent thread dies, exits if the owner is already gone (a race with the prctl), becomes ARGV.
_PDEATHSIG_EXEC = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(143)\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)

_lock = threading.Lock()
_bound: dict[int, str] = {}  # pgid -> what, for the exit handler
_exit_handler_registered = False


def spawn(args: list[str], *, what: str, bind: bool, stdout: int | IO | None = None,
          stderr: int | IO | None = None, env: dict[str, str] | None = None,
          cwd: str | os.PathLike | None = None, death_signal: int = signal.SIGTERM) -> subprocess.Popen:
    """Starts args in a new session (its pid is the process group's id). With bind=True the
    group ends with this process (see the module docstring); death_signal is what the leader
    gets if this process dies without stopping it. stdin is /dev/null."""
    exe = args[0] if os.sep in args[0] else shutil.which(args[0], path=(env or os.environ).get("PATH"))
    if exe is None or not os.access(exe, os.X_OK):
        raise FileNotFoundError(f"{args[0]}: no such executable")
    argv = [exe, *args[1:]]
    if bind and sys.platform.startswith("linux"):
        argv = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), str(int(death_signal)), *argv]
    p = subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                         start_new_session=True)
    if bind:
        _track(p.pid, what)
    return p


def _track(pgid: int, what: str) -> None:
    global _exit_handler_registered
    with _lock:
        _bound[pgid] = what
        if not _exit_handler_registered:
            atexit.register(stop_bound)
            _exit_handler_registered = True


def forget(pgid: int) -> None:
    """Called once a bound group has been stopped by its owner (so a reused id is never hit)."""
    with _lock:
        _bound.pop(pgid, None)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to the group, SIGKILL to whatever of it is left after grace seconds."""
    stop_groups([pgid], grace)


def stop_groups(pgids: list[int], grace: float = 5.0) -> None:
    live = []
    for g in pgids:
        try:
            os.killpg(g, signal.SIGTERM)
            live.append(g)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        live = [g for g in live if group_alive(g)]
        time.sleep(0.05)
    for g in live:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for g in pgids:
        forget(g)


def stop_bound(grace: float = 5.0) -> list[str]:
    """Stops every bound group still alive (the exit handler); returns what they were."""
    with _lock:
        groups = dict(_bound)
    alive = {g: w for g, w in groups.items() if group_alive(g)}
    if alive:
        print(f"[devcluster] stopping {len(alive)} process group(s) left at exit: "
              f"{', '.join(sorted(set(alive.values())))}", file=sys.stderr, flush=True)
        stop_groups(list(alive), grace)
    with _lock:
        _bound.clear()
    return sorted(alive.values())


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def interrupt_on_signals(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Makes SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does, so
    cleanup code runs. Replaces only default handlers; does nothing off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _interrupt)
