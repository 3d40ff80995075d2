"""The JIT compile cache of the serving pods: where Triton keeps the kernels it compiled.

Triton compiles each kernel specialization on first use and keeps the binary in
``TRITON_CACHE_DIR`` (default ``~/.triton/cache``).  A serving pod's home is an emptyDir, so
every new pod (a rollout, an autoscaler scale-up, a restart) would compile the whole kernel
set again during its warm-up (``ModelRunner.warmup_kernels``: 44 s of start-up for an int4
Llama-3.1-8B engine with a cold cache on an H200, docs/benchmarks.md).  The
operator therefore points ``TRITON_CACHE_DIR`` at a folder on the engine cache claim
(``.compile-cache`` next to the engines, mounted read-write into the serving pods), as vLLM's
deployment guides do for its torch.compile cache.  Triton's cache is keyed by the kernel
source, the GPU architecture and the Triton version, and written by rename, so pods on
different GPUs and racing pods share it safely.

``kiln build`` creates the folder (``prepare_shared_cache``) because a folder that Kubernetes
creates for a ``subPath`` mount is owned by root and not writable by the non-root serving
container; ``ensure_writable_cache_dir`` (``kiln serve`` start) falls back to a private
temporary folder, with a warning, when the configured one cannot be written (a claim from
before this folder existed, a read-only claim), so a cache problem never stops a pod.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

ENV_TRITON_CACHE_DIR = "TRITON_CACHE_DIR"
ENV_SHARED_CACHE = "KILN_COMPILE_CACHE_DIR"  # set on the build Job: the claim's shared folder
SHARED_CACHE_DIRNAME = ".compile-cache"  # on the engine cache claim, next to the engines
SHARED_CACHE_MODE = 0o2775  # group-writable (fsGroup), setgid: new subfolders keep the group


def prepare_shared_cache(environ: Mapping[str, str]) -> str | None:
    """Create the claim's shared compile-cache folder named by ``KILN_COMPILE_CACHE_DIR`` (the
    build Job sets it; ``environ`` is the process environment, passed by ``kiln build``),
    group-writable.  Returns the folder, or None when the variable is
    unset or the folder cannot be created (logged; a build never fails for it)."""
    path = environ.get(ENV_SHARED_CACHE)
    if not path:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        if os.stat(path).st_uid == os.getuid():
            os.chmod(path, SHARED_CACHE_MODE)
    except OSError as e:
        log.warning("cannot prepare the shared compile cache %s: %s", path, e.strerror or e)
        return None
    return path


def ensure_writable_cache_dir(environ: MutableMapping[str, str]) -> str | None:
    """Make sure Triton can write its cache: when ``TRITON_CACHE_DIR`` is set, create it and
    test a write there; if that fails (``OSError``: not a folder, read-only, owned by another
    user), point ``TRITON_CACHE_DIR`` at a new private temporary folder (removed when the
    process exits) and log a warning.

    ``environ`` is the environment Triton will read (``kiln serve`` passes ``os.environ``).
    Returns the cache folder in use (None when ``TRITON_CACHE_DIR`` is unset: Triton's
    default).  Call it before the first kernel compiles.  Never raises ``OSError`` for the
    configured folder; only creating the fallback under the temp dir can.
    """
    path = environ.get(ENV_TRITON_CACHE_DIR)
    if not path:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kiln-write-test-"):
            pass
        return path
    except OSError as e:
        if os.path.lexists(path) and not os.path.isdir(path):
            why = "it is not a folder"
        elif isinstance(e, (FileExistsError, NotADirectoryError)):
            why = "a part of the path is not a folder"
        else:
            why = e.strerror or str(e)
        fallback = tempfile.mkdtemp(prefix="kiln-triton-cache-")
        atexit.register(shutil.rmtree, fallback, True)  # private to this process: removed at exit
        log.warning("%s=%s is not writable (%s); compiled kernels go to %s for this process only, so the "
                    "next start compiles them again", ENV_TRITON_CACHE_DIR, path, why, fallback)
        environ[ENV_TRITON_CACHE_DIR] = fallback
        return fallback
