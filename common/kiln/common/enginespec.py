"""The engine spec: what an engine is built from, and its content address (the engine hash).

Torch-free and dependency-free on purpose: ``kiln build`` (runtime image) and the operator
(``kiln.operator``, slim image without torch) both import this module, so the operator knows
an engine's path before it is built and both sides always agree on it.

The public API::

    spec = BuildSpec.from_dict(ie_spec)          # an InferenceEngine ``spec`` (``model`` + ``build``)
    spec = BuildSpec.from_cli(model="builtin:smollm2-135m-instruct", quantization="int4-awq")
    normalize_build_spec(ie_spec) -> dict        # canonical, defaults filled, irrelevant knobs dropped
    engine_hash(ie_spec_or_BuildSpec) -> str     # 16 hex chars of sha256 over canonical JSON
    engine_dir(cache_root, hash) -> str          # "<cache_root>/<hash>"

Equivalent spellings give the same hash: an omitted default and the default written out, key
order, ``"0.5"`` / ``0.5`` / ``"500m"`` for decimal quantities, ``int4_awq`` / ``INT4-AWQ`` for
method names, and settings that a method ignores (``groupSize`` with ``fp8``) are dropped.

The model source and calibration references are ``kiln.common.modelref``, the value readers
(quantities, canonical JSON) ``kiln.common.specvalues``; both are re-exported here.  An engine
folder's manifest (reading it, checking that an engine is complete) is
``kiln.common.manifest``; ports and paths are ``kiln.common.constants``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Mapping

from .constants import ENGINE_FORMAT_VERSION, HASH_LENGTH
# the model source and calibration data, and the value readers, live in their own modules
# (re-exported here: ``from kiln.common.enginespec import ModelRef`` keeps working)
from .modelref import CALIBRATION_MOUNT, MODEL_SOURCE_KINDS, CalibrationRef, ModelRef  # noqa: F401
from .specvalues import (EngineSpecError, _claim_path, _decimal_str, _int,  # noqa: F401
                         canonical_json, parse_quantity)

__all__ = [
    "QUANTIZATION_METHODS", "CALIBRATING_METHODS", "GROUP_SIZES", "KV_CACHE_DTYPES", "BUILD_DEFAULTS",
    "EngineSpecError", "ModelRef", "CalibrationRef", "BuildSpec", "parse_quantity", "canonical_json",
    "normalize_build_spec", "engine_hash", "engine_dir", "HeadSpec",
]

# --- build knobs --------------------------------------------------------------------------
# auto: keep a pre-quantized checkpoint's own method (compressed-tensors, GPTQ, AWQ), none on float weights
QUANTIZATION_METHODS = ("none", "fp8", "int8-smoothquant", "int4-awq", "int4-gptq", "auto")
CALIBRATING_METHODS = ("fp8", "int8-smoothquant", "int4-awq", "int4-gptq")  # need calibration text
GROUPED_METHODS = ("int4-awq", "int4-gptq")  # take a group size
GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8")

# Defaults, in the CRD's spelling (camelCase).  The CRD's `default:` values must equal these
# (tests/operator/test_crd.py checks it), and `kiln build`'s flags should default to them.
BUILD_DEFAULTS: dict[str, Any] = {
    "quantization": "none",
    "groupSize": 128,
    "smoothquantAlpha": 0.5,  # a number in the CRD; hashed as the canonical decimal string "0.5"
    "kvCacheDtype": "auto",
    "calibrationSamples": 128,
    "quantizeLmHead": False,
    "maxSeqLen": 4096,
    "maxBatchSize": 64,
    "maxNumTokens": 8192,
}

# sha256 of the shipped default calibration data (kiln/runtime/data/calibration_mix.jsonl), in
# every calibrating engine's hash: new default data, new engines (a test checks the file).
DEFAULT_CALIBRATION_SHA256 = "sha256:d49fc5083f4ab169a2ab5f8e5301831f37881a1f90cc12ab0ce861a1d827f3e3"


# Bounds of the integer build fields, the same as the CRD's minimum / maximum (a test holds
# them equal), so `kiln build` refuses what `kubectl apply` would.
BUILD_INT_BOUNDS = {"calibrationSamples": (1, 100000), "maxSeqLen": (16, 1048576),
                    "maxBatchSize": (1, 4096), "maxNumTokens": (16, 1048576)}


def _method(value: Any) -> str:
    m = str(value if value is not None else "none").strip().lower().replace("_", "-")
    if m in ("", "bf16", "bfloat16", "fp16", "float16"):
        m = "none"
    if m not in QUANTIZATION_METHODS:
        raise EngineSpecError(
            f"build.quantization: unknown method {value!r}; one of {', '.join(QUANTIZATION_METHODS)}")
    return m


@dataclass(frozen=True)
class BuildSpec:
    """A normalized build spec: every field that changes the bytes of an engine, nothing else.

    Fields:
        source: the model source.
        quantization: one of ``QUANTIZATION_METHODS`` (``auto``: what a pre-quantized checkpoint
            has, ``none`` for float weights; the build decides, from the source's config).
        group_size: int4 group size in columns (32, 64 or 128); only for ``int4-*``.
        smoothquant_alpha: SmoothQuant migration strength as a canonical decimal string.
        kv_cache_dtype: ``auto`` (the model dtype) or ``fp8`` (calibrated scales).
        calibration_samples: number of calibration text samples (calibrating methods only).
        quantize_lm_head: also quantize the LM head (``int4-*`` only; as TensorRT-LLM's
            ``quantize_lm_head`` and Intel auto-round's ``--quant_lm_head``): at batch 1 the
            bf16 LM head of a 128k vocabulary is ~10% of an int4 model's weight bytes.
        max_seq_len: longest sequence in tokens the engine is built for.
        max_batch_size: most sequences in one batch.
        max_num_tokens: most tokens in one forward pass (prefill chunk budget).
        calibration: the calibration data (None: the shipped mixture); hashed when calibrating.
        format_version: ``ENGINE_FORMAT_VERSION``.
    """

    source: ModelRef
    quantization: str = BUILD_DEFAULTS["quantization"]
    group_size: int = BUILD_DEFAULTS["groupSize"]
    smoothquant_alpha: str = BUILD_DEFAULTS["smoothquantAlpha"]
    kv_cache_dtype: str = BUILD_DEFAULTS["kvCacheDtype"]
    calibration_samples: int = BUILD_DEFAULTS["calibrationSamples"]
    quantize_lm_head: bool = BUILD_DEFAULTS["quantizeLmHead"]
    max_seq_len: int = BUILD_DEFAULTS["maxSeqLen"]
    max_batch_size: int = BUILD_DEFAULTS["maxBatchSize"]
    max_num_tokens: int = BUILD_DEFAULTS["maxNumTokens"]
    calibration: CalibrationRef | None = None
    format_version: int = field(default=ENGINE_FORMAT_VERSION)

    def __post_init__(self) -> None:
        method = _method(self.quantization)
        object.__setattr__(self, "quantization", method)
        gs = _int(self.group_size, "build.groupSize")
        if method in GROUPED_METHODS and gs not in GROUP_SIZES:
            raise EngineSpecError(f"build.groupSize: {gs} is not one of {GROUP_SIZES}")
        object.__setattr__(self, "group_size", gs)
        alpha = parse_quantity(self.smoothquant_alpha, "build.smoothquantAlpha")
        if not (Decimal(0) <= alpha <= Decimal(1)):
            raise EngineSpecError(f"build.smoothquantAlpha: {self.smoothquant_alpha!r} is not in [0, 1]")
        object.__setattr__(self, "smoothquant_alpha", _decimal_str(alpha))
        kv = str(self.kv_cache_dtype or "auto").strip().lower()
        if kv not in KV_CACHE_DTYPES:
            raise EngineSpecError(f"build.kvCacheDtype: {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        object.__setattr__(self, "kv_cache_dtype", kv)
        if not isinstance(self.quantize_lm_head, bool):
            raise EngineSpecError(f"build.quantizeLmHead: expected true or false, got {self.quantize_lm_head!r}")
        for name, key in (("calibration_samples", "calibrationSamples"), ("max_seq_len", "maxSeqLen"),
                          ("max_batch_size", "maxBatchSize"), ("max_num_tokens", "maxNumTokens")):
            object.__setattr__(self, name, _int(getattr(self, name), f"build.{key}", *BUILD_INT_BOUNDS[key]))

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "BuildSpec":
        """From an InferenceEngine ``spec`` (or any mapping with ``model`` and optional
        ``build`` in the CRD's camelCase).  Missing or ``None`` build fields take
        ``BUILD_DEFAULTS``; unrelated keys (``runtime``, ``replicas``...) are ignored.
        Raises ``EngineSpecError``."""
        if not isinstance(spec, Mapping):
            raise EngineSpecError("spec: expected an object")
        build = spec.get("build") or {}
        if not isinstance(build, Mapping):
            raise EngineSpecError("build: expected an object")

        def get(key: str) -> Any:
            v = build.get(key)
            return BUILD_DEFAULTS[key] if v is None else v

        return cls(
            source=ModelRef.from_dict(spec.get("model") or {}),
            quantization=get("quantization"),
            group_size=get("groupSize"),
            smoothquant_alpha=get("smoothquantAlpha"),
            kv_cache_dtype=get("kvCacheDtype"),
            calibration_samples=get("calibrationSamples"),
            quantize_lm_head=get("quantizeLmHead"),
            max_seq_len=get("maxSeqLen"),
            max_batch_size=get("maxBatchSize"),
            max_num_tokens=get("maxNumTokens"),
            calibration=CalibrationRef.from_dict(build.get("calibration")),
        )

    @classmethod
    def from_cli(cls, model: str, *, quantization: str | None = None, group_size: int | None = None,
                 smoothquant_alpha: Any = None, kv_cache_dtype: str | None = None,
                 calibration_samples: int | None = None, max_seq_len: int | None = None,
                 max_batch_size: int | None = None, max_num_tokens: int | None = None,
                 checksum: str | None = None, quantize_lm_head: bool | None = None,
                 calibration: CalibrationRef | None = None) -> "BuildSpec":
        """From ``kiln build`` flags (``None`` means the flag was not given: the default);
        ``calibration`` is ``--calibration-data`` with the checksum of its bytes."""
        d = BUILD_DEFAULTS
        return cls(
            source=ModelRef.from_string(model, checksum=checksum),
            quantization=d["quantization"] if quantization is None else quantization,
            group_size=d["groupSize"] if group_size is None else group_size,
            smoothquant_alpha=d["smoothquantAlpha"] if smoothquant_alpha is None else smoothquant_alpha,
            kv_cache_dtype=d["kvCacheDtype"] if kv_cache_dtype is None else kv_cache_dtype,
            calibration_samples=d["calibrationSamples"] if calibration_samples is None else calibration_samples,
            quantize_lm_head=d["quantizeLmHead"] if quantize_lm_head is None else quantize_lm_head,
            max_seq_len=d["maxSeqLen"] if max_seq_len is None else max_seq_len,
            max_batch_size=d["maxBatchSize"] if max_batch_size is None else max_batch_size,
            max_num_tokens=d["maxNumTokens"] if max_num_tokens is None else max_num_tokens,
            calibration=calibration,
        )

    @property
    def lm_head_quantized(self) -> bool:
        """True when the engine's LM head is quantized (``quantize_lm_head`` with an int4 method;
        other methods ignore the knob, and so does the hash)."""
        return self.quantize_lm_head and self.quantization in GROUPED_METHODS

    @property
    def calibrates(self) -> bool:
        """True when the build runs calibration (and wants a GPU in a real cluster)."""
        return self.quantization in CALIBRATING_METHODS or self.kv_cache_dtype == "fp8"

    def to_dict(self) -> dict[str, Any]:
        """The canonical form that is hashed.  Settings a method ignores are left out, so that
        writing them or not gives the same hash."""
        q: dict[str, Any] = {"method": self.quantization}
        if self.quantization in GROUPED_METHODS:
            q["group_size"] = self.group_size
            if self.lm_head_quantized:  # absent when false: engines built before the knob keep their hash
                q["lm_head"] = True
        if self.quantization == "int8-smoothquant":
            q["alpha"] = self.smoothquant_alpha
        if self.quantization in CALIBRATING_METHODS:
            q["calibration_samples"] = self.calibration_samples
        kv: dict[str, Any] = {"dtype": self.kv_cache_dtype}
        if self.kv_cache_dtype == "fp8":
            kv["calibration_samples"] = self.calibration_samples
        d = {
            "format_version": self.format_version,
            "source": self.source.to_dict(),
            "quantization": q,
            "kv_cache": kv,
            "limits": {"max_seq_len": self.max_seq_len, "max_batch_size": self.max_batch_size,
                       "max_num_tokens": self.max_num_tokens},
        }
        if self.calibrates:  # the data's bytes, not where they live: different data, different engine
            d["calibration_data"] = (self.calibration.to_dict() if self.calibration
                                     else {"sha256": DEFAULT_CALIBRATION_SHA256})
        return d

    def hash(self, length: int = HASH_LENGTH) -> str:
        """The engine hash: the first ``length`` hex chars of sha256(canonical JSON)."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()[:length]

    command = ("build",)  # the kiln subcommand that writes it (not a field: not hashed)

    def to_build_args(self, output: str, models_mount: str = "/models", calibration_mount: str = CALIBRATION_MOUNT) -> list[str]:
        """The ``kiln build`` arguments (after ``build``) that build exactly this spec."""
        args = ["--model", self.source.to_cli(), "--output", output, "--quantization", self.quantization]
        if self.source.kind == "pvc":
            args += ["--models-mount", models_mount]
        if self.quantization in GROUPED_METHODS:
            args += ["--group-size", str(self.group_size)]
            if self.lm_head_quantized:
                args += ["--quantize-lm-head"]
        if self.quantization == "int8-smoothquant":
            args += ["--smoothquant-alpha", self.smoothquant_alpha]
        args += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.calibrates:
            args += ["--calibration-samples", str(self.calibration_samples)]
            if self.calibration:
                args += ["--calibration-data", self.calibration.to_cli(calibration_mount)]
                if self.calibration.checksum:
                    args += ["--calibration-checksum", self.calibration.checksum]
        args += ["--max-seq-len", str(self.max_seq_len), "--max-batch-size", str(self.max_batch_size),
                 "--max-num-tokens", str(self.max_num_tokens)]
        if self.source.checksum:
            args += ["--source-checksum", self.source.checksum]
        return args



@dataclass(frozen=True)
class HeadSpec:
    """An EAGLE / EAGLE-3 head checkpoint fetched onto an engine cache claim, read as it is (no
    quantization, no build limits): content-addressed like an engine, by its source only, so a
    head lives at ``<cache_root>/<hash>`` beside the engines and is shared, recorded and cleaned
    up as they are.  ``kiln head fetch`` writes it (``command``, ``to_build_args``).

    Fields:
        source: where the head comes from (``huggingFace`` with its revision; a head on a claim
            is mounted where it is and needs no fetch).
        format_version: ``ENGINE_FORMAT_VERSION``.
    """

    source: ModelRef
    format_version: int = field(default=ENGINE_FORMAT_VERSION)

    command = ("head",)  # the kiln subcommand that writes it
    quantization = "none"  # read as it is
    calibrates = False
    calibration = None

    def to_dict(self) -> dict[str, Any]:
        """The canonical form that is hashed (a head never hashes like an engine: its own key)."""
        return {"format_version": self.format_version, "eagle_head": self.source.to_dict()}

    def hash(self, length: int = HASH_LENGTH) -> str:
        """The head's content address: ``length`` hex chars of sha256(canonical JSON)."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()[:length]

    def to_build_args(self, output: str, models_mount: str = "/models", calibration_mount: str = "") -> list[str]:
        """``kiln head`` arguments (after ``head``) that fetch exactly this head into ``output``."""
        return ["fetch", "--source", self.source.to_cli(), "--output", output]


def normalize_build_spec(spec: Mapping[str, Any] | BuildSpec) -> dict[str, Any]:
    """Normalize an InferenceEngine ``spec`` (or a ``BuildSpec``) into the canonical dict that
    ``engine_hash`` hashes.  Raises ``EngineSpecError``."""
    bs = spec if isinstance(spec, BuildSpec) else BuildSpec.from_dict(spec)
    return bs.to_dict()


def engine_hash(spec: Mapping[str, Any] | BuildSpec, length: int = HASH_LENGTH) -> str:
    """The engine hash of a spec: ``length`` hex chars (default 16) of sha256 over the
    canonical JSON of ``normalize_build_spec(spec)``.  Raises ``EngineSpecError``."""
    bs = spec if isinstance(spec, BuildSpec) else BuildSpec.from_dict(spec)
    return bs.hash(length)


def engine_dir(cache_root: str, hash_: str) -> str:
    """Where the engine with this hash lives in an engine cache: ``<cache_root>/<hash>``."""
    return os.path.join(cache_root, hash_)
