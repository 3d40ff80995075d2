"""``kiln build``'s command line: its flags, their checks, and the exit codes.

Exit codes of ``run_build``: 0 built (or already present), 3 the engine failed its accuracy
gate (nothing written), 2 bad input (unknown method, bad
group size, unsupported architecture, missing/corrupt source, an empty ``--output`` or a mount
point as ``--output``), 1 the build failed (read-only or full output, ...), 128 + SIGTERM when
terminated.  The build itself is ``kiln.runtime.build``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace

from kiln.common.enginespec import (
    BUILD_DEFAULTS,
    GROUPED_METHODS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    BuildSpec,
    CalibrationRef,
    EngineSpecError,
)
from kiln.common.enginecache import folder_bytes, format_build_report
from kiln.common.progress import ProgressReporter

from . import hub
from .build import CHECKSUM_ALGORITHM, BadInputError, BuildError, build_engine


def _stderr_line(line: str) -> None:
    """Print one progress line of the build to stderr (``kiln.common.progress``'s format: the
    operator reads it from the build pod's log into ``status.build``)."""
    print(line, file=sys.stderr, flush=True)


def add_build_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``kiln build``'s flags to ``parser`` (defaults equal ``kiln.common.enginespec.BUILD_DEFAULTS``)."""
    d = BUILD_DEFAULTS
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct",
                        help="builtin:<name>, a .gguf file, a Hugging Face folder (possibly pre-quantized: "
                             "compressed-tensors, GPTQ, AWQ; build it with --quantization auto), or a Hub model "
                             "hf://org/name[@revision] (or org/name) (default: %(default)s)")
    parser.add_argument("--models-mount", default="/models",
                        help="where the claim of a --model pvc://CLAIM/PATH source is mounted; the source is "
                             "read from MOUNT/PATH and hashed as the claim path (default: %(default)s)")
    parser.add_argument("--download-dir", default=None,
                        help="download cache for --model hf://org/name[@revision] and --calibration-data "
                             "hf://datasets/... (default: $HF_HOME/hub); HF_TOKEN and HF_ENDPOINT (a mirror) are "
                             "read from the environment")
    parser.add_argument("--output", required=True, help="engine folder to create (written atomically)")
    parser.add_argument("--quantization", default=d["quantization"],
                        help=f"one of {', '.join(QUANTIZATION_METHODS)}; auto keeps a pre-quantized checkpoint's "
                             f"method (none on float weights) (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=None,  # None: not given (the default, int4 methods only)
                        help=f"int4 group size: 32, 64 or 128; must divide every layer's input features "
                             f"(default: {d['groupSize']})")
    parser.add_argument("--smoothquant-alpha", default=None,  # None: not given (int8-smoothquant only)
                        help=f"SmoothQuant migration strength in [0, 1] (default: {d['smoothquantAlpha']})")
    parser.add_argument("--kv-cache-dtype", default=d["kvCacheDtype"], help=f"one of {', '.join(KV_CACHE_DTYPES)}")
    parser.add_argument("--calibration-samples", type=int, default=d["calibrationSamples"],
                        help="calibration samples of up to 128 tokens, round-robin over the data's domains "
                             "(default: %(default)s)")
    parser.add_argument("--calibration-data", default=None, metavar="FILE",
                        help="calibration data: plain UTF-8 text, or JSONL records {\"text\": ...} or "
                             "{\"messages\": [...]} (chats, rendered through the chat template), optional "
                             "\"domain\"; a local file (its sha256 is part of the hash) or a Hub dataset's file "
                             "hf://datasets/org/name[@revision]/path/in/repo (downloaded as --model hf://; the "
                             "revision is resolved to a commit once, and repo, commit and path are part of the "
                             "hash) (default: the shipped mixture)")
    parser.add_argument("--calibration-checksum", default=None,
                        help=f"{CHECKSUM_ALGORITHM}:<hex> the --calibration-data file must have (for a Hub "
                             f"dataset's file: also part of the hash)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="also quantize the LM head (int4-awq and int4-gptq only; part of the hash)")
    parser.add_argument("--max-seq-len", type=int, default=d["maxSeqLen"])
    parser.add_argument("--max-batch-size", type=int, default=d["maxBatchSize"])
    parser.add_argument("--max-num-tokens", type=int, default=d["maxNumTokens"])
    parser.add_argument("--source-checksum", default=None,
                        help=f"{CHECKSUM_ALGORITHM}:<hex> the source must have (part of the engine hash)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where calibration and quantization run (not part of the hash)")
    parser.add_argument("--max-perplexity-increase", type=float, default=None, metavar="FRACTION",
                        help="accuracy gate: refuse the engine when its perplexity on the held-out text is more "
                             "than this fraction above the source's (0.05: +5%%); exit 3, nothing written")
    parser.add_argument("--min-greedy-agreement", type=float, default=None, metavar="FRACTION",
                        help="accuracy gate: refuse the engine when less than this share of its greedy tokens "
                             "equal the source's (kiln eval agreement); exit 3, nothing written")
    parser.add_argument("--gate-prompts", type=int, default=8,
                        help="prompts of the accuracy gate's greedy comparison (default: %(default)s)")
    parser.add_argument("--print-hash", action="store_true", help="print the engine hash and exit")
    parser.add_argument("--termination-log", default=TERMINATION_LOG,
                        help="on failure, write the cause to this file when it exists, as Kubernetes "
                             "reads a container's termination message (default: %(default)s)")
    return parser


TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath


def _error(args: argparse.Namespace, code: int, msg: str, echo: bool = True) -> int:
    """Report a failed build: ``msg`` on stderr (unless ``echo`` is False: the caller prints it)
    and, when the ``--termination-log`` file exists (in a Kubernetes container it does), in that
    file, where the kubelet reads the container's termination message (the operator puts it in
    the InferenceEngine's status).  Returns ``code``."""
    if echo:
        print(f"kiln build: error: {msg}", file=sys.stderr)
    path = getattr(args, "termination_log", None)
    if path and os.path.isfile(path):
        try:
            with open(path, "w") as f:
                f.write(f"kiln build: {msg}\n"[-4096:])  # the kubelet keeps at most 4096 bytes
        except OSError:
            pass  # a read-only or vanished file must not hide the build's own exit code
    return code


# InferenceEngine field names in the (operator-shared) spec errors -> this CLI's flags
_CLI_FLAGS = {"build.quantization": "--quantization", "build.groupSize": "--group-size",
              "build.smoothquantAlpha": "--smoothquant-alpha", "build.kvCacheDtype": "--kv-cache-dtype",
              "build.calibrationSamples": "--calibration-samples", "build.maxSeqLen": "--max-seq-len",
              "build.maxBatchSize": "--max-batch-size", "build.maxNumTokens": "--max-num-tokens",
              "model.checksum": "--source-checksum", "model": "--model"}


def _cli_spelling(msg: str) -> str:
    """A spec error as the CLI user spelled it: ``build.groupSize: ...`` -> ``--group-size: ...``."""
    for field in sorted(_CLI_FLAGS, key=len, reverse=True):
        if msg.startswith(field + ":"):
            return _CLI_FLAGS[field] + msg[len(field):]
    return msg


def _checksum_error(checksum: str) -> str | None:
    """Why ``--source-checksum`` is malformed (checked before the source is hashed), or None."""
    algo, sep, digest = checksum.partition(":")
    if not sep:
        return f"--source-checksum: expected {CHECKSUM_ALGORITHM}:<hex>, got {checksum!r}"
    if algo.strip().lower() != CHECKSUM_ALGORITHM:
        return f"--source-checksum: unsupported checksum algorithm {algo!r}; use {CHECKSUM_ALGORITHM}:<hex>"
    if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
        return f"--source-checksum: {digest!r} is not a sha256 digest (64 hex digits)"
    return None


def _calibration_ref(args: argparse.Namespace) -> CalibrationRef | None:
    """``--calibration-data`` as a spec reference: a local file read and checked (every record,
    so a malformed line fails now, not after the model has loaded) and its checksum; a Hub
    dataset's file (``hf://datasets/...``) with its revision resolved to a commit (the file is
    downloaded and checked by :func:`_download_calibration`).

    Raises:
        ValueError: a checksum without data, a malformed checksum, a file that cannot be used
            (``CalibrationDataError``), or a checksum mismatch.
        hub.HubError: an unknown dataset, revision or file, refused access, no connection.
    """
    path = getattr(args, "calibration_data", None)
    want = getattr(args, "calibration_checksum", None)
    if path is None:
        if want is not None:
            raise ValueError("--calibration-checksum needs --calibration-data")
        return None
    if want is not None:
        err = _checksum_error(want)
        if err:
            raise ValueError(err.replace("--source-checksum", "--calibration-checksum"))
    if not path.strip():
        raise ValueError("--calibration-data must not be empty")
    ds = hub.parse_dataset_file(path)
    if ds is not None:
        from .config import env_hub_options  # noqa: PLC0415

        ref, in_repo = ds
        sha = hub.resolve_dataset_file(ref, in_repo, env_hub_options(getattr(args, "download_dir", None)))
        return CalibrationRef(kind="huggingFace", path=in_repo, checksum=want, repo=ref.repo, revision=sha)
    from .quantization.calibration_data import read_records, sha256_of  # noqa: PLC0415

    try:
        read_records(path)
    except ValueError as e:
        raise ValueError(f"--calibration-data {e}") from None
    got = sha256_of(path)
    if want is not None and want.strip().lower() != got:
        raise ValueError(f"--calibration-data {path}: checksum mismatch: expected {want}, the file has {got}")
    return CalibrationRef(kind="path", path=os.path.abspath(path), checksum=got)


def _download_calibration(cal: CalibrationRef, args: argparse.Namespace, report) -> CalibrationRef:
    """A Hub dataset's calibration file downloaded at its resolved commit and checked as a
    local one (every record; the checksum when given): ``cal`` with ``local_path`` set.

    Raises:
        hub.HubError: the download cannot succeed.
        BadInputError: the file is not calibration data, or has other bytes than the checksum.
    """
    from .config import env_hub_options  # noqa: PLC0415
    from .quantization.calibration_data import read_records, sha256_of  # noqa: PLC0415

    ref = hub.HubRef(cal.repo, cal.revision, repo_type="dataset")
    local = hub.download_dataset_file(ref, cal.path, cal.revision, env_hub_options(getattr(args, "download_dir", None)),
                                      progress=report)
    try:
        read_records(local)
    except ValueError as e:
        raise BadInputError(f"--calibration-data {cal.uri()}: {e}") from None
    got = sha256_of(local)
    if cal.checksum and got != cal.checksum:
        raise BadInputError(f"--calibration-data {cal.uri()}: checksum mismatch: expected {cal.checksum}, "
                            f"the file has {got}")
    return replace(cal, local_path=str(local))


def run_build(args: argparse.Namespace) -> int:
    """Run ``kiln build`` from parsed arguments; prints progress to stderr and the engine
    path to stdout.  Returns the exit code (0, 1 or 2; see the module doc)."""
    err = None
    if not args.output:
        err = "--output must not be empty"
    elif args.source_checksum is not None:
        err = _checksum_error(args.source_checksum)
    if err:
        return _error(args, 2, err)
    try:
        calibration = _calibration_ref(args)
    except ValueError as e:  # also hub.HubError
        return _error(args, 2, str(e))
    model = args.model
    try:
        hub_ref = hub.parse_ref(model)
        if hub_ref is not None:  # the revision resolved once: the engine hash names the commit
            from .config import env_hub_options  # noqa: PLC0415

            hub_opts = env_hub_options(getattr(args, "download_dir", None))
            resolved = hub.resolve_commit(hub_ref, hub_opts)
            model = hub.HubRef(hub_ref.repo, resolved[0]).uri()
    except hub.HubError as e:
        return _error(args, 2, str(e))
    try:
        spec = BuildSpec.from_cli(
            model, quantization=args.quantization, group_size=args.group_size,
            smoothquant_alpha=args.smoothquant_alpha, kv_cache_dtype=args.kv_cache_dtype,
            calibration_samples=args.calibration_samples, max_seq_len=args.max_seq_len,
            max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
            checksum=args.source_checksum, quantize_lm_head=bool(getattr(args, "quantize_lm_head", False)),
            calibration=calibration)
    except EngineSpecError as e:
        return _error(args, 2, _cli_spelling(str(e)))
    if calibration is not None and not spec.calibrates:
        return _error(args, 2, f"--calibration-data applies only to builds that calibrate (--quantization "
                               f"fp8, int8-smoothquant, int4-awq, int4-gptq or --kv-cache-dtype fp8), "
                               f"not to --quantization {spec.quantization}")
    for flag, given, methods in (("--group-size", args.group_size is not None, GROUPED_METHODS),
                                 ("--quantize-lm-head", getattr(args, "quantize_lm_head", False), GROUPED_METHODS),
                                 ("--smoothquant-alpha", args.smoothquant_alpha is not None, ("int8-smoothquant",))):
        if given and spec.quantization not in methods:
            return _error(args, 2, f"{flag} applies only to {' and '.join(methods)}, "
                                   f"not to --quantization {spec.quantization}")
    gate = _gate(args)
    if isinstance(gate, str):
        return _error(args, 2, gate)
    if getattr(args, "print_hash", False):
        print(spec.hash())
        return 0
    def _on_sigterm(signum, frame):  # Kubernetes stops a Job's pod with SIGTERM: clean up as for ^C
        raise _Terminated()

    prev = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    from .compile_cache import prepare_shared_cache  # noqa: PLC0415

    report = ProgressReporter(_stderr_line)

    prepare_shared_cache(os.environ)  # the serving pods' Triton cache on the claim (operator builds only)
    try:
        model_src = spec.source.mounted_path(args.models_mount) if spec.source.kind == "pvc" else args.model
        if hub_ref is not None:  # downloaded before the output is touched: a failure leaves nothing there
            report.stage("download", f"downloading {hub_ref.uri()}")
            folder, _ = hub.download(hub_ref, hub_opts, progress=report, resolved=resolved)
            model_src = str(folder)
        if spec.calibration is not None and spec.calibration.kind == "huggingFace":
            report.stage("download", f"downloading calibration data {spec.calibration.uri()}")
            spec = replace(spec, calibration=_download_calibration(spec.calibration, args, report))
        check = None
        if gate.enabled:
            from .accuracy_gate import measure  # noqa: PLC0415

            src = model_src

            def check(folder):
                return measure(gate, src, folder, device=_eval_device(args.device))
        res = build_engine(spec, model_src, args.output, device=args.device, progress=report, check=check)
    except _Terminated:
        print("kiln build: terminated; the unfinished engine was removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (BadInputError, hub.HubError) as e:
        return _error(args, 2, str(e))
    except BuildError as e:
        from .accuracy_gate import EXIT_GATE_FAILED, AccuracyGateFailed  # noqa: PLC0415

        return _error(args, EXIT_GATE_FAILED if isinstance(e, AccuracyGateFailed) else 1, str(e))
    except ImportError as e:  # the `kiln` dispatcher prints the one-line reason
        _error(args, 1, f"cannot import module {e.name or e!s}: {e}", echo=False)
        raise
    except Exception as e:  # an unexpected crash: the cause still reaches the termination message
        _error(args, 1, f"unexpected {type(e).__name__}: {e}")
        raise
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
    _report(args, format_build_report(res.engine_hash, folder_bytes(res.path), *_report_parts(res.path, gate.enabled)))
    print(res.path)
    return 0


def _report_parts(path, gated: bool) -> tuple[dict | None, dict | None]:
    """The accuracy (with a gate; also of an engine built before) and the tensor-parallel
    shape (``ParallelShape.to_dict``) that the build report carries, from the manifest."""
    from kiln.common.manifest import read_manifest  # noqa: PLC0415
    from kiln.common.tensorparallel import ParallelShape  # noqa: PLC0415

    manifest = read_manifest(path)
    try:
        shape = ParallelShape.from_manifest(manifest).to_dict()
    except ValueError:  # a config without the sizes: the operator leaves the check to kiln serve
        shape = None
    return (manifest.get("accuracy") if gated else None), shape


def _report(args: argparse.Namespace, text: str) -> None:
    """Write a succeeded build's report (``kiln.common.enginecache.format_build_report``) to
    the ``--termination-log`` file when it exists: the operator keeps it in the engine record."""
    path = getattr(args, "termination_log", None)
    if path and os.path.isfile(path):
        try:
            with open(path, "w") as f:
                f.write(text[:4096])
        except OSError:
            pass  # a read-only or vanished file must not fail a finished build


def _gate(args: argparse.Namespace):
    """The ``AccuracyGate`` of the flags, or the error message of a bad one."""
    from .accuracy_gate import AccuracyGate  # noqa: PLC0415

    ppl, agree = getattr(args, "max_perplexity_increase", None), getattr(args, "min_greedy_agreement", None)
    if ppl is not None and not ppl >= 0:
        return f"--max-perplexity-increase must be a fraction >= 0 (0.05 is +5%), got {ppl}"
    if agree is not None and not 0 <= agree <= 1:
        return f"--min-greedy-agreement must be in [0, 1], got {agree}"
    if getattr(args, "gate_prompts", 8) < 1:
        return f"--gate-prompts must be at least 1, got {args.gate_prompts}"
    return AccuracyGate(ppl, agree, num_prompts=getattr(args, "gate_prompts", 8))


def _eval_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # noqa: PLC0415

    return "cuda" if torch.cuda.is_available() else "cpu"


class _Terminated(BaseException):
    """SIGTERM during a build (a BaseException, so cleanup code that catches Exception runs
    its ``finally`` blocks and lets it through, as for KeyboardInterrupt)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.runtime.build_cli ...`` (the same as ``kiln build ...``)."""
    p = add_build_args(argparse.ArgumentParser(prog="kiln build", description=__doc__.splitlines()[0]))
    return run_build(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
