"""``spec.adapters`` and ``spec.runtime.lora`` as typed values (part of ``spec.parse_spec``).

An adapter is a PEFT LoRA folder served beside the base model under its own ``name`` (the
``model`` of a request).  Its source is a folder on a claim (``pvc``), a Hugging Face Hub
repository (``huggingFace``) or a builtin adapter (``builtin``: seeded random weights shaped for
the engine's model, ``kiln.common.adapterref``); a Job (``kiln adapter fetch``) copies,
downloads or writes it onto the engine cache claim under ``.adapters/<key>`` and checks it
against the engine, and the operator loads it into the running pods.  Adapters are not part
of the engine hash: changing the list changes neither the engine nor the pod template.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from kiln.common.adapterref import BuiltinAdapter
from kiln.common.enginespec import EngineSpecError, _claim_path

from .specfields import _section as _obj
from .specfields import _str

# The served names of adapters: what a request's ``model`` can spell (no spaces, no slash
# first), as the CRD's pattern says.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
MAX_ADAPTERS = 64  # the CRD's maxItems


@dataclass(frozen=True)
class HubSecret:
    """A Secret key holding a Hub token (``adapters[].huggingFace.secretRef``)."""

    name: str
    key: str = "token"


@dataclass(frozen=True)
class AdapterSpec:
    """One ``spec.adapters[]`` entry.

    Fields:
        name: the model name requests select the adapter by.
        pvc_claim / pvc_path: a PEFT folder on a claim (relative path), or None.
        hf_repo / hf_revision: a Hub repository and revision (None: its default branch), or None.
        hf_token: the Secret key exposed to the fetch Job as ``HF_TOKEN``, or None.
        hf_endpoint: a Hub mirror's base URL (the fetch Job's ``HF_ENDPOINT``), or None.
        builtin: a builtin adapter, or None.
        base: the engine hash a builtin adapter is shaped for (part of its key: the same
            parameters on another base are another folder); None for other sources.
    """

    name: str
    pvc_claim: str | None = None
    pvc_path: str | None = None
    hf_repo: str | None = None
    hf_revision: str | None = None
    hf_token: HubSecret | None = None
    hf_endpoint: str | None = None
    builtin: BuiltinAdapter | None = None
    base: str | None = None

    @property
    def source(self) -> str:
        """The source as one string: ``pvc://CLAIM/PATH``, ``hf://REPO[@REV]`` or the builtin's
        canonical ``builtin:NAME?rank=...`` (what ``kiln adapter fetch --source`` reads)."""
        if self.pvc_claim:
            return f"pvc://{self.pvc_claim}/{self.pvc_path}"
        if self.builtin is not None:
            return self.builtin.to_cli()
        return f"hf://{self.hf_repo}" + (f"@{self.hf_revision}" if self.hf_revision else "")

    @property
    def key(self) -> str:
        """The adapter's folder name on the engine cache claim: 16 hex chars of sha256 of
        the source's canonical JSON (the same source gives the same folder, whoever names it;
        a mirror endpoint or token is not part of it; a builtin's base engine is)."""
        if self.pvc_claim:
            doc: dict = {"pvc": [self.pvc_claim, self.pvc_path]}
        elif self.builtin is not None:
            doc = {"builtin": [self.builtin.to_cli(), self.base]}
        else:
            doc = {"hf": [self.hf_repo, self.hf_revision]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LoRASpec:
    """``spec.runtime.lora``: LoRA serving in the pods (``kiln serve --enable-lora`` with its
    slots).  These are start flags: changing one rolls the pods; the adapter list does not.

    Fields:
        enabled: serve adapters; default true when ``spec.adapters`` is not empty (set it to
            keep LoRA on with no adapters, so adding the first one does not roll the pods).
        max_loras: distinct adapters in one step (device slots, ``--max-loras``).
        max_lora_rank: the largest adapter rank (``--max-lora-rank``, 1..64).
        max_cpu_loras: adapters kept in host memory (``--max-cpu-loras``; None: max_loras).
    """

    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None


def _int(raw: Mapping[str, Any], key: str, path: str, default: int | None, low: int, high: int) -> int | None:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise EngineSpecError(f"{path}: expected an integer in {low}..{high}, got {v!r}")
    return v


def _adapter(raw: Any, path: str, base: str | None) -> AdapterSpec:
    if not isinstance(raw, Mapping):
        raise EngineSpecError(f"{path}: expected an object")
    name = _str(raw, "name", f"{path}.name")
    if name is None or not _NAME.match(name) or len(name) > 256:
        raise EngineSpecError(f"{path}.name: {name!r} is not a model name (letters, digits and . _ : / -, a letter "
                              "or digit first, at most 256 characters)")
    pvc, hf = _obj(raw, "pvc", f"{path}.pvc"), _obj(raw, "huggingFace", f"{path}.huggingFace")
    builtin = raw.get("builtin")
    if [bool(pvc), bool(hf), builtin is not None].count(True) != 1:
        raise EngineSpecError(f"{path}: exactly one source of pvc, huggingFace, builtin is required")
    if builtin is not None:
        return AdapterSpec(name, builtin=BuiltinAdapter.from_dict(builtin, f"{path}.builtin"), base=base)
    if pvc:
        claim = _str(pvc, "claimName", f"{path}.pvc.claimName")
        if claim is None:
            raise EngineSpecError(f"{path}.pvc.claimName: is required")
        return AdapterSpec(name, pvc_claim=claim, pvc_path=_claim_path(pvc.get("path"), f"{path}.pvc.path"))
    repo = _str(hf, "repo", f"{path}.huggingFace.repo")
    if repo is None:
        raise EngineSpecError(f"{path}.huggingFace.repo: is required")
    secret = _obj(hf, "secretRef", f"{path}.huggingFace.secretRef")
    token = None
    if secret:
        sname = _str(secret, "name", f"{path}.huggingFace.secretRef.name")
        if sname is None:
            raise EngineSpecError(f"{path}.huggingFace.secretRef: name is required")
        token = HubSecret(sname, _str(secret, "key", f"{path}.huggingFace.secretRef.key") or "token")
    return AdapterSpec(name, hf_repo=repo, hf_revision=_str(hf, "revision", f"{path}.huggingFace.revision"),
                       hf_token=token, hf_endpoint=_str(hf, "endpoint", f"{path}.huggingFace.endpoint"))


def parse_adapters(raw: Mapping[str, Any], served_name: str | None, base: str | None = None
                   ) -> tuple[AdapterSpec, ...]:
    """``spec.adapters``.  ``served_name``: the base model's served name (an adapter may not
    take it; None: the resource's name, not known here); ``base``: the engine hash builtin
    adapters are shaped for.  Raises ``EngineSpecError``."""
    items = raw.get("adapters")
    if items is None:
        return ()
    if not isinstance(items, (list, tuple)):
        raise EngineSpecError(f"adapters: expected a list, got {type(items).__name__}")
    if len(items) > MAX_ADAPTERS:
        raise EngineSpecError(f"adapters: at most {MAX_ADAPTERS} adapters, got {len(items)}")
    out = [_adapter(a, f"adapters[{i}]", base) for i, a in enumerate(items)]
    seen: set[str] = set()
    for i, a in enumerate(out):
        if a.name in seen:
            raise EngineSpecError(f"adapters[{i}].name: {a.name!r} is given twice")
        if served_name is not None and a.name == served_name:
            raise EngineSpecError(f"adapters[{i}].name: {a.name!r} is the base model's served name; give the "
                                  "adapter another name")
        seen.add(a.name)
    return tuple(out)


def parse_lora(runtime: Mapping[str, Any], num_adapters: int) -> LoRASpec:
    """``spec.runtime.lora`` (``enabled`` defaults to whether there are adapters).  Raises
    ``EngineSpecError``."""
    lo = _obj(runtime, "lora", "runtime.lora")
    enabled = lo.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise EngineSpecError(f"runtime.lora.enabled: expected true or false, got {enabled!r}")
    out = LoRASpec(enabled=num_adapters > 0 if enabled is None else enabled,
                   max_loras=_int(lo, "maxLoras", "runtime.lora.maxLoras", 4, 1, 256),
                   max_lora_rank=_int(lo, "maxLoraRank", "runtime.lora.maxLoraRank", 16, 1, 64),
                   max_cpu_loras=_int(lo, "maxCpuLoras", "runtime.lora.maxCpuLoras", None, 1, 4096))
    if num_adapters and not out.enabled:
        raise EngineSpecError("runtime.lora.enabled: false, but spec.adapters lists adapters; remove them or enable "
                              "LoRA")
    if out.max_cpu_loras is not None and out.max_cpu_loras < out.max_loras:
        raise EngineSpecError(f"runtime.lora.maxCpuLoras {out.max_cpu_loras} must be at least maxLoras "
                              f"{out.max_loras}")
    return out


# Where adapters live: ``.adapters/<key>`` on the engine cache claim (the pods' --lora-dir),
# and the list a pod loads at start (a ConfigMap mounted as a folder; its content changes
# without touching the pod template).
ADAPTERS_SUBPATH = ".adapters"
ADAPTER_LIST_MOUNT = "/etc/kiln/adapters"
ADAPTER_LIST_FILE = "adapters.json"


def lora_serve_args(lora: LoRASpec, cache_root: str) -> list[str]:
    """The ``kiln serve`` LoRA flags (none when LoRA is off).  The adapter list itself is not
    among them: it is the mounted ``ADAPTER_LIST_FILE``, so changing it restarts nothing."""
    if not lora.enabled:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args + ["--lora-dir", f"{cache_root}/{ADAPTERS_SUBPATH}",
                   "--lora-modules-file", f"{ADAPTER_LIST_MOUNT}/{ADAPTER_LIST_FILE}"]
