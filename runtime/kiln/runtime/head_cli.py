"""``kiln head fetch``: put an EAGLE / EAGLE-3 head checkpoint into a folder, checked, atomically.

    kiln head fetch --source hf://org/name[@rev] | FOLDER --output DIR
        [--download-dir D] [--termination-log F]

The operator's build Job for an EAGLE head (``spec.runtime.speculative.draftModel.huggingFace``,
``kiln.operator.speculative``) runs it to bring the head onto the engine cache claim at
``/engines/<head key>``, where the serving pods read it (``kiln serve --speculative-model``).
A head is read as it is, never quantized: ``config.json`` and its weights (``*.safetensors``, or
``pytorch_model.bin``) are downloaded with the build's Hub code (``kiln.runtime.hub``:
``HF_TOKEN``, ``HF_ENDPOINT``) or taken from a local folder, checked as ``kiln serve`` reads
them (``kiln.runtime.model.eagle``: the decoder shape of its config, the EAGLE or EAGLE-3
tensor layout), copied into a temporary folder beside ``--output`` and renamed into place with
``.kiln-complete`` last.  An ``--output`` that already holds a complete head is kept (exit 0).

Exit codes: 0 fetched (the folder is printed; the size goes to the termination log as a build
report, as ``kiln build``'s), 2 a source that cannot be served (one line ``kiln head: error: REASON: message`` on
stderr and in the termination log; reasons ``NotFound``, ``InvalidHead``, ``ModelNotFound``,
``RevisionNotFound``, ``Unauthorized``, ``DownloadFailed``, ``WriteFailed``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kiln.common.enginecache import format_build_report

from . import hub
from .cache_folder import place_folder

TERMINATION_LOG = "/dev/termination-log"
CONFIG_FILE = "config.json"
HEAD_PATTERNS = (CONFIG_FILE, "*.safetensors", "pytorch_model.bin")  # what EagleProposer.load reads
COMPLETE_MARKER = ".kiln-complete"  # = kiln.common.manifest's marker: the folder is whole


def add_head_args(parser: argparse.ArgumentParser) -> None:
    """``kiln head``'s flags (torch-free)."""
    sub = parser.add_subparsers(dest="head_command", required=True)
    f = sub.add_parser("fetch", help="download or copy an EAGLE / EAGLE-3 head checkpoint into a folder, checked")
    f.add_argument("--source", required=True, help="hf://org/name[@revision] or a head folder (config.json + weights)")
    f.add_argument("--output", required=True, help="the head folder to write (written atomically)")
    f.add_argument("--download-dir", default=None, help="Hub download cache (default: $HF_HOME/hub)")
    f.add_argument("--termination-log", default=TERMINATION_LOG,
                   help="write a failure's one line, or the fetched size, here when the file exists "
                        "(default: %(default)s)")


def _write_log(ns: argparse.Namespace, text: str) -> None:
    path = ns.termination_log
    if path and os.path.isfile(path):
        try:
            with open(path, "w") as f:
                f.write(text[-4096:])
        except OSError:
            pass


def _error(ns: argparse.Namespace, reason: str, msg: str) -> int:
    line = f"kiln head: error: {reason}: {msg}"
    print(line, file=sys.stderr)
    _write_log(ns, line + "\n")
    return 2


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    return files or ([folder / "pytorch_model.bin"] if (folder / "pytorch_model.bin").is_file() else [])


def check_head(folder: Path) -> str:
    """Read ``folder`` as ``kiln serve`` reads an EAGLE head; returns its kind (``eagle`` or
    ``eagle3``).  Raises ValueError naming what is missing or malformed."""
    from .model.eagle import eagle_kind, read_head_config  # noqa: PLC0415  (torch)

    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{folder} has no {CONFIG_FILE}: an EAGLE head is a folder with config.json and its weights")
    try:
        read_head_config(folder)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder}/{CONFIG_FILE} is not a head's decoder config: {e}") from None
    files = _weight_files(folder)
    if not files:
        raise ValueError(f"{folder} has no *.safetensors or pytorch_model.bin")
    names: list[str] = []
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open  # noqa: PLC0415

            with safe_open(str(f), "pt") as st:
                names += list(st.keys())
        else:
            import torch  # noqa: PLC0415

            names += list(torch.load(f, map_location="cpu", weights_only=True))
    if "fc.weight" not in names:
        raise ValueError(f"{folder}: no fc.weight among its tensors: not an EAGLE or EAGLE-3 head")
    return eagle_kind(names)


def run_head(ns: argparse.Namespace) -> int:
    """Run ``kiln head fetch``.  Returns the exit code."""
    out = Path(ns.output)
    if (out / COMPLETE_MARKER).is_file():
        print(f"kiln head: {out} is already there", file=sys.stderr)
        print(out)
        return 0
    try:
        ref = hub.parse_ref(ns.source)
        if ref is not None:
            from .config import env_hub_options  # noqa: PLC0415

            folder, _ = hub.download(ref, env_hub_options(ns.download_dir), patterns=HEAD_PATTERNS,
                                     required=CONFIG_FILE, check_config=False,
                                     progress=lambda m: print(f"kiln head: hub: {m}", file=sys.stderr, flush=True))
        else:
            folder = Path(ns.source)
            if not folder.is_dir():
                return _error(ns, "NotFound", f"{ns.source} is not a folder")
        kind = check_head(folder)
    except hub.HubError as e:
        return _error(ns, e.reason, str(e).split(": ", 1)[-1])
    except (ValueError, OSError) as e:
        return _error(ns, "InvalidHead", str(e))
    try:
        place_folder(out, [folder / CONFIG_FILE, *_weight_files(folder)], lambda: (out / COMPLETE_MARKER).is_file(),
                     COMPLETE_MARKER)
    except OSError as e:
        return _error(ns, "WriteFailed", f"cannot write {out}: {e}")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"kiln head: {ns.source} ({kind}) -> {out}", file=sys.stderr)
    _write_log(ns, format_build_report(out.name, size) + "\n")  # the operator keeps the size in the record
    print(out)
    return 0
