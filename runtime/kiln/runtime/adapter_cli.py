"""``kiln adapter fetch``: put a PEFT LoRA adapter into a folder, checked, atomically.

    kiln adapter fetch --source hf://org/name[@rev] | FOLDER --output DIR
        [--engine ENGINE_DIR] [--max-lora-rank 16] [--download-dir D] [--termination-log F]

The operator's adapter Job runs it to bring ``spec.adapters[]`` onto the engine cache claim
(``.adapters/<key>``), where the serving pods load it.  The source is a Hub repository
(downloaded with the build's Hub code, ``kiln.runtime.hub``: ``HF_TOKEN``, ``HF_ENDPOINT``) or
a local folder (a claim mounted into the Job).  The adapter is read and checked as the server
would (``kiln.runtime.lora.peft_format``): its config, its rank against ``--max-lora-rank``, and
with ``--engine`` every tensor's shape against that engine's model, so an adapter of another
base fails here with a reason instead of in the pods.  ``adapter_config.json`` and
``adapter_model.safetensors`` are copied into a temporary folder beside ``--output`` and renamed
into place; an ``--output`` that already holds a valid adapter is kept (exit 0).

Exit codes: 0 fetched (the folder is printed), 2 a source that cannot be served (one line
``kiln adapter: error: REASON: message`` on stderr and in the termination log; reasons
``NotFound``, ``InvalidAdapter``, ``RankTooLarge``, ``ShapeMismatch``, ``ModelNotFound``,
``RevisionNotFound``, ``Unauthorized``, ``DownloadFailed``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import hub
from .cache_folder import place_folder

TERMINATION_LOG = "/dev/termination-log"
CONFIG_FILE = "adapter_config.json"  # = lora.peft_format.CONFIG_FILE (that module needs torch)
WEIGHTS_FILE = "adapter_model.safetensors"


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    """``kiln adapter``'s flags (torch-free)."""
    sub = parser.add_subparsers(dest="adapter_command", required=True)
    f = sub.add_parser("fetch", help="download or copy a PEFT LoRA adapter into a folder, checked against an engine")
    f.add_argument("--source", required=True, help="hf://org/name[@revision] (or org/name) or a PEFT adapter folder")
    f.add_argument("--output", required=True, help="the adapter folder to write (written atomically)")
    f.add_argument("--engine", default=None, help="a Kiln engine folder: check the adapter's shapes against its model")
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


def _check(folder: Path, ns: argparse.Namespace):
    """Read ``folder`` as the server would (LoRAError on anything it would refuse)."""
    from .lora.peft_format import LoRAError, _check_config, _read_config, load_peft_adapter  # noqa: PLC0415

    if not 1 <= ns.max_lora_rank <= 64:
        raise LoRAError(f"--max-lora-rank must be in 1..64, got {ns.max_lora_rank}")
    if ns.engine:
        from .engine_folder import open_engine  # noqa: PLC0415

        cfg = open_engine(ns.engine, verify=False).model_config
        return load_peft_adapter(folder, cfg, ns.max_lora_rank)
    return _check_config(_read_config(folder), folder, ns.max_lora_rank)


def run_adapter(ns: argparse.Namespace) -> int:
    """Run ``kiln adapter fetch``.  Returns the exit code."""
    from .lora.peft_format import LoRAError  # noqa: PLC0415

    out = Path(ns.output)
    try:
        if (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file():
            _check(out, ns)
            print(f"kiln adapter: {out} is already there", file=sys.stderr)
            print(out)
            return 0
        ref = hub.parse_ref(ns.source)
        if ref is not None:
            from .config import env_hub_options  # noqa: PLC0415

            folder, _ = hub.download(ref, env_hub_options(ns.download_dir), patterns=hub.ADAPTER_PATTERNS,
                                     required=CONFIG_FILE,
                                     progress=lambda m: print(f"kiln adapter: hub: {m}", file=sys.stderr, flush=True))
        else:
            folder = Path(ns.source)
        _check(folder, ns)
    except hub.HubError as e:
        return _error(ns, e.reason, str(e).split(": ", 1)[-1])
    except LoRAError as e:
        return _error(ns, e.reason, str(e))
    except (ValueError, OSError) as e:  # an engine folder that does not open
        return _error(ns, "InvalidEngine", str(e))
    try:
        place_folder(out, [folder / CONFIG_FILE, folder / WEIGHTS_FILE], lambda: (out / CONFIG_FILE).is_file())
    except OSError as e:
        return _error(ns, "WriteFailed", f"cannot write {out}: {e}")
    print(f"kiln adapter: {ns.source} -> {out}", file=sys.stderr)
    print(out)
    return 0
