"""``kiln build``: quantize and compile a model into a content-addressed engine folder.

The engine hash comes from ``kiln.common.enginespec`` (torch-free, shared with the operator)
over the normalized build spec, so ``kiln build`` and the operator always agree on an
engine's path.  The build runs in a temporary folder next to ``--output`` and is renamed into
place only when complete (manifest, weights, tokenizer, completion marker), so a failed,
interrupted or racing build never leaves a half-written engine at the path: when two builders
race for the same hash, the first rename wins and the other discards its copy.

The command line (``kiln build``'s flags and exit codes) is ``kiln.runtime.build_cli``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.common.constants import COMPLETE_MARKER, ENGINE_FORMAT_VERSION, MANIFEST_FILENAME
from kiln.common.enginespec import BUILD_DEFAULTS, BuildSpec
from kiln.common.manifest import (
    EngineFormatError,
    is_engine_complete,
    manifest_digest,
    read_manifest,
    sha256_file,
    verify_engine,
)
from kiln.common.progress import ProgressReporter, as_reporter

MAX_SHARD_BYTES = 4 << 30  # weights per safetensors file
CHECKSUM_ALGORITHM = "sha256"  # the one algorithm of source_checksum and --source-checksum
BUILDER_VERSION = "kiln-build/1"


class BuildError(RuntimeError):
    """The build could not finish (output not writable, disk full, a lost race to a
    different engine).  Nothing is left at the engine path."""


class BadInputError(ValueError):
    """The build's input is invalid (spec, source, architecture).  Exit code 2."""


@dataclass
class BuildResult:
    """Outcome of a build: ``path`` (the engine), ``engine_hash``, ``status`` ("built",
    "exists": a complete engine of this hash was already there, "raced": another builder
    finished the same engine first), ``seconds``."""

    path: Path
    engine_hash: str
    status: str
    seconds: float


Progress = Callable[[str], None]  # or a kiln.common.progress.ProgressReporter (stages, layers)


def source_checksum(src) -> str:
    """``sha256:<hex>`` of a resolved source: the GGUF file's bytes, or for a Hugging Face
    folder the sha256 of ``name sha256`` lines of its config.json and *.safetensors."""
    if src.kind == "gguf":
        return "sha256:" + sha256_file(src.path)
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    for f in sorted([src.path / "config.json", *src.path.glob("*.safetensors")]):
        h.update(f"{f.name} {sha256_file(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.iterdir()):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_weights(tensors: dict, out: Path, meta: dict[str, str]) -> list[dict]:
    """Write sorted tensors into ≤4 GiB safetensors shards; returns the manifest entries."""
    from safetensors.torch import save_file  # noqa: PLC0415

    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + b > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    entries = []
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, str(out / fname), metadata=meta)
        entries.append({"name": fname, "bytes": (out / fname).stat().st_size, "sha256": sha256_file(out / fname),
                        "num_tensors": len(shard)})
    return entries


def _engine_tensors(model, store_dtype) -> dict:
    """The model's state dict as engine tensors on the CPU: float weights in ``store_dtype``,
    quantized buffers and scales as they are; the tied LM head is left out."""
    import torch  # noqa: PLC0415

    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = t.detach().cpu()
        is_scale = name.endswith(("weight_scale", "scales", "smooth_inv"))
        if t.dtype == torch.float32 and not is_scale:
            t = t.to(store_dtype)
        out[name] = t.contiguous()
    return out


def build_engine(spec: BuildSpec, model_src: str, output: str | os.PathLike, *, device: str = "auto",
                 progress: ProgressReporter | Progress | None = None,
                 check: Callable[[Path], dict] | None = None) -> BuildResult:
    """Build the engine of ``spec`` from ``model_src`` into ``output``.

    Args:
        spec: the normalized build spec (its hash names the engine).
        model_src: the source as given to ``--model`` (``builtin:...``, .gguf, HF folder).
        output: the engine folder to create (usually ``<cache>/<hash>``).
        device: where to run calibration and quantization math (auto, cpu, cuda).
        progress: a ``ProgressReporter`` (stages and layers: ``kiln.common.progress``, the
            lines the operator reads), or a callback receiving its formatted lines.
        check: measures the finished engine (its temporary folder) before it is moved into
            place; what it returns is kept in the manifest as ``accuracy``; what it raises
            leaves nothing at ``output`` (``kiln.runtime.accuracy_gate``).
    Raises:
        BadInputError: unsupported architecture, missing or corrupt source, a group size that
            does not divide a layer, a checksum that does not match, a max_seq_len other than
            the default past the model's context (max_position_embeddings).
        BuildError: the output cannot be written (read-only, disk full) or lost a race to a
            different engine.
    """
    t0 = time.perf_counter()
    say = as_reporter(progress)
    out = Path(output).expanduser().absolute()
    h = spec.hash()
    if out.exists():
        if is_engine_complete(str(out), h):
            try:  # a finished engine of this hash: still intact (weights against their checksums)?
                verify_engine(out, verify_checksums=True)
            except EngineFormatError as e:
                raise BuildError(f"{out} holds engine {h} but it fails verification ({e}); remove it and build "
                                 "again") from None
            say.stage("done", f"engine {h} already built at {out}")
            return BuildResult(out, h, "exists", time.perf_counter() - t0)
        if os.path.ismount(out):  # the finished engine is renamed into place: a mount point cannot take it
            raise BadInputError(f"{out} is a mount point and the engine cannot be renamed onto it; point --output "
                                f"at a folder on that volume, e.g. {out / 'engine'}")
        if out.is_dir() and not any(out.iterdir()):
            pass  # an empty folder (e.g. a mount point's child) is replaced by the rename
        elif is_engine_complete(str(out)):  # a finished engine, of another build spec
            try:
                other = read_manifest(out).get("engine_hash", "?")
            except EngineFormatError:  # removed or rewritten since the check above
                other = "?"
            raise BuildError(f"{out} holds engine {other}, built from a different spec than this one ({h}); "
                             "remove it or pick another --output")
        else:
            raise BuildError(f"{out} exists and is not a complete engine with hash {h}; remove it or pick another --output")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(out, say)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        (tmp / _BUILDER_MARKER).write_text(f"{socket.gethostname()}\n{os.getpid()}\n")
    except OSError as e:
        blocker = next((p for p in [out.parent, *out.parent.parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise BuildError(f"cannot create {out}: {blocker} is a file, not a folder") from e
        raise BuildError(f"cannot write under {out.parent}: {e.strerror or e} (read-only or missing output location?)") from e
    try:
        _build_into(spec, model_src, tmp, h, device, say)
        say.stage("finalize", "finalizing")
        (tmp / _BUILDER_MARKER).unlink(missing_ok=True)
        (tmp / COMPLETE_MARKER).write_text(f"{h}\n")
        if check is not None:
            say.stage("evaluate", "measuring the engine against its source (accuracy gate)")
            accuracy = check(tmp)
            _add_to_manifest(tmp, "accuracy", accuracy)
            say(f"accuracy gate passed: {json.dumps(accuracy, sort_keys=True)}")
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        _fsync_tree(tmp)
        try:
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            os.rename(tmp, out)
        except OSError as e:
            if is_engine_complete(str(out), h):  # another builder won the race: same engine
                say(f"another builder finished engine {h} first; keeping its copy")
                return BuildResult(out, h, "raced", time.perf_counter() - t0)
            raise BuildError(f"cannot move the finished engine into {out}: {e.strerror or e}") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise BuildError(f"no space left on the device while writing the engine under {out.parent}; "
                             f"nothing was left at {out}") from e
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise BuildError(f"cannot write the engine under {out.parent}: {e.strerror} (read-only?)") from e
        raise BuildError(f"writing the engine failed: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    secs = time.perf_counter() - t0
    say.stage("done", f"engine {h} written to {out} in {secs:.1f}s")
    return BuildResult(out, h, "built", secs)


def _add_to_manifest(folder: Path, key: str, value) -> None:
    """Set ``key`` in ``folder``'s manifest and its digest."""
    manifest = read_manifest(folder)
    manifest[key] = value
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


_BUILDER_MARKER = ".kiln-builder"  # "<host>\n<pid>\n" of the build writing a temporary folder
STALE_TEMP_SECONDS = 24 * 3600


def _remove_stale_temps(out: Path, say: Progress) -> None:
    """Remove temporary folders that killed builds (SIGKILL, OOM, node loss) left next to
    ``out``: those whose builder ran on this host and is gone, and any untouched for
    ``STALE_TEMP_SECONDS`` (a builder on another host, e.g. another pod on the same volume, is
    only judged by age).  Live builders' folders are kept, so racing builds stay safe."""
    host = socket.gethostname()
    for d in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            if not d.is_dir():
                continue
            stale = time.time() - d.stat().st_mtime > STALE_TEMP_SECONDS
            marker = d / _BUILDER_MARKER
            if not stale and marker.is_file():
                m_host, m_pid = (marker.read_text().split() + ["", ""])[:2]
                if m_host == host and m_pid.isdigit():
                    try:
                        os.kill(int(m_pid), 0)
                    except ProcessLookupError:
                        stale = True
                    except PermissionError:
                        pass  # alive, another user's
            if stale:
                shutil.rmtree(d, ignore_errors=True)
                say(f"removed {d.name}, left by an interrupted build")
        except OSError:
            continue


def _build_into(spec: BuildSpec, model_src: str, tmp: Path, h: str, device: str, say: ProgressReporter) -> None:
    import torch  # noqa: PLC0415

    from . import loader  # noqa: PLC0415
    from .config import env_cpu_threads  # noqa: PLC0415
    from .model.llama import LlamaForCausalLM  # noqa: PLC0415
    from .model_runner import resolve_device  # noqa: PLC0415
    from .quantization import QuantizationError, QuantSettings, get_handler  # noqa: PLC0415
    from .quantization import calibration, kv_fp8  # noqa: PLC0415

    threads = env_cpu_threads()
    if threads:
        torch.set_num_threads(threads)
    src, checksum, hf, cfg, cq, tok = _open_source(spec, model_src, say)
    kv = spec.kv_cache_dtype == "fp8"
    if tok is None:  # checked before calibration and quantization, which take minutes
        raise BadInputError(f"no tokenizer in {hf.path} (tokenizer.json, tokenizer_config.json or tokenizer.model): "
                            f"an engine ships its model's tokenizer; add the tokenizer files to the folder")
    # as vLLM refuses a max_model_len past the model's context; the default limit (4096) is left
    # alone for shorter models: serving caps it at the model's context
    if spec.max_seq_len > cfg.max_position_embeddings and spec.max_seq_len != BUILD_DEFAULTS["maxSeqLen"]:
        raise BadInputError(f"--max-seq-len {spec.max_seq_len} is longer than the model's context of "
                            f"{cfg.max_position_embeddings} tokens (max_position_embeddings)")
    method = "none" if spec.quantization == "auto" else spec.quantization  # auto on float weights: none
    settings = QuantSettings(method=method, group_size=spec.group_size, alpha=float(spec.smoothquant_alpha),
                             lm_head=spec.lm_head_quantized)
    dev = resolve_device(device)
    try:
        handler = get_handler(settings)
        with torch.device(dev):
            model = LlamaForCausalLM(cfg).float()
        model.eval()
        handler.check(model)
    except QuantizationError as e:
        raise BadInputError(str(e)) from e
    say.stage("load", f"loading weights of {cfg.model_type} ({cfg.num_params() / 1e6:.0f}M parameters) on {dev}"
        + (f", pre-quantized {cq.describe()} (kept as it is)" if cq is not None else ""))
    if cq is not None:
        try:
            settings = loader.load_prequantized(model, hf, cq)
        except loader.ModelSourceError as e:
            raise BadInputError(str(e)) from e
    else:
        try:
            loaded = model.load_weights(loader.iter_weights(hf))
        except (ValueError, RuntimeError) as e:
            raise BadInputError(f"corrupt or mismatched source {src.ref}: {e}") from e
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise BadInputError(f"corrupt source {src.ref}: lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    samples, calib_info = _calibration(spec, handler, cq, kv, tok, say)
    say.stage("quantize", f"quantization {settings.method}" + (" (LM head too)" if settings.lm_head else "")
        + (", KV cache fp8" if kv else ""))
    last = [0.0]

    def layer_progress(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] > 2.0:
            last[0] = now
            say.layer(done, total, f"{stage}: layer {done}/{total}")

    with torch.no_grad():
        kv_absmax = None if cq is not None else \
            calibration.quantize_model(model, handler, samples, kv, layer_progress, lm_head=settings.lm_head)

    store_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.torch_dtype or "", torch.float32)
    tensors = _engine_tensors(model, store_dtype)
    if kv_absmax is not None:
        tensors.update(kv_fp8.scale_tensors(kv_absmax))
    say.stage("write", f"writing {len(tensors)} tensors")
    # one metadata key only: safetensors writes the metadata map in hash-map order
    files = _save_weights(tensors, tmp, {"format": "pt"})
    _write_manifest(spec, tmp, h, cfg, settings, store_dtype, files, tok, src, checksum, calib_info, dev)


def _open_source(spec: BuildSpec, model_src: str, say: ProgressReporter):
    """Resolve, hash and read the source's config, checkpoint quantization and tokenizer:
    ``(source, sha256, hf folder, ModelConfig, CheckpointQuantization | None, tokenizer | None)``.

    Raises:
        BadInputError: an unknown or corrupt source, a checksum mismatch, an unsupported model or
            checkpoint quantization.
    """
    from . import loader  # noqa: PLC0415
    from .model.config import ModelConfig, UnsupportedModelError  # noqa: PLC0415

    try:
        src = loader.resolve_source(model_src)
        say.stage("source", f"source {src.ref} ({src.kind}: {src.path}); hashing")
        checksum = source_checksum(src)
        if spec.source.checksum and spec.source.checksum.lower() != checksum:
            raise BadInputError(f"source checksum mismatch: expected {spec.source.checksum}, the source has {checksum}")
        hf = loader.materialize_gguf(src)
        cfg = ModelConfig.from_hf_dict(loader.load_hf_config_dict(hf))
        cq = loader.checkpoint_quantization(hf)  # an unsupported checkpoint fails before the heavy work
        _check_prequantized(spec, cq, src.ref)
        tok = loader.load_tokenizer(hf)
    except (loader.ModelSourceError, UnsupportedModelError) as e:
        raise BadInputError(str(e)) from e
    return src, checksum, hf, cfg, cq, tok


def _calibration(spec: BuildSpec, handler, cq, kv: bool, tok, say: ProgressReporter):
    """The calibration samples (token id lists) and the manifest's ``calibration`` record, or
    ``(None, None)`` when neither the method nor the FP8 KV cache calibrates.

    Raises:
        BadInputError: the calibration data is unreadable or changed since the CLI hashed it.
    """
    from .quantization import calibration  # noqa: PLC0415

    if not ((handler.needs_calibration and cq is None) or kv):
        return None, None
    data = spec.calibration.file if spec.calibration else calibration.default_calibration_path()
    try:
        samples, per_domain = calibration.calibration_samples_by_domain(tok, spec.calibration_samples, data=data)
        data_sha = calibration.sha256_of(data)
    except (ValueError, OSError) as e:  # CalibrationDataError: the file changed or vanished since the CLI read it
        raise BadInputError(f"calibration data: {e}") from e
    if spec.calibration and spec.calibration.checksum and data_sha != spec.calibration.checksum:
        raise BadInputError(f"calibration data {data}: checksum mismatch: expected {spec.calibration.checksum}, "
                            f"the file has {data_sha}")
    # a Hub dataset's file by its reference (repo@commit/path), a local file by its path
    where = (spec.calibration.uri() if spec.calibration.kind == "huggingFace" else str(data)) if spec.calibration \
        else "kiln/runtime/data/" + data.name
    calib_info = {"data": where,
                  "data_sha256": data_sha, "samples_requested": spec.calibration_samples,
                  "samples_used": len(samples), "samples_per_domain": per_domain,
                  "sample_tokens": calibration.SAMPLE_TOKENS}
    say.stage("calibrate", "calibration: " + ", ".join(f"{d} {n}" for d, n in per_domain.items()) + " samples")
    if len(samples) < spec.calibration_samples:
        say(f"the calibration data holds {len(samples)} samples of up to {calibration.SAMPLE_TOKENS} tokens; "
            "using all of them")
    return samples, calib_info


def _write_manifest(spec: BuildSpec, tmp: Path, h: str, cfg, settings, store_dtype, files, tok, src,
                    checksum: str, calib_info, dev) -> None:
    """Save the tokenizer beside the weights and write the engine manifest (``MANIFEST_FILENAME``)."""
    import torch  # noqa: PLC0415

    before = set(os.listdir(tmp))
    tok.save_pretrained(str(tmp))
    tok_files = sorted(set(os.listdir(tmp)) - before)
    manifest = {
        "format_version": ENGINE_FORMAT_VERSION,
        "engine_hash": h,
        "build_spec": spec.to_dict(),
        "model": {"architecture": cfg.to_hf_dict()["architectures"][0], "config": cfg.to_hf_dict()},
        "quantization": settings.to_manifest(),
        "kv_cache_dtype": spec.kv_cache_dtype,
        "limits": {"max_seq_len": spec.max_seq_len, "max_batch_size": spec.max_batch_size,
                   "max_num_tokens": spec.max_num_tokens},
        "weights": {"dtype": str(store_dtype).replace("torch.", ""), "files": files},
        "tokenizer_files": tok_files,
        # a Hub source by its repo and commit (hf://org/name@sha), not the cache folder it was read from
        "source": {"ref": spec.source.to_cli() if spec.source.kind in ("huggingFace", "pvc") else src.ref, "kind": src.kind,
                   "sha256": checksum},
        "calibration": calib_info,
        "builder": {"version": BUILDER_VERSION, "torch": torch.__version__.split("+")[0], "device": dev.type},
    }
    manifest["tokenizer_sha256"] = {f: sha256_file(tmp / f) for f in tok_files if (tmp / f).is_file()}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (tmp / MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _check_prequantized(spec: BuildSpec, cq, ref: str) -> None:
    """A pre-quantized checkpoint (``cq``, or None) is built only with ``quantization: auto``
    (its own weights, no second quantization; vLLM likewise refuses a ``--quantization`` that
    differs from the checkpoint's) and without an FP8 KV cache, whose scales would need
    calibration through the quantized layers.

    Raises:
        BadInputError: naming the checkpoint's method and the spelling that builds it.
    """
    if cq is None:
        return
    if spec.quantization != "auto":
        raise BadInputError(f"{ref} is a pre-quantized {cq.describe()} checkpoint; Kiln keeps its weights and "
                            f"does not quantize them again: build it with --quantization auto "
                            f"(build.quantization: auto), not {spec.quantization}")
    if spec.kv_cache_dtype == "fp8":
        raise BadInputError(f"{ref} is a pre-quantized {cq.describe()} checkpoint: --kv-cache-dtype fp8 is not "
                            f"supported with it (calibrated KV scales need float weights); use --kv-cache-dtype auto")
