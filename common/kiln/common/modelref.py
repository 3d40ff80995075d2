"""Where an engine's inputs come from: the model source (``ModelRef``) and calibration data
other than the shipped default (``CalibrationRef``), as an InferenceEngine spec or ``kiln build``
names them.  Torch-free; re-exported by ``kiln.common.enginespec``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .specvalues import EngineSpecError, _claim_path

__all__ = ["MODEL_SOURCE_KINDS", "CALIBRATION_MOUNT", "ModelRef", "CalibrationRef"]

MODEL_SOURCE_KINDS = ("builtin", "path", "pvc", "huggingFace")
CALIBRATION_MOUNT = "/calibration"  # where a build Job mounts the claim of build.calibration
_SHA256_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# build.calibration.huggingFace: the hashed fields, and the build Job's (secretRef, endpoint: the operator's)
_CALIBRATION_HF_FIELDS = ("repo", "revision", "path", "secretRef", "endpoint")


@dataclass(frozen=True)
class ModelRef:
    """A reference to where the weights come from, as a spec names it; the part of the hash
    that names the model.  Resolving it to local files is the runtime's job
    (``kiln.runtime.loader.ResolvedSource``).

    Fields:
        kind: ``builtin`` (a model shipped with Kiln), ``path`` (a local folder or ``.gguf``
            file, as given to ``kiln build --model``), ``pvc`` (a path on a PersistentVolumeClaim)
            or ``huggingFace`` (a hub repository).
        name: builtin model name (``smollm2-135m-instruct``), kind ``builtin`` only.
        path: file or folder path: absolute for ``path``, relative to the claim for ``pvc``.
        claim_name: the claim, kind ``pvc`` only.
        repo: ``org/name``, kind ``huggingFace`` only.
        revision: commit or tag when known (``huggingFace``); part of the hash.
        checksum: ``sha256:<hex>`` of the source when known; part of the hash.
    """

    kind: str
    name: str | None = None
    path: str | None = None
    claim_name: str | None = None
    repo: str | None = None
    revision: str | None = None
    checksum: str | None = None

    @classmethod
    def from_string(cls, src: str, checksum: str | None = None) -> "ModelRef":
        """Parse ``kiln build --model SRC``: ``builtin:NAME``, ``pvc://CLAIM/PATH``,
        ``hf://ORG/NAME[@REVISION]`` or a filesystem path (kept as written, normalized)."""
        src = src.strip()
        if src.startswith("builtin:"):
            return cls(kind="builtin", name=src[len("builtin:"):].strip().lower(), checksum=checksum)
        if src.startswith("pvc://"):
            claim, _, path = src[len("pvc://"):].partition("/")
            if not claim:
                raise EngineSpecError(f"model: {src!r} names no claim (pvc://CLAIM/PATH)")
            return cls(kind="pvc", claim_name=claim, path=_claim_path(path, "model"), checksum=checksum)
        if src.startswith("hf://"):
            repo, _, rev = src[len("hf://"):].partition("@")
            return cls(kind="huggingFace", repo=repo, revision=rev or None, checksum=checksum)
        if not src:
            raise EngineSpecError("model: empty source")
        return cls(kind="path", path=os.path.normpath(src), checksum=checksum)

    @classmethod
    def from_dict(cls, model: Mapping[str, Any]) -> "ModelRef":
        """Parse an InferenceEngine ``spec.model``: exactly one of ``builtin``, ``pvc``,
        ``huggingFace``, ``path`` (plus optional ``checksum``).  Raises ``EngineSpecError``."""
        if not isinstance(model, Mapping):
            raise EngineSpecError("model: expected an object")
        present = [k for k in MODEL_SOURCE_KINDS if model.get(k) not in (None, "", {})]
        if len(present) != 1:
            raise EngineSpecError(
                f"model: exactly one source of {', '.join(MODEL_SOURCE_KINDS)} is required, got "
                f"{', '.join(present) or 'none'}")
        kind = present[0]
        checksum = model.get("checksum") or None
        v = model[kind]
        if kind == "builtin":
            return cls(kind=kind, name=str(v).strip().lower(), checksum=checksum)
        if kind == "path":
            return cls(kind=kind, path=os.path.normpath(str(v)), checksum=checksum)
        if kind == "pvc":
            if not isinstance(v, Mapping) or not v.get("claimName"):
                raise EngineSpecError("model.pvc: claimName is required")
            return cls(kind=kind, claim_name=str(v["claimName"]), path=_claim_path(v.get("path"), "model.pvc.path"),
                       checksum=checksum)
        if not isinstance(v, Mapping) or not v.get("repo"):
            raise EngineSpecError("model.huggingFace: repo is required")
        return cls(kind=kind, repo=str(v["repo"]), revision=v.get("revision") or None,
                   checksum=checksum)

    def to_dict(self) -> dict[str, Any]:
        """The canonical (hashed) form: only the fields that are set, snake_case keys."""
        d = {"kind": self.kind, "name": self.name, "path": self.path,
             "claim_name": self.claim_name, "repo": self.repo, "revision": self.revision,
             "checksum": self.checksum.lower() if self.checksum else None}
        return {k: v for k, v in d.items() if v is not None}

    def to_cli(self) -> str:
        """The ``--model SRC`` argument for ``kiln build``: parsed back by ``from_string``, it
        gives this very source (so the build hashes what the operator hashed)."""
        if self.kind == "builtin":
            return f"builtin:{self.name}"
        if self.kind == "path":
            return str(self.path)
        if self.kind == "pvc":
            return f"pvc://{self.claim_name}/{self.path}"
        return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision else "")

    def mounted_path(self, models_mount: str) -> str:
        """Where a ``pvc`` source is read from when its claim is mounted at ``models_mount``."""
        return os.path.join(models_mount, self.path or ".")


@dataclass(frozen=True)
class CalibrationRef:
    """Calibration data other than the shipped default.  ``kind``: ``path`` (a local file,
    ``kiln build --calibration-data FILE``), ``pvc`` (``build.calibration.pvc``: ``path``
    relative to the claim ``claim_name``) or ``huggingFace`` (a file of a Hub dataset,
    ``--calibration-data hf://datasets/ORG/NAME[@REV]/PATH`` or ``build.calibration.huggingFace``:
    ``path`` inside the dataset ``repo`` at ``revision``).

    A file is hashed by its bytes only (``checksum``, ``sha256:<hex>``: computed by ``kiln
    build``; required in an InferenceEngine, whose operator cannot read the claim), so the same
    data gives the same engine wherever it lives.  A Hub dataset's file is hashed by its name:
    repo, revision (``kiln build`` resolves a branch or tag to its commit once, as a model's)
    and path, plus ``checksum`` when one is given (the build then refuses other bytes).
    ``local_path``: where ``kiln build`` reads a downloaded dataset file (not hashed)."""

    kind: str
    path: str
    checksum: str | None = None
    claim_name: str | None = None
    repo: str | None = None
    revision: str | None = None
    local_path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind == "huggingFace" and not self.checksum:
            object.__setattr__(self, "checksum", None)
            if not _REPO_RE.match(str(self.repo or "")):
                raise EngineSpecError(f"build.calibration.huggingFace.repo: expected org/name, got {self.repo!r}")
            return
        c = str(self.checksum or "").strip().lower()
        if not _SHA256_RE.match(c):
            raise EngineSpecError(f"build.calibration.checksum: expected sha256:<64 hex digits>, got {self.checksum!r}")
        object.__setattr__(self, "checksum", c)

    @classmethod
    def from_dict(cls, cal: Any) -> "CalibrationRef | None":
        """Parse an InferenceEngine ``spec.build.calibration`` (``pvc: {claimName, path}`` and
        ``checksum``, or ``huggingFace: {repo, revision, path, secretRef, endpoint}`` and an
        optional ``checksum``); ``None`` or ``{}`` means the shipped default.  Raises
        ``EngineSpecError``."""
        if not cal or not isinstance(cal, Mapping):
            if cal in (None, {}):
                return None
            raise EngineSpecError("build.calibration: expected an object")
        if set(cal) - {"pvc", "huggingFace", "checksum"}:
            raise EngineSpecError(f"build.calibration: unknown field(s) "
                                  f"{', '.join(sorted(set(cal) - {'pvc', 'huggingFace', 'checksum'}))}")
        if (cal.get("pvc") is not None) == (cal.get("huggingFace") is not None):
            raise EngineSpecError("build.calibration: exactly one source of pvc, huggingFace is required")
        if cal.get("huggingFace") is not None:
            return cls._from_hub(cal["huggingFace"], cal.get("checksum"))
        pvc = cal.get("pvc")
        if not isinstance(pvc, Mapping) or not pvc.get("claimName") or not pvc.get("path"):
            raise EngineSpecError("build.calibration.pvc: claimName and path are required")
        if not cal.get("checksum"):
            raise EngineSpecError("build.calibration.checksum: required (sha256:<hex> of the file): the engine "
                                  "hash names the calibration data, which the operator cannot read")
        if (path := os.path.normpath(str(pvc["path"])).lstrip("/")) in ("", ".") or path.startswith(".."):
            raise EngineSpecError(f"build.calibration.pvc.path: {pvc['path']!r} is not a file path inside the claim")
        return cls(kind="pvc", path=path, checksum=cal["checksum"], claim_name=str(pvc["claimName"]))

    @classmethod
    def _from_hub(cls, hf: Any, checksum: Any) -> "CalibrationRef":
        where = "build.calibration.huggingFace"
        if not isinstance(hf, Mapping):
            raise EngineSpecError(f"{where}: expected an object")
        if set(hf) - set(_CALIBRATION_HF_FIELDS):
            unknown = ", ".join(sorted(set(hf) - set(_CALIBRATION_HF_FIELDS)))
            raise EngineSpecError(f"{where}: unknown field(s) {unknown}")
        if not hf.get("repo") or not hf.get("path"):
            raise EngineSpecError(f"{where}: repo and path are required")
        raw = str(hf["path"])
        path = os.path.normpath(raw).lstrip("/")
        if path in ("", ".") or path.startswith("..") or path != raw:
            raise EngineSpecError(f"{where}.path: {raw!r} is not a file path inside the dataset (as the Hub lists it)")
        return cls(kind="huggingFace", path=path, checksum=checksum or None, repo=str(hf["repo"]),
                   revision=str(hf["revision"]) if hf.get("revision") else None)

    def to_dict(self) -> dict[str, Any]:
        """The canonical (hashed) form: the file's bytes; a Hub dataset's file by its name."""
        if self.kind != "huggingFace":
            return {"sha256": self.checksum}
        d: dict[str, Any] = {"hf_dataset": {k: v for k, v in (("repo", self.repo), ("revision", self.revision),
                                                                 ("path", self.path)) if v is not None}}
        if self.checksum:
            d["sha256"] = self.checksum
        return d

    def uri(self) -> str:
        """A Hub dataset's file as ``hf://datasets/ORG/NAME[@REV]/PATH`` (``kiln build
        --calibration-data``); a file: its path."""
        if self.kind != "huggingFace":
            return self.path
        return f"hf://datasets/{self.repo}" + (f"@{self.revision}" if self.revision else "") + f"/{self.path}"

    def to_cli(self, mount: str = CALIBRATION_MOUNT) -> str:
        """The ``--calibration-data`` argument (a ``pvc`` file: where its claim is mounted; a
        Hub dataset's file: its ``hf://datasets/...`` reference)."""
        if self.kind == "huggingFace":
            return self.uri()
        return os.path.join(mount, self.path) if self.kind == "pvc" else self.path

    @property
    def file(self) -> str:
        """Where the build reads the data (a downloaded dataset file's local copy)."""
        return self.local_path or self.path
