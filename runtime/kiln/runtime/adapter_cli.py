"""``kiln adapter fetch``: put a PEFT LoRA adapter into a folder, checked, atomically.

    kiln adapter fetch --source hf://org/name[@rev] | FOLDER | builtin:NAME[?PARAMS] --output DIR
        [--engine ENGINE_DIR | --model SRC] [--max-lora-rank 16] [--download-dir D] [--termination-log F]

The operator's adapter Job runs it to bring ``spec.adapters[]`` onto the engine cache claim
(``.adapters/<key>``), where the serving pods load it.  The source is a Hub repository
(downloaded with the build's Hub code, ``kiln.runtime.hub``: ``HF_TOKEN``, ``HF_ENDPOINT``), a
local folder (a claim mounted into the Job), or a builtin adapter
(``builtin:random?rank=16&alpha=16&seed=0&targets=q_proj,v_proj``, ``kiln.common.adapterref``):
seeded random weights written for the base of ``--engine`` or ``--model``, which it needs
(``kiln.runtime.lora.builtin``).  The adapter is read and checked as the server would
(``kiln.runtime.lora.peft_format``): its config, its rank against ``--max-lora-rank``, and with
``--engine`` (an engine folder) or ``--model`` (a model source, as ``kiln serve --model``)
every tensor's shape against that model, so an adapter of another base fails here with a
reason instead of in the pods.  ``adapter_config.json`` and ``adapter_model.safetensors`` are
copied into a temporary folder beside ``--output`` with ``.kiln-source`` (the source) and
renamed into place; an ``--output`` that already holds a valid adapter of the same source is
kept (exit 0), one fetched from another source is refused (``OutputInUse``).

Exit codes: 0 fetched (the folder is printed), 2 a source that cannot be served (one line
``kiln adapter: error: REASON: message`` on stderr and in the termination log; reasons
``NotFound``, ``InvalidAdapter``, ``InvalidSource`` (a builtin adapter's name or parameters,
a builtin without a base), ``RankTooLarge``, ``ShapeMismatch``, ``ModelNotFound``,
``RevisionNotFound``, ``Unauthorized``, ``DownloadFailed``, ``InvalidEngine``, ``InvalidModel``,
``OutputInUse``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from kiln.common.adapterref import BuiltinAdapter
from kiln.common.specvalues import EngineSpecError

from . import hub
from .cache_folder import place_folder

TERMINATION_LOG = "/dev/termination-log"
CONFIG_FILE = "adapter_config.json"  # = lora.peft_format.CONFIG_FILE (that module needs torch)
WEIGHTS_FILE = "adapter_model.safetensors"
SOURCE_FILE = ".kiln-source"  # the --source an adapter folder was fetched from (one line)


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    """``kiln adapter``'s flags (torch-free)."""
    sub = parser.add_subparsers(dest="adapter_command", required=True)
    f = sub.add_parser("fetch", help="download or copy a PEFT LoRA adapter into a folder, checked against an engine")
    f.add_argument("--source", required=True,
                   help="hf://org/name[@revision] (or org/name), a PEFT adapter folder, or a builtin adapter "
                        "builtin:random[?rank=16&alpha=16&seed=0&targets=q_proj,...] (seeded random weights shaped "
                        "for --engine or --model)")
    f.add_argument("--output", required=True, help="the adapter folder to write (written atomically)")
    base = f.add_mutually_exclusive_group()
    base.add_argument("--engine", default=None, help="a Kiln engine folder: check the adapter's shapes against its model")
    base.add_argument("--model", default=None,
                      help="a model source (builtin:<name>, a Hugging Face folder, a .gguf file): check the "
                           "adapter's shapes against it (its config only; no weights are read)")
    f.add_argument("--max-lora-rank", type=int, default=16, help="refuse adapters of a larger rank (as kiln serve's flag)")
    f.add_argument("--download-dir", default=None, help="Hub download cache (default: $HF_HOME/hub)")
    f.add_argument("--termination-log", default=TERMINATION_LOG,
                   help="write a failure's one line here when the file exists (default: %(default)s)")


def _error(ns: argparse.Namespace, reason: str, msg: str) -> int:
    line = f"kiln adapter: error: {reason}: {msg}"
    print(line, file=sys.stderr)
    path = ns.termination_log
    if path and os.path.isfile(path):
        try:
            with open(path, "w") as f:
                f.write((line + "\n")[-4096:])
        except OSError:
            pass
    return 2


class _BaseError(Exception):
    """The base named by --engine or --model does not open: ``reason`` and message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _base_config(ns: argparse.Namespace):
    """The ``ModelConfig`` of --engine or --model, or None when neither is given.  Raises
    ``_BaseError``."""
    try:
        if ns.engine:
            from .engine_folder import open_engine  # noqa: PLC0415

            return open_engine(ns.engine, verify=False).model_config
    except (ValueError, OSError) as e:
        raise _BaseError("InvalidEngine", str(e)) from None
    try:
        if ns.model:
            from . import loader  # noqa: PLC0415

            return loader.load_model_config(loader.resolve_source(ns.model))
    except (ValueError, OSError) as e:  # ModelSourceError, UnsupportedModelError
        raise _BaseError("InvalidModel", f"--model {ns.model}: {e}") from None
    return None


def _check(folder: Path, ns: argparse.Namespace, cfg):
    """Read ``folder`` as the server would, against the base ``cfg`` when given (LoRAError on
    anything it would refuse)."""
    from .lora.peft_format import _check_config, _read_config, load_peft_adapter  # noqa: PLC0415

    if cfg is not None:
        return load_peft_adapter(folder, cfg, ns.max_lora_rank)
    return _check_config(_read_config(folder), folder, ns.max_lora_rank)


def _write_builtin(ref: BuiltinAdapter, ns: argparse.Namespace, cfg, scratch: Path) -> Path:
    """Write the builtin adapter ``ref`` for the base ``cfg`` (a ``ModelConfig``) into ``scratch``."""
    from .lora.builtin import write_builtin_adapter  # noqa: PLC0415
    from .lora.peft_format import LoRAError  # noqa: PLC0415

    try:
        return write_builtin_adapter(scratch / "adapter", ref, cfg)
    except OSError as e:
        raise LoRAError(f"cannot write the builtin adapter: {e}", "WriteFailed") from None


def run_adapter(ns: argparse.Namespace) -> int:
    """Run ``kiln adapter fetch``.  Returns the exit code."""
    from .lora.peft_format import LoRAError  # noqa: PLC0415

    out = Path(ns.output)
    with tempfile.TemporaryDirectory(prefix="kiln-adapter-") as scratch:
        try:
            if not 1 <= ns.max_lora_rank <= 64:
                raise LoRAError(f"--max-lora-rank must be in 1..64, got {ns.max_lora_rank}")
            builtin = BuiltinAdapter.from_string(ns.source) if ns.source.strip().startswith("builtin:") else None
            cfg = _base_config(ns)
            if builtin is not None and cfg is None:
                raise LoRAError(f"{ns.source}: a builtin adapter is shaped for a base model; give --engine or "
                                "--model", "InvalidSource")
            if (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file():
                placed = (out / SOURCE_FILE).read_text().strip() if (out / SOURCE_FILE).is_file() else None
                if placed is not None and placed != ns.source.strip():
                    raise LoRAError(f"{out} holds the adapter of {placed}, not of {ns.source}; give another "
                                    "--output (or remove that folder)", "OutputInUse")
                _check(out, ns, cfg)
                print(f"kiln adapter: {out} is already there", file=sys.stderr)
                print(out)
                return 0
            ref = hub.parse_ref(ns.source) if builtin is None else None
            if builtin is not None:
                folder = _write_builtin(builtin, ns, cfg, Path(scratch))
            elif ref is not None:
                from .config import env_hub_options  # noqa: PLC0415

                folder, _ = hub.download(ref, env_hub_options(ns.download_dir), patterns=hub.ADAPTER_PATTERNS,
                                         required=CONFIG_FILE,
                                         progress=lambda m: print(f"kiln adapter: hub: {m}", file=sys.stderr,
                                                                  flush=True))
            else:
                folder = Path(ns.source)
            _check(folder, ns, cfg)
        except EngineSpecError as e:  # a builtin adapter's name or parameters
            return _error(ns, "InvalidSource", str(e))
        except hub.HubError as e:
            return _error(ns, e.reason, str(e).split(": ", 1)[-1])
        except LoRAError as e:  # a builtin adapter's scratch folder is named by its source
            return _error(ns, e.reason, str(e).replace(str(Path(scratch) / "adapter"), ns.source))
        except _BaseError as e:
            return _error(ns, e.reason, str(e))
        source_file = Path(scratch) / SOURCE_FILE
        try:
            source_file.write_text(ns.source.strip() + "\n")
            place_folder(out, [folder / CONFIG_FILE, folder / WEIGHTS_FILE, source_file],
                         lambda: (out / CONFIG_FILE).is_file())
        except OSError as e:
            return _error(ns, "WriteFailed", f"cannot write {out}: {e}")
    print(f"kiln adapter: {ns.source} -> {out}", file=sys.stderr)
    print(out)
    return 0
