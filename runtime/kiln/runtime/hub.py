"""The Hugging Face Hub as a model source: ``hf://ORG/NAME[@REVISION]`` or plain ``ORG/NAME``;
and a file of a Hub dataset (calibration data): ``hf://datasets/ORG/NAME[@REVISION]/PATH``, the
spelling of ``huggingface_hub``'s own ``HfFileSystem``.

A snapshot is downloaded with ``huggingface_hub`` (``repo_info`` for the commit sha and the
file list, then ``hf_hub_download`` per file: its cache layout, ``.incomplete`` files resumed
with a Range request, files of a cached commit not fetched again).  Only the files a model
needs are fetched (``ALLOW_PATTERNS``).  The endpoint, token and cache folder come in as a
:class:`HubOptions` from the CLI/config layer (``config.env_hub_options``); this module reads
no environment variable.

Errors are :class:`HubError` (a ``ValueError``) with one line and a ``reason``:
``ModelNotFound``, ``DatasetNotFound`` (an unknown dataset, or a file it does not hold),
``RevisionNotFound``, ``Unauthorized``, ``DownloadFailed`` or ``UnsupportedModel``
(``config.json``, fetched before any weight, names an architecture or shape Kiln cannot run);
the message starts with the reason so a build's termination message carries it to the operator.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HF_SCHEME = "hf://"
DATASETS_PREFIX = "datasets/"  # hf://datasets/ORG/NAME[@REV]/PATH: a dataset's file
# What a model needs: config, weights, tokenizer, generation config, chat template
ALLOW_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja")
# ``org/name`` as the Hub spells repo ids (a plain one is taken only when no such path exists)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubOptions:
    """How to reach the Hub.  ``endpoint``: a mirror's base URL (None: huggingface.co);
    ``token``: a user access token (None: anonymous); ``cache_dir``: the download cache
    (None: huggingface_hub's default, ``$HF_HOME/hub``); ``timeout_s``: seconds to wait for
    the server's metadata replies."""

    endpoint: str | None = None
    token: str | None = None
    cache_dir: Path | None = None
    timeout_s: float = 30.0


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub reference: ``repo`` ``org/name``, ``revision`` a branch, tag or commit
    (None: the default branch), ``repo_type`` ``model`` or ``dataset``."""

    repo: str
    revision: str | None = None
    repo_type: str = "model"

    def uri(self) -> str:
        """``hf://repo[@revision]`` (``hf://datasets/repo[@revision]`` for a dataset)."""
        kind = DATASETS_PREFIX if self.repo_type == "dataset" else ""
        return HF_SCHEME + kind + self.repo + (f"@{self.revision}" if self.revision else "")

    @property
    def noun(self) -> str:
        return "dataset" if self.repo_type == "dataset" else "model"


class HubError(ValueError):
    """A Hub download that cannot succeed without a change; ``reason`` is one of
    ModelNotFound, DatasetNotFound, RevisionNotFound, Unauthorized, DownloadFailed, UnsupportedModel.  (A ValueError, as
    ``loader.ModelSourceError`` is; this module stays free of torch for the CLI's parser.)"""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def parse_ref(src: str | None) -> HubRef | None:
    """``hf://ORG/NAME[@REV]`` or ``ORG/NAME[@REV]`` (only when no such local path exists) as a
    :class:`HubRef`; None for anything else (builtin:, a path).

    Raises:
        HubError: an ``hf://`` reference that is not ``org/name`` (reason ModelNotFound).
    """
    if not src:
        return None
    s = str(src).strip()
    if s.startswith(HF_SCHEME + DATASETS_PREFIX):
        raise HubError("ModelNotFound", f"{src!r} names a dataset, not a model (expected hf://org/name[@revision])")
    explicit = s.startswith(HF_SCHEME)
    if explicit:
        s = s[len(HF_SCHEME):]
    elif s.startswith(("builtin:", "pvc://", "/", ".", "~")) or Path(s).exists():
        return None
    repo, _, rev = s.partition("@")
    if not _REPO_ID.match(repo) or (_ and not rev):
        if explicit:
            raise HubError("ModelNotFound", f"{src!r} is not a Hub reference (expected hf://org/name[@revision])")
        return None
    return HubRef(repo, rev or None)


def parse_dataset_file(src: str | None) -> tuple[HubRef, str] | None:
    """``hf://datasets/ORG/NAME[@REV]/PATH`` as ``(HubRef(repo_type="dataset"), PATH)``; None
    for anything that does not start with ``hf://datasets/`` (a local file).

    Raises:
        HubError: reason DatasetNotFound for a reference without ``org/name`` or without a file
            path, or an ``hf://`` reference outside ``hf://datasets/``.
    """
    s = str(src or "").strip()
    if not s.startswith(HF_SCHEME + DATASETS_PREFIX):
        if s.startswith(HF_SCHEME):
            raise HubError("DatasetNotFound", f"{src!r}: Hub calibration data is a file of a dataset repository: "
                                              f"hf://datasets/org/name[@revision]/path/in/repo")
        return None
    parts = s[len(HF_SCHEME + DATASETS_PREFIX):].split("/")
    repo, _, rev = "/".join(parts[:2]).partition("@")
    path = "/".join(parts[2:])
    if len(parts) < 3 or not _REPO_ID.match(repo) or (_ and not rev) or not path or ".." in parts[2:] \
            or "" in parts[2:]:
        raise HubError("DatasetNotFound", f"{src!r} does not name a dataset file "
                                          f"(expected hf://datasets/org/name[@revision]/path/in/repo)")
    return HubRef(repo, rev or None, repo_type="dataset"), path


def _fail(ref: HubRef, e: Exception, opts: HubOptions) -> HubError:
    """The one-line :class:`HubError` for an exception of huggingface_hub or httpx."""
    import httpx  # noqa: PLC0415
    from huggingface_hub import errors  # noqa: PLC0415

    where = opts.endpoint or "https://huggingface.co"
    if isinstance(e, errors.GatedRepoError) or (
            isinstance(e, errors.HfHubHTTPError) and getattr(e.response, "status_code", None) in (401, 403)):
        how = "the token was refused" if opts.token else "it needs a token (set HF_TOKEN)"
        return HubError("Unauthorized", f"access to {ref.noun} {ref.repo} on {where} denied: {how}")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError("RevisionNotFound", f"revision {ref.revision!r} of {ref.noun} {ref.repo} not found on {where}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError("DatasetNotFound" if ref.repo_type == "dataset" else "ModelNotFound",
                        f"{ref.noun} {ref.repo} not found on {where}")
    if isinstance(e, errors.EntryNotFoundError):
        return HubError("DownloadFailed", f"a file of {ref.uri()} listed by {where} is missing there")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, (httpx.HTTPError, errors.HfHubHTTPError, errors.LocalEntryNotFoundError, OSError)):
        return HubError("DownloadFailed", f"cannot download {ref.uri()} from {where}: {first}")
    return HubError("DownloadFailed", f"cannot download {ref.uri()} from {where}: {type(e).__name__}: {first}")


# What a PEFT LoRA adapter needs (``kiln adapter fetch``)
ADAPTER_PATTERNS = ("adapter_config.json", "adapter_model.safetensors")


def resolve_commit(ref: HubRef, opts: HubOptions, patterns: tuple[str, ...] = ALLOW_PATTERNS,
                   required: str = "config.json") -> tuple[str, list[str]]:
    """The commit sha ``ref.revision`` (or the default branch) points at now, and the repo's
    files there matching ``patterns`` (sorted; by default what a model needs).  ``required``:
    the file without which the repo is not what is asked for (a model's ``config.json``).

    Raises:
        HubError: unknown repo or revision, refused access, no connection.
    """
    from huggingface_hub import HfApi  # noqa: PLC0415

    api = HfApi(endpoint=opts.endpoint, token=opts.token or False)
    try:
        info = api.repo_info(ref.repo, repo_type=ref.repo_type, revision=ref.revision, timeout=opts.timeout_s)
    except Exception as e:  # noqa: BLE001 - every failure becomes one classified line
        raise _fail(ref, e, opts) from None
    files = sorted(s.rfilename for s in (info.siblings or [])
                   if any(fnmatch.fnmatch(s.rfilename, p) for p in patterns))
    if not info.sha or not _COMMIT.match(info.sha):
        raise HubError("DownloadFailed", f"{opts.endpoint or 'the Hub'} gave no commit sha for {ref.uri()}")
    if required not in files:
        if ref.repo_type == "dataset":
            raise HubError("DatasetNotFound", f"{ref.uri()} has no file {required} (at commit {info.sha})")
        what = "a transformers model folder" if required == "config.json" else "a PEFT adapter"
        raise HubError("ModelNotFound", f"{ref.uri()} has no {required}: not {what}")
    return info.sha, files


def check_model_config(path: Path) -> None:
    """Refuse a downloaded ``config.json`` that Kiln's model code cannot run (architecture,
    activation, head counts), before any weight file is fetched.  A checkpoint's
    ``quantization_config`` is checked later, by the loader.

    Raises:
        HubError: reason UnsupportedModel, with the model config's own message.
    """
    import json  # noqa: PLC0415

    from .model.config import ModelConfig, UnsupportedModelError  # noqa: PLC0415 - torch-free

    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        ModelConfig.from_hf_dict(cfg)
    except (UnsupportedModelError, ValueError, UnicodeDecodeError) as e:
        raise HubError("UnsupportedModel", f"{path.name} of the Hub model: {e}") from None


def download(ref: HubRef, opts: HubOptions, progress: Callable[[str], None] | None = None,
             resolved: tuple[str, list[str]] | None = None, patterns: tuple[str, ...] = ALLOW_PATTERNS,
             required: str = "config.json", check_config: bool = True) -> tuple[Path, str]:
    """Download ``ref``'s model files into the cache; returns ``(snapshot folder, commit sha)``.

    The revision is resolved to a commit once; every file is then fetched at that commit, so
    a branch that moves during the download cannot mix two commits.  ``config.json`` comes
    first and is checked (:func:`check_model_config`), so an unsupported model costs one small
    file, not its weights.  Files already in the cache for the commit are not fetched again; a
    partial file is resumed.  ``resolved``: the ``(commit, files)`` of an earlier
    :func:`resolve_commit` (not asked again); ``patterns`` and ``required`` as there (the
    required file is fetched first); ``check_config`` False skips the model check of
    ``config.json`` (an EAGLE head's config describes one decoder layer, not a model).

    Raises:
        HubError: see :func:`resolve_commit`; a dropped connection that retries cannot heal;
            reason UnsupportedModel for a config.json Kiln cannot run.
    """
    from huggingface_hub import hf_hub_download  # noqa: PLC0415

    say = progress or (lambda m: None)
    sha, files = resolved or resolve_commit(ref, opts, patterns, required)
    files = sorted(files, key=lambda f: f != required)  # stable: the required file (config.json), then the rest
    say(f"{ref.uri()} is commit {sha}; {len(files)} files")
    folder: Path | None = None
    for i, name in enumerate(files, 1):
        try:
            p = Path(hf_hub_download(ref.repo, name, repo_type=ref.repo_type, revision=sha, cache_dir=opts.cache_dir,
                                     endpoint=opts.endpoint, token=opts.token or False, etag_timeout=opts.timeout_s))
        except Exception as e:  # noqa: BLE001
            raise _fail(HubRef(ref.repo, ref.revision or sha, ref.repo_type), e, opts) from None
        say(f"[{i}/{len(files)}] {name} ({p.stat().st_size / 1e6:.1f} MB)")
        if name == "config.json" and check_config:
            check_model_config(p)
        folder = p.parents[len(Path(name).parts) - 1]
    assert folder is not None  # files holds the required file
    return folder, sha


def resolve_dataset_file(ref: HubRef, path: str, opts: HubOptions) -> str:
    """The commit sha ``ref.revision`` (or the dataset's default branch) points at now, checked
    to hold ``path``.

    Raises:
        HubError: unknown dataset, revision or file (DatasetNotFound), refused access, no connection.
    """
    sha, _ = resolve_commit(ref, opts, patterns=(path,), required=path)
    return sha


def download_dataset_file(ref: HubRef, path: str, sha: str, opts: HubOptions,
                          progress: Callable[[str], None] | None = None) -> Path:
    """Download the file ``path`` of dataset ``ref`` at commit ``sha`` (from
    :func:`resolve_dataset_file`) into the cache; returns the local file.

    Raises:
        HubError: the download cannot succeed.
    """
    folder, _ = download(ref, opts, progress=progress, resolved=(sha, [path]), required=path, check_config=False)
    return folder / path


def download_model_args(args):
    """``args`` (an ``EngineArgs``) with a Hub ``model`` (``hf://org/name[@rev]``, ``org/name``)
    downloaded and replaced by its snapshot folder, a progress line per file on stderr; the
    served model name defaults to the repo id.  Other sources come back unchanged.

    Raises:
        HubError: the download cannot succeed.
    """
    import sys  # noqa: PLC0415
    from dataclasses import replace  # noqa: PLC0415

    ref = parse_ref(args.model)
    if ref is None:
        return args
    folder, _ = download(ref, args.hub or HubOptions(),
                         progress=lambda m: print(f"kiln: hub: {m}", file=sys.stderr, flush=True))
    return replace(args, model=str(folder), served_model_name=args.served_model_name or ref.repo)
