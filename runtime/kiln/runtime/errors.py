"""Errors shared by the engine, its processes and the HTTP server (torch-free)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses (maps to HTTP 400); the message carries the numbers."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone; every in-flight request fails with this (HTTP 500)."""


class ServerShuttingDownError(RuntimeError):
    """The server is stopping and the request did not finish within ``--shutdown-timeout``
    (HTTP 503; a stream ends with an error event)."""
