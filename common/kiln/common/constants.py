"""Ports, HTTP paths and the engine cache's layout: the values the operator writes into the
manifests it renders and the runtime listens on or reads."""

from __future__ import annotations

__all__ = [
    "HTTP_PORT",
    "HEALTH_PATH",
    "READY_PATH",
    "METRICS_PATH",
    "DEFAULT_CACHE_ROOT",
    "ENGINE_FORMAT_VERSION",
    "MANIFEST_FILENAME",
    "COMPLETE_MARKER",
    "HASH_LENGTH",
]

# --- serving ------------------------------------------------------------------------------
HTTP_PORT = 8000  # `kiln serve` default port; the Service port the operator creates
HEALTH_PATH = "/health"  # process alive (liveness)
READY_PATH = "/ready"  # engine loaded and warmed (readiness, startup)
METRICS_PATH = "/metrics"  # Prometheus text format

# --- engine layout on disk ---------------------------------------------------------------
DEFAULT_CACHE_ROOT = "/engines"  # where the operator mounts the engine cache volume
ENGINE_FORMAT_VERSION = 2  # bump when the on-disk layout changes: every engine hash changes (2: int4 format 2)
MANIFEST_FILENAME = "manifest.json"  # format version, engine hash, model config, quantization...
COMPLETE_MARKER = ".kiln-complete"  # written last, inside the temp dir, before the atomic rename
HASH_LENGTH = 16  # hex chars of sha256 kept in paths, names and labels (64 bits)
