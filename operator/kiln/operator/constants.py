"""Names shared by the operator's modules: API coordinates, labels, the field manager.

Ports, paths and metric names come from ``kiln.common`` so the serving side and the
operator cannot drift apart.
"""

from __future__ import annotations

from kiln.common.constants import (  # noqa: F401  (re-exported)
    DEFAULT_CACHE_ROOT,
    HEALTH_PATH,
    HTTP_PORT,
    METRICS_PATH,
    READY_PATH,
)
from kiln.common.metrics import METRIC_REQUEST_QUEUE_TIME  # noqa: F401  (re-exported)

GROUP = "kiln.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceEngine"
PLURAL = "inferenceengines"

FIELD_MANAGER = "kiln-operator"  # the one field manager of every write the operator makes

# Labels on every child.  Selectors use only LABEL_ENGINE + LABEL_COMPONENT (immutable ones).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_ENGINE = "kiln.dev/engine"  # the owning InferenceEngine's name
LABEL_ENGINE_HASH = "kiln.dev/engine-hash"  # engine hash the pod runs / the Job builds
LABEL_CACHE_CLAIM = "kiln.dev/cache-claim"  # engine records: which cache claim holds the engine
MANAGED_BY = "kiln-operator"
APP_NAME = "kiln-engine"

COMPONENT_SERVER = "server"
COMPONENT_BUILD = "build"
COMPONENT_CACHE = "engine-cache"
COMPONENT_RECORD = "engine-record"
COMPONENT_GC = "engine-gc"  # the engine cache's cleanup Jobs

# Engine record annotations (the engine cache lifecycle, enginegc.py).
ANNOTATION_UNUSED_SINCE = "kiln.dev/unused-since"  # RFC 3339: no resource has used the engine since
ANNOTATION_DELETING = "kiln.dev/deleting"  # the cleanup Job deleting the engine: not served nor built meanwhile
# On an InferenceEngine, written by the Kiln router (its only write): RFC 3339 time of the last
# request it held or forwarded for the engine; the scale-to-zero idle window's clock (idle.py).
ANNOTATION_LAST_REQUEST = "kiln.dev/last-request-time"

CONTAINER_NAME = "kiln"
MODELS_MOUNT = "/models"  # where a model source claim (spec.model.pvc) is mounted
TERMINATION_LOG = "/dev/termination-log"  # a container's termination message (Kubernetes' default path)
TMP_MOUNT = "/tmp"  # writable scratch (the root filesystem is read-only)
# The serving pods' Triton kernel cache: a folder on the engine cache claim (created by the
# build Job, kiln.runtime.compile_cache), mounted read-write there.
COMPILE_CACHE_SUBPATH = ".compile-cache"
COMPILE_CACHE_MOUNT = "/var/cache/kiln"

HPA_METRIC_NAME = METRIC_REQUEST_QUEUE_TIME  # pods metric served by prometheus-adapter

# Condition types and phases (status).
COND_ENGINE_BUILT = "EngineBuilt"
COND_AVAILABLE = "Available"
COND_PROGRESSING = "Progressing"
COND_DEGRADED = "Degraded"
CONDITION_TYPES = (COND_ENGINE_BUILT, COND_AVAILABLE, COND_PROGRESSING, COND_DEGRADED)

PHASE_PENDING = "Pending"
PHASE_BUILDING = "Building"
PHASE_DEPLOYING = "Deploying"
PHASE_READY = "Ready"
PHASE_DEGRADED = "Degraded"
PHASE_SUSPENDED = "Suspended"

DEFAULT_RUNTIME_IMAGE = "ghcr.io/kiln-dev/kiln-runtime:0.1.0"
