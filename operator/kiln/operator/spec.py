"""The InferenceEngine ``spec`` as a typed, read-only tree, parsed once per reconcile.

``parse_spec(raw)`` turns the resource's ``spec`` (a plain dict, as the API server returns it)
into an ``InferenceEngineSpec`` with the CRD's defaults (crds/inferenceengine.yaml) filled, so
the planner and the builders read fields instead of ``spec.get(...) or {}`` chains.  A spec the
operator cannot act on raises ``EngineSpecError`` whose message names the field; the reconcile
reports it as the ``InvalidSpec`` condition reason.

The parser checks types and the rules the API server cannot (the engine spec's, and serving
knobs within the engine's build limits); ranges and enums are the CRD's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kiln.common.enginespec import BuildSpec, EngineSpecError
from kiln.common.tensorparallel import ParallelShape, tensor_parallel_problem

from .autoscaling_spec import AUTOSCALING_MODES, AutoscalingSpec, parse_autoscaling  # noqa: F401
from .gateway_spec import GatewaySpec, parse_gateway
from .adapter_spec import AdapterSpec, LoRASpec, parse_adapters, parse_lora
from .podspec import EnvVar, PodOverrides, parse_env, parse_pod
from .specfields import _bool, _int, _list, _number, _quantities, _section, _str
from .speculative import SpeculativeSpec, parse_speculative

__all__ = [
    "EngineSpecError", "SecretKeyRef", "ModelSpec", "ComputeResources", "BuildJobSpec", "EnvVar",
    "RuntimeSpec", "ResourcesSpec", "AutoscalingSpec", "StorageSpec", "RolloutSpec",
    "InferenceEngineSpec", "InvalidSpec", "parse_spec", "as_spec", "source_text", "AdapterSpec", "LoRASpec",
]

@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the resource's namespace (``model.huggingFace.secretRef``,
    ``runtime.apiKeySecretRef``)."""

    name: str
    key: str = "token"


@dataclass(frozen=True)
class ModelSpec:
    """``spec.model``: where the weights come from (exactly one source; the hashed form of the
    source is ``InferenceEngineSpec.engine.source``).

    Fields:
        builtin: a model shipped with Kiln (``smollm2-135m-instruct``), or None.
        pvc_claim / pvc_path: a model folder or ``.gguf`` file on a claim, or None.
        hf_repo / hf_revision: a Hugging Face Hub repository and its pinned revision, or None.
        hf_token: the Secret key exposed to the build Job as ``HF_TOKEN``, or None.
        hf_endpoint: a Hub mirror's base URL (the build Job's ``HF_ENDPOINT``), or None: not
            hashed (the commit sha names the content wherever it is downloaded from).
        served_model_name: the name ``/v1/models`` reports; None means the resource's name.
        text: the source as one string (``builtin:NAME``, ``pvc://CLAIM/PATH``,
            ``hf://REPO@REV``): ``status.model``.
    """

    builtin: str | None = None
    pvc_claim: str | None = None
    pvc_path: str | None = None
    hf_repo: str | None = None
    hf_revision: str | None = None
    hf_token: SecretKeyRef | None = None
    hf_endpoint: str | None = None
    served_model_name: str | None = None
    text: str = ""


@dataclass(frozen=True)
class ComputeResources:
    """Requests and limits of a container, quantities as strings (``{"memory": "16Gi"}``)."""

    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildJobSpec:
    """The build Job's settings in ``spec.build`` (the settings that change the engine's bytes
    are ``InferenceEngineSpec.engine``).

    Fields:
        backoff_limit: retries of the build Job before it is marked failed.
        active_deadline_seconds: wall-clock limit of the build Job.
        resources: the build container's requests and limits (a calibrating build also gets
            the GPUs of ``spec.resources``).
        scratch_size: size of the build's download and scratch folder ``/tmp`` (an
            ``emptyDir`` size limit and the container's ``ephemeral-storage`` request).
    """

    backoff_limit: int = 1
    active_deadline_seconds: int = 7200
    resources: ComputeResources = field(default_factory=ComputeResources)
    scratch_size: str = "64Gi"  # the download folder (/tmp): ephemeral-storage request and size limit
    # build.accuracyGate: (maxPerplexityIncrease | None, minGreedyAgreement | None, numPrompts) or None
    accuracy_gate: tuple[float | None, float | None, int] | None = None
    # the Hub token and mirror of a build.calibration.huggingFace dataset (HF_TOKEN, HF_ENDPOINT
    # of the build Job; the model's when it comes from the Hub), or None
    calibration_hf_token: SecretKeyRef | None = None
    calibration_hf_endpoint: str | None = None


@dataclass(frozen=True)
class RuntimeSpec:
    """``spec.runtime``: the ``kiln serve`` knobs (not part of the engine hash).  None means
    the flag is not passed (``kiln serve`` picks, within the engine's build limits)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.85
    scheduler_policy: str = "max_utilization"
    tensor_parallel_size: int = 1
    compile_cache: bool = True  # keep Triton's kernel cache on the engine cache claim
    extra_args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()  # Pod envFrom entries (configMapRef / secretRef, prefix)
    api_key: SecretKeyRef | None = None  # a Secret key served as KILN_API_KEY (kiln serve's API key)
    shm_size: str = "2Gi"  # size limit of /dev/shm (memory-backed)
    lora: LoRASpec = field(default_factory=LoRASpec)  # LoRA serving's start flags (adapter_spec)
    speculative: SpeculativeSpec | None = None  # runtime.speculative (speculative.py); None: off


@dataclass(frozen=True)
class ResourcesSpec:
    """``spec.resources``: placement and compute of the serving pods (placement also of the
    build pods).

    Fields:
        gpus: GPUs per serving pod per tensor-parallel rank; 0 serves on CPU.
        gpu_resource_name: the extended resource of a GPU.
        compute: requests and limits of the serving container (GPUs added by the builders).
        node_selector / tolerations: as in a Pod spec.
    """

    gpus: int = 1
    gpu_resource_name: str = "nvidia.com/gpu"
    compute: ComputeResources = field(default_factory=ComputeResources)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class StorageSpec:
    """``spec.storage``: the engine cache claim, shared by the engines of a namespace.

    Fields:
        claim_name: the PersistentVolumeClaim holding ``/engines/<hash>``.
        create: create the claim when it is missing (False: it must exist).
        size / storage_class_name / access_modes: of a created claim.
    """

    claim_name: str = "kiln-engine-cache"
    create: bool = True
    size: str = "50Gi"
    storage_class_name: str | None = None
    access_modes: tuple[str, ...] = ("ReadWriteOnce",)


@dataclass(frozen=True)
class RolloutSpec:
    """``spec.rollout``: the serving Deployment's rolling update and startup budget."""

    max_surge: int = 1
    max_unavailable: int = 0
    startup_timeout_seconds: int = 1800


@dataclass(frozen=True)
class InferenceEngineSpec:
    """A parsed InferenceEngine ``spec`` (``parse_spec``), CRD defaults filled.

    Fields:
        engine: the normalized build spec (model source, quantization, build limits): what the
            engine hash is computed from.
        model / build / runtime / resources / autoscaling / storage / rollout: the sections.
        replicas: serving pods when autoscaling is off.
        image: the runtime image; empty means the operator's default.
        image_pull_policy: pull policy of the runtime image.
        pod: pod-spec overrides (affinity, topology spread, classes, pull secrets, metadata).
        suspend: serving scaled to zero and builds stopped.
        adapters: the LoRA adapters served beside the base (not part of the engine hash).
        gateway: exposure through the Gateway API (HTTPRoute, InferencePool).
    """

    engine: BuildSpec
    model: ModelSpec = field(default_factory=ModelSpec)
    build: BuildJobSpec = field(default_factory=BuildJobSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    suspend: bool = False
    adapters: tuple[AdapterSpec, ...] = ()
    pod: PodOverrides = field(default_factory=PodOverrides)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)  # spec.gateway (gateway_spec)

    @property
    def engine_hash(self) -> str:
        """The engine hash (content address of ``engine``)."""
        return self.engine.hash()

    @property
    def draft_hash(self) -> str | None:
        """The draft engine's hash (``runtime.speculative`` method ``draft``), else None."""
        sp = self.runtime.speculative
        return sp.draft_hash if sp is not None else None

    @property
    def engine_hashes(self) -> tuple[str, ...]:
        """Every engine the spec serves from: its own, then the draft's when it has one."""
        return (self.engine_hash,) + ((self.draft_hash,) if self.draft_hash else ())

    @property
    def keeps_compile_cache(self) -> bool:
        """The serving pods keep Triton's kernel cache on the engine cache claim
        (``runtime.compileCache``), unless the claim can only be mounted read-only."""
        modes = set(self.storage.access_modes)
        if modes and modes <= {"ReadOnlyMany"}:
            return False
        return self.runtime.compile_cache


@dataclass(frozen=True)
class InvalidSpec:
    """A spec the operator cannot act on: ``message`` names the field (the ``InvalidSpec``
    condition's message); ``model`` is the model source as far as it reads (``status.model``)."""

    message: str
    model: str = ""


def _compute(raw: Mapping[str, Any], path: str) -> ComputeResources:
    return ComputeResources(requests=_quantities(raw, "requests", f"{path}.requests"),
                            limits=_quantities(raw, "limits", f"{path}.limits"))


# --- the sections ---------------------------------------------------------------------------

def source_text(model: Any) -> str:
    """The model source of a raw ``spec.model`` as one string (``builtin:NAME``,
    ``pvc://CLAIM/PATH``, ``hf://REPO@REV``); empty when there is none.  Lenient: it also
    names the source of a spec that does not parse."""
    m = model if isinstance(model, Mapping) else {}
    if m.get("builtin"):
        return f"builtin:{m['builtin']}"
    pvc = m.get("pvc")
    if pvc:
        pvc = pvc if isinstance(pvc, Mapping) else {}
        return f"pvc://{pvc.get('claimName')}/{pvc.get('path', '')}"
    hf = m.get("huggingFace")
    if hf:
        hf = hf if isinstance(hf, Mapping) else {}
        return f"hf://{hf.get('repo')}" + (f"@{hf['revision']}" if hf.get("revision") else "")
    return ""


def _secret_ref(raw: Mapping[str, Any], key: str, path: str, default_key: str | None) -> SecretKeyRef | None:
    """A ``{name, key}`` Secret reference, or None when absent; ``default_key`` None makes
    the key required."""
    secret = _section(raw, key, path)
    if not secret:
        return None
    name = _str(secret, "name", f"{path}.name", None)
    if name is None:
        raise EngineSpecError(f"{path}: name is required")
    k = _str(secret, "key", f"{path}.key", default_key)
    if k is None:
        raise EngineSpecError(f"{path}: key is required")
    return SecretKeyRef(name, k)


def _model(raw: Mapping[str, Any]) -> ModelSpec:
    m = _section(raw, "model", "model")
    pvc = _section(m, "pvc", "model.pvc")
    hf = _section(m, "huggingFace", "model.huggingFace")
    token = _secret_ref(hf, "secretRef", "model.huggingFace.secretRef", "token")
    return ModelSpec(
        builtin=_str(m, "builtin", "model.builtin", None),
        pvc_claim=_str(pvc, "claimName", "model.pvc.claimName", None),
        pvc_path=_str(pvc, "path", "model.pvc.path", None),
        hf_repo=_str(hf, "repo", "model.huggingFace.repo", None),
        hf_revision=_str(hf, "revision", "model.huggingFace.revision", None),
        hf_token=token,
        hf_endpoint=_str(hf, "endpoint", "model.huggingFace.endpoint", None),
        served_model_name=_str(m, "servedModelName", "model.servedModelName", None),
        text=source_text(m))


# The builtin models' sizes that tensor parallelism splits, checked against
# runtime.tensorParallelSize when the spec is read (heads and MLP: an int4 engine's groups
# are checked once it is built, as for every source, against the engine record's shape in
# plan.py).
BUILTIN_SHAPES = {"smollm2-135m-instruct": ParallelShape(num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                         intermediate_size=1536)}


def _runtime(raw: Mapping[str, Any], engine: BuildSpec, num_adapters: int = 0) -> RuntimeSpec:
    rt = _section(raw, "runtime", "runtime")
    env, env_from = parse_env(rt)
    out = RuntimeSpec(
        max_num_seqs=_int(rt, "maxNumSeqs", "runtime.maxNumSeqs", None),
        max_num_batched_tokens=_int(rt, "maxNumBatchedTokens", "runtime.maxNumBatchedTokens", None),
        max_model_len=_int(rt, "maxModelLen", "runtime.maxModelLen", None),
        block_size=_int(rt, "blockSize", "runtime.blockSize", 16),
        kv_cache_memory_fraction=_number(rt, "kvCacheMemoryFraction", "runtime.kvCacheMemoryFraction", 0.85),
        scheduler_policy=_str(rt, "schedulerPolicy", "runtime.schedulerPolicy", "max_utilization"),
        tensor_parallel_size=_int(rt, "tensorParallelSize", "runtime.tensorParallelSize", 1),
        compile_cache=_bool(rt, "compileCache", "runtime.compileCache", True),
        extra_args=tuple(str(a) for a in _list(rt, "extraArgs", "runtime.extraArgs")),
        env=tuple(env), env_from=tuple(dict(e) for e in env_from),
        api_key=_secret_ref(rt, "apiKeySecretRef", "runtime.apiKeySecretRef", None),
        shm_size=str(rt.get("shmSize") or "2Gi"),
        lora=parse_lora(rt, num_adapters),
        speculative=parse_speculative(rt, raw, engine, _int(rt, "tensorParallelSize", "runtime.tensorParallelSize", 1),
                                      _model))
    if out.api_key is not None and any(e.name == "KILN_API_KEY" for e in out.env):
        raise EngineSpecError("runtime.env: KILN_API_KEY is set by runtime.apiKeySecretRef; set one of them")
    shape = BUILTIN_SHAPES.get(engine.source.name or "") if engine.source.kind == "builtin" else None
    problem = tensor_parallel_problem(shape, out.tensor_parallel_size, "runtime.tensorParallelSize") if shape else None
    if problem:
        raise EngineSpecError(problem)
    # kiln serve refuses to serve past an engine's build limits: every pod would crash
    for rt_field, value, build_field, limit in (
            ("maxModelLen", out.max_model_len, "maxSeqLen", engine.max_seq_len),
            ("maxNumSeqs", out.max_num_seqs, "maxBatchSize", engine.max_batch_size),
            ("maxNumBatchedTokens", out.max_num_batched_tokens, "maxNumTokens", engine.max_num_tokens)):
        if value is not None and value > limit:
            raise EngineSpecError(f"runtime.{rt_field} {value} is larger than build.{build_field} {limit}: an "
                                  f"engine serves at most the limits it was built for")
    return out


def _resources(raw: Mapping[str, Any]) -> ResourcesSpec:
    res = _section(raw, "resources", "resources")
    tolerations = []
    for i, t in enumerate(_list(res, "tolerations", "resources.tolerations")):
        if not isinstance(t, Mapping):
            raise EngineSpecError(f"resources.tolerations[{i}]: expected an object")
        tolerations.append(dict(t))
    return ResourcesSpec(
        gpus=_int(res, "gpus", "resources.gpus", 1),
        gpu_resource_name=_str(res, "gpuResourceName", "resources.gpuResourceName", "nvidia.com/gpu"),
        compute=_compute(res, "resources"),
        node_selector={str(k): str(v) for k, v in _section(res, "nodeSelector", "resources.nodeSelector").items()},
        tolerations=tuple(tolerations))


def _storage(raw: Mapping[str, Any]) -> StorageSpec:
    s = _section(raw, "storage", "storage")
    size = s.get("size")
    return StorageSpec(
        claim_name=_str(s, "claimName", "storage.claimName", "kiln-engine-cache"),
        create=_bool(s, "create", "storage.create", True),
        size="50Gi" if size is None else str(size),
        storage_class_name=_str(s, "storageClassName", "storage.storageClassName", None),
        access_modes=tuple(str(x) for x in (_list(s, "accessModes", "storage.accessModes")
                                            if "accessModes" in s else ["ReadWriteOnce"])))


def parse_spec(raw: Mapping[str, Any]) -> InferenceEngineSpec:
    """Parse an InferenceEngine ``spec``.  Raises ``EngineSpecError`` naming the field."""
    if not isinstance(raw, Mapping):
        raise EngineSpecError("spec: expected an object")
    engine = BuildSpec.from_dict(raw)
    build = _section(raw, "build", "build")
    rollout = _section(raw, "rollout", "rollout")
    model = _model(raw)
    adapters = parse_adapters(raw, model.served_model_name, engine.hash())
    return InferenceEngineSpec(
        engine=engine,
        model=model,
        adapters=adapters,
        build=BuildJobSpec(
            backoff_limit=_int(build, "backoffLimit", "build.backoffLimit", 1),
            active_deadline_seconds=_int(build, "activeDeadlineSeconds", "build.activeDeadlineSeconds", 7200),
            resources=_compute(_section(build, "resources", "build.resources"), "build.resources"),
            scratch_size=str(build.get("scratchSize") or "64Gi"),
            accuracy_gate=_gate(_section(build, "accuracyGate", "build.accuracyGate")),
            **_calibration_hub(build, model)),
        runtime=_runtime(raw, engine, len(adapters)),
        resources=_resources(raw),
        replicas=_int(raw, "replicas", "replicas", 1),
        autoscaling=parse_autoscaling(raw),
        storage=_storage(raw),
        rollout=RolloutSpec(
            max_surge=_int(rollout, "maxSurge", "rollout.maxSurge", 1),
            max_unavailable=_int(rollout, "maxUnavailable", "rollout.maxUnavailable", 0),
            startup_timeout_seconds=_int(rollout, "startupTimeoutSeconds", "rollout.startupTimeoutSeconds", 1800)),
        image=_str(raw, "image", "image", ""),
        image_pull_policy=_str(raw, "imagePullPolicy", "imagePullPolicy", "IfNotPresent"),
        suspend=_bool(raw, "suspend", "suspend", False),
        pod=parse_pod(raw),
        gateway=parse_gateway(raw))


def _calibration_hub(build: Mapping[str, Any], model: ModelSpec) -> dict[str, Any]:
    """The token Secret and mirror of ``build.calibration.huggingFace`` (defaults: the model's).
    A build Job has one ``HF_TOKEN`` and one ``HF_ENDPOINT``: a Hub model and a Hub dataset
    that name different ones are refused."""
    where = "build.calibration.huggingFace"
    hf = _section(_section(build, "calibration", "build.calibration"), "huggingFace", where)
    token = _secret_ref(hf, "secretRef", f"{where}.secretRef", "token")
    endpoint = _str(hf, "endpoint", f"{where}.endpoint", None)
    if model.hf_repo and token is not None and model.hf_token is not None and token != model.hf_token:
        raise EngineSpecError(f"{where}.secretRef: differs from model.huggingFace.secretRef; the build Job has one "
                              f"HF_TOKEN (leave it out to use the model's)")
    if model.hf_repo and endpoint is not None and endpoint != model.hf_endpoint:
        raise EngineSpecError(f"{where}.endpoint: differs from model.huggingFace.endpoint; the build Job has one "
                              f"HF_ENDPOINT (leave it out to use the model's)")
    return {"calibration_hf_token": token or (model.hf_token if hf else None),
            "calibration_hf_endpoint": endpoint or (model.hf_endpoint if hf else None)}


def _gate(g: Mapping[str, Any]) -> tuple[float | None, float | None, int] | None:
    """``build.accuracyGate``, or None when it sets no bound."""
    ppl = g.get("maxPerplexityIncrease")
    agree = g.get("minGreedyAgreement")
    for key, v in (("maxPerplexityIncrease", ppl), ("minGreedyAgreement", agree)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise EngineSpecError(f"build.accuracyGate.{key}: expected a number, got {v!r}")
    if ppl is None and agree is None:
        return None
    return (ppl, agree, _int(g, "numPrompts", "build.accuracyGate.numPrompts", 8))


def as_spec(spec: InferenceEngineSpec | Mapping[str, Any]) -> InferenceEngineSpec:
    """``spec`` itself when parsed, else ``parse_spec(spec)`` (callers holding a manifest's
    plain ``spec`` dict).  Raises ``EngineSpecError``."""
    return spec if isinstance(spec, InferenceEngineSpec) else parse_spec(spec)
