"""``spec.runtime.speculative``: speculative decoding as typed values, its ``kiln serve`` flags,
and the draft model as a second engine.

Three methods (``kiln serve --speculative-method``, ``kiln.runtime.spec_decode``):

- ``ngram`` (prompt lookup) needs no model: only flags.
- ``draft`` runs a smaller model with the target's tokenizer.  Its ``draftModel`` is built like
  ``spec.model``: a ``BuildSpec`` of its own (its source, or the resource's model when it names
  none, with its own ``quantization``/``groupSize``, and the target's build limits, KV cache
  dtype and calibration, so the draft serves the target's context), hashed by the same
  ``kiln.common.enginespec`` function.  The draft engine is therefore content-addressed and
  shared on the claim like any engine (its own build Job ``kiln-build-<draft hash>-<claim>``
  and engine record); the pods start once both engines are complete and get
  ``--speculative-model /engines/<draft hash>``.  The target engine's hash does not change:
  the same target bytes serve with or without a draft, so they are built once.  The draft
  hash is a pod-template label (a new draft rolls the pods) and is kept from removal by the
  engine cache cleanup like the target's.
- ``eagle`` runs an EAGLE / EAGLE-3 head checkpoint folder (``config.json`` + weights), read
  as it is (not quantized): a folder on a claim is mounted read-only into the serving pods; a
  Hub repository is fetched onto the engine cache claim by the same build flow, its Job running
  ``kiln head fetch`` instead of ``kiln build`` (``HeadSpec``: content-addressed by its source,
  at ``/engines/<head hash>``, recorded, shared and cleaned up like an engine).

Refused before any pod (``InvalidSpec``), as ``kiln serve`` would refuse them at start:
speculation with ``tensorParallelSize`` above 1, ``draft``/``eagle`` without ``draftModel``,
``ngram`` with one, a draft that is the target engine itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kiln.common.enginespec import BuildSpec, EngineSpecError, HeadSpec, ModelRef, engine_dir
from kiln.common.specvalues import _claim_path

from . import constants as c

__all__ = ["SPECULATIVE_METHODS", "EagleHead", "SpeculativeSpec", "parse_speculative", "speculative_serve_args",
           "eagle_volumes", "SPECULATIVE_MOUNT", "LABEL_DRAFT_ENGINE_HASH"]

SPECULATIVE_METHODS = ("ngram", "draft", "eagle")  # = kiln.runtime.spec_decode.config (a test holds them equal)
NUM_TOKENS_BOUNDS = (1, 16)  # --num-speculative-tokens, as the runtime's SpeculativeConfig
PROMPT_LOOKUP_BOUNDS = (1, 64)
SPECULATIVE_MOUNT = "/speculative"  # where an EAGLE head's claim is mounted in the serving pods
LABEL_DRAFT_ENGINE_HASH = "kiln.dev/draft-engine-hash"  # serving pod template: the draft engine it runs
_PATH = "runtime.speculative"


@dataclass(frozen=True)
class EagleHead:
    """An EAGLE head folder on a claim: ``claim`` and ``path`` (relative to its root)."""

    claim: str
    path: str


@dataclass(frozen=True)
class SpeculativeSpec:
    """``spec.runtime.speculative`` parsed.  None fields are not passed to ``kiln serve`` (its
    defaults: 4 tokens, the n-gram window 2..5, the measured batch size per method).

    Fields:
        method: ``ngram``, ``draft`` or ``eagle``.
        num_tokens: drafts per sequence and step (tokens, 1..16).
        disable_by_batch_size: running sequences above which no drafts are proposed.
        prompt_lookup_min / prompt_lookup_max: the n-gram window (tokens; ``ngram`` only).
        draft_engine: what the second artefact on the claim is made from and hashed over: the
            draft model's normalized ``BuildSpec`` (``draft``), or the ``HeadSpec`` of an EAGLE
            head from the Hub (``eagle`` with ``draftModel.huggingFace``), else None.
        draft_model: its ``ModelSpec`` (how its Job reaches the source: a claim to mount, a
            Hub token).
        eagle: an EAGLE head on a claim (``eagle`` with ``draftModel.pvc``), mounted as it is.
    """

    method: str
    num_tokens: int | None = None
    disable_by_batch_size: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_engine: BuildSpec | HeadSpec | None = None
    draft_model: Any = None  # spec.ModelSpec (not imported: spec imports this module)
    eagle: EagleHead | None = None

    @property
    def draft_hash(self) -> str | None:
        """The draft engine's hash (``draft`` only), else None."""
        return self.draft_engine.hash() if self.draft_engine is not None else None


def _bounded(raw: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise EngineSpecError(f"{_PATH}.{key}: expected an integer in [{low}, {high}], got {v!r}")
    return v


_DRAFT_BUILD_KEYS = ("quantization", "groupSize")
_SOURCES = ("builtin", "pvc", "huggingFace")


def _draft(raw_spec: Mapping[str, Any], dm: Mapping[str, Any], target: BuildSpec,
           parse_model: Callable[[Mapping[str, Any]], Any]) -> tuple[BuildSpec, Any]:
    """The draft engine's build spec and model spec (``draft``)."""
    source = {k: dm[k] for k in (*_SOURCES, "checksum") if dm.get(k) not in (None, "", {})}
    if not any(k in source for k in _SOURCES):  # no source: a (quantized) engine of the resource's own model
        source = dict(raw_spec.get("model") or {})
    source.pop("servedModelName", None)
    build = dict(raw_spec.get("build") or {})
    build.pop("quantizeLmHead", None)  # the target's LM head setting is not the draft's
    build.pop("accuracyGate", None)
    for key in _DRAFT_BUILD_KEYS:
        build.pop(key, None)
        if dm.get(key) is not None:
            build[key] = dm[key]
    try:
        engine = BuildSpec.from_dict({"model": source, "build": build})
        model = parse_model({"model": source})
    except EngineSpecError as e:
        raise EngineSpecError(f"{_PATH}.draftModel: {e}") from None
    if engine.hash() == target.hash():
        raise EngineSpecError(f"{_PATH}.draftModel: the draft would be the served engine itself (same source and "
                              "build); name a smaller model or a quantization, e.g. quantization: int4-awq")
    return engine, model


def _eagle(dm: Mapping[str, Any]) -> EagleHead:
    pvc = dm.get("pvc")
    if not isinstance(pvc, Mapping) or not pvc.get("claimName") or not pvc.get("path"):
        raise EngineSpecError(f"{_PATH}.draftModel: an EAGLE head is a folder on a claim: pvc with claimName and path")
    for key in ("builtin", "quantization", "groupSize", "checksum"):
        if dm.get(key) is not None:
            raise EngineSpecError(f"{_PATH}.draftModel.{key}: an EAGLE head is read as it is (not built)")
    path = _claim_path(pvc["path"], f"{_PATH}.draftModel.pvc.path")
    if path == ".":
        raise EngineSpecError(f"{_PATH}.draftModel.pvc.path: name the head's folder on the claim")
    return EagleHead(str(pvc["claimName"]), path)


def parse_speculative(rt: Mapping[str, Any], raw_spec: Mapping[str, Any], target: BuildSpec, tensor_parallel: int,
                      parse_model: Callable[[Mapping[str, Any]], Any]) -> SpeculativeSpec | None:
    """``runtime.speculative`` of a raw spec, or None when absent.  ``target`` is the served
    engine's build spec; ``parse_model(raw)`` reads a ``{"model": ...}`` into a ``ModelSpec``.
    Raises ``EngineSpecError`` naming the field."""
    sp = rt.get("speculative")
    if sp is None:
        return None
    if not isinstance(sp, Mapping):
        raise EngineSpecError(f"{_PATH}: expected an object, got {type(sp).__name__}")
    unknown = set(sp) - {"method", "numTokens", "disableByBatchSize", "promptLookupMin", "promptLookupMax",
                         "draftModel"}
    if unknown:
        raise EngineSpecError(f"{_PATH}: unknown field(s) {', '.join(sorted(unknown))}")
    method = sp.get("method")
    if method not in SPECULATIVE_METHODS:
        raise EngineSpecError(f"{_PATH}.method: required, one of {', '.join(SPECULATIVE_METHODS)}; got {method!r}")
    if tensor_parallel > 1:
        raise EngineSpecError(f"{_PATH}: speculative decoding is not served with runtime.tensorParallelSize > 1 "
                              "(kiln serve refuses it: its tensor-parallel workers verify no drafts)")
    lo = _bounded(sp, "promptLookupMin", *PROMPT_LOOKUP_BOUNDS)
    hi = _bounded(sp, "promptLookupMax", *PROMPT_LOOKUP_BOUNDS)
    if method != "ngram" and (lo is not None or hi is not None):
        raise EngineSpecError(f"{_PATH}.promptLookupMin/promptLookupMax: apply to method ngram only")
    if (lo if lo is not None else 2) > (hi if hi is not None else 5):
        raise EngineSpecError(f"{_PATH}.promptLookupMin {lo if lo is not None else 2} is larger than "
                              f"promptLookupMax {hi if hi is not None else 5}")
    out = SpeculativeSpec(method=method, num_tokens=_bounded(sp, "numTokens", *NUM_TOKENS_BOUNDS),
                          disable_by_batch_size=_bounded(sp, "disableByBatchSize", 1, 4096),
                          prompt_lookup_min=lo, prompt_lookup_max=hi)
    dm = sp.get("draftModel")
    if method == "ngram":
        if dm is not None:
            raise EngineSpecError(f"{_PATH}.draftModel: method ngram uses no model; leave it out")
        return out
    if not isinstance(dm, Mapping):
        raise EngineSpecError(f"{_PATH}.draftModel: required for method {method} (the "
                              f"{'draft model' if method == 'draft' else 'EAGLE head checkpoint'})")
    if sum(1 for k in _SOURCES if dm.get(k) not in (None, "", {})) > 1:
        raise EngineSpecError(f"{_PATH}.draftModel: at most one source of {', '.join(_SOURCES)}")
    if method == "eagle" and dm.get("huggingFace"):  # fetched onto the engine cache claim, as it is
        for key in ("quantization", "groupSize"):
            if dm.get(key) is not None:
                raise EngineSpecError(f"{_PATH}.draftModel.{key}: an EAGLE head is read as it is (not built)")
        try:
            model = parse_model({"model": {"huggingFace": dm["huggingFace"]}})
            head = HeadSpec(ModelRef.from_dict({"huggingFace": dm["huggingFace"], "checksum": dm.get("checksum")}))
        except EngineSpecError as e:
            raise EngineSpecError(f"{_PATH}.draftModel: {e}") from None
        return dataclasses.replace(out, draft_engine=head, draft_model=model)
    if method == "eagle":
        return dataclasses.replace(out, eagle=_eagle(dm))
    engine, model = _draft(raw_spec, dm, target, parse_model)
    return dataclasses.replace(out, draft_engine=engine, draft_model=model)


def _eagle_dir(head: EagleHead, cache_claim: str) -> str:
    """Where the serving pods read the EAGLE head: under ``/engines`` when it is on the engine
    cache claim (mounted already), else under ``SPECULATIVE_MOUNT``."""
    root = c.DEFAULT_CACHE_ROOT if head.claim == cache_claim else SPECULATIVE_MOUNT
    return f"{root}/{head.path}"


def speculative_serve_args(sp: SpeculativeSpec | None, cache_claim: str) -> list[str]:
    """The ``kiln serve`` flags of ``sp`` (none when off)."""
    if sp is None:
        return []
    args = ["--speculative-method", sp.method]
    for value, flag in ((sp.num_tokens, "--num-speculative-tokens"),
                        (sp.prompt_lookup_min, "--prompt-lookup-min"), (sp.prompt_lookup_max, "--prompt-lookup-max"),
                        (sp.disable_by_batch_size, "--speculative-disable-by-batch-size")):
        if value is not None:
            args += [flag, str(value)]
    if sp.draft_engine is not None:
        args += ["--speculative-model", engine_dir(c.DEFAULT_CACHE_ROOT, sp.draft_hash)]
    elif sp.eagle is not None:
        args += ["--speculative-model", _eagle_dir(sp.eagle, cache_claim)]
    return args


def eagle_volumes(sp: SpeculativeSpec | None, cache_claim: str) -> tuple[list[dict], list[dict]]:
    """``(volumes, volume mounts)`` the serving pod needs for an EAGLE head on a claim other
    than the engine cache (read-only); none otherwise."""
    if sp is None or sp.eagle is None or sp.eagle.claim == cache_claim:
        return [], []
    return ([{"name": "speculative", "persistentVolumeClaim": {"claimName": sp.eagle.claim, "readOnly": True}}],
            [{"name": "speculative", "mountPath": SPECULATIVE_MOUNT, "readOnly": True}])


def draft_build_spec(spec):
    """``spec`` (an ``InferenceEngineSpec``) as the draft engine's build sees it: the draft's
    build spec and model source in place of the target's (the build Job's pod settings, claim
    and image stay the resource's).  None without a draft."""
    sp = spec.runtime.speculative
    if sp is None or sp.draft_engine is None:
        return None
    build = dataclasses.replace(spec.build, accuracy_gate=None)  # the gate measures the served engine
    return dataclasses.replace(spec, engine=sp.draft_engine, model=sp.draft_model, build=build)
