"""A build's progress as one line of its log: written by ``kiln build``, read by the operator.

``kiln build`` prints every progress message to stderr as

    kiln build: [quantize 4/30 72s] calibrate+quantize: layer 4/30

(stage, layer i/N when the stage goes layer by layer, seconds since the build started, then the
message for people).  The operator reads the tail of the build pod's log through the API server
(``pods/log``, what ``kubectl logs`` reads) and puts the last such line in
``status.build`` (``stage``, ``layer``, ``numLayers``, ``elapsedSeconds``, ``progress``).  The
log is the channel because it needs nothing from the build pod: no API credentials, no
writable claim the operator would have to mount; it works wherever ``kubectl logs`` works.

``format_line`` and ``parse_line`` are the one writer and the one reader of that line.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["STAGES", "BuildProgress", "ProgressReporter", "format_line", "parse_line", "last_progress",
           "as_reporter"]

# The stages of a build, in order (a build skips those it does not need: ``download`` for a
# source that is not on the Hub, ``calibrate`` when nothing calibrates, ``evaluate`` without an
# accuracy gate).
STAGES = ("source", "download", "load", "calibrate", "quantize", "write", "finalize", "evaluate", "done")

PREFIX = "kiln build: "
_LINE = re.compile(r"^kiln build: \[(?P<stage>[a-z]+)(?: (?P<layer>\d+)/(?P<num>\d+))? (?P<secs>\d+)s\] ?(?P<msg>.*)$")


@dataclass(frozen=True)
class BuildProgress:
    """Where a build is.

    Fields:
        stage: one of ``STAGES``.
        elapsed_seconds: whole seconds since the build started (when the line was written).
        layer / num_layers: the layer done of how many, for a stage that goes layer by layer
            (``quantize``), else None.
        message: the line's text for people.
    """

    stage: str
    elapsed_seconds: int = 0
    layer: int | None = None
    num_layers: int | None = None
    message: str = ""

    def summary(self) -> str:
        """``quantize 4/30, 1m12s``: the printer column's text."""
        m, s = divmod(int(self.elapsed_seconds), 60)
        h, m = divmod(m, 60)
        took = f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
        step = f" {self.layer}/{self.num_layers}" if self.layer is not None else ""
        return f"{self.stage}{step}, {took}"

    def to_status(self) -> dict:
        """The ``status.build`` fields of this progress."""
        out: dict = {"stage": self.stage, "elapsedSeconds": int(self.elapsed_seconds), "progress": self.summary()}
        if self.layer is not None:
            out.update(layer=self.layer, numLayers=self.num_layers)
        return out


def format_line(p: BuildProgress) -> str:
    """The log line of ``p`` (no newline)."""
    step = f" {p.layer}/{p.num_layers}" if p.layer is not None else ""
    msg = " ".join(p.message.split())  # one line
    return f"{PREFIX}[{p.stage}{step} {int(p.elapsed_seconds)}s] {msg}".rstrip()


def parse_line(line: str) -> BuildProgress | None:
    """The progress a log line carries, or None for any other line (a Kubernetes log line may
    carry an RFC 3339 timestamp first, as ``kubectl logs --timestamps`` prints it)."""
    line = line.rstrip("\r\n")
    if not line.startswith(PREFIX):
        head, sep, rest = line.partition(" ")
        if not (sep and head[:4].isdigit() and rest.startswith(PREFIX)):
            return None
        line = rest
    m = _LINE.match(line)
    if m is None or m["stage"] not in STAGES:
        return None
    layer = int(m["layer"]) if m["layer"] is not None else None
    num = int(m["num"]) if m["num"] is not None else None
    return BuildProgress(m["stage"], int(m["secs"]), layer, num, m["msg"])


def last_progress(log: str) -> BuildProgress | None:
    """The last progress line of a log's text, or None."""
    for line in reversed(log.splitlines()):
        p = parse_line(line)
        if p is not None:
            return p
    return None


class ProgressReporter:
    """Turns a build's messages into progress lines: keeps the current stage and the start
    time, and hands each line to ``write``.

    ``reporter(message)`` reports in the current stage; ``reporter.stage(name, message)``
    moves to a stage; ``reporter.layer(done, total, message)`` reports layer progress in it.
    Raises ``ValueError`` for a stage not in ``STAGES``."""

    def __init__(self, write: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 start: float | None = None):
        self.write = write
        self.clock = clock
        self.t0 = clock() if start is None else start
        self.current = STAGES[0]
        self.last: BuildProgress | None = None

    def _emit(self, message: str, layer: int | None = None, num_layers: int | None = None) -> None:
        self.last = BuildProgress(self.current, int(self.clock() - self.t0), layer, num_layers, message)
        self.write(format_line(self.last))

    def stage(self, name: str, message: str = "") -> None:
        if name not in STAGES:
            raise ValueError(f"unknown build stage {name!r}; one of {', '.join(STAGES)}")
        self.current = name
        self._emit(message or name)

    def layer(self, done: int, total: int, message: str = "") -> None:
        self._emit(message or f"layer {done}/{total}", done, total)

    def __call__(self, message: str) -> None:
        self._emit(message)


def as_reporter(progress: "ProgressReporter | Callable[[str], None] | None") -> ProgressReporter:
    """``progress`` as a ``ProgressReporter``: itself, a plain message callback wrapped (it
    gets the formatted lines), or one that drops everything."""
    if isinstance(progress, ProgressReporter):
        return progress
    return ProgressReporter(progress or (lambda line: None))

