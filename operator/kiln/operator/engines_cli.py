"""``kiln engines``: the engine cache, from the cluster's side and from the claim's.

- ``kiln engines list [-n NS | -A] [--kubeconfig F]``: the engines the operator recorded (one
  engine record per engine and claim): hash, claim, size, who uses it, unused since when.
- ``kiln engines list --cache-dir DIR``: the engine folders of a mounted claim and their sizes.
- ``kiln engines gc --cache-dir DIR [--remove HASH ...] [--spare HASH ...] [--min-free BYTES]``:
  what the operator's cleanup Job runs on the claim (``kiln.common.enginecache.collect``); the
  report (JSON) goes to stdout and to the termination message, where the operator reads it.

Exit codes: 0 done, 2 bad input (a missing folder, a name that is not a hash), 1 an API error.
The claim side needs only ``kiln.common`` (it runs in the runtime image).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping

from kiln.common import enginecache

TERMINATION_LOG = "/dev/termination-log"


def add_engines_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``kiln engines``' modes and flags to ``p``."""
    sub = p.add_subparsers(dest="engines_command", required=True)
    ls = sub.add_parser("list", help="engines in the cluster's records (or on a mounted claim: --cache-dir)")
    ls.add_argument("--cache-dir", default=None, help="list this engine cache folder instead of the cluster's records")
    ls.add_argument("-n", "--namespace", default=None, help="namespace (default: the kubeconfig context's)")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    ls.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, in-cluster)")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    gc = sub.add_parser("gc", help="delete engines from an engine cache folder (the operator's cleanup Job)")
    gc.add_argument("--cache-dir", required=True, help="the engine cache folder (the claim's mount)")
    gc.add_argument("--remove", nargs="*", default=[], metavar="HASH", help="engines to delete")
    gc.add_argument("--spare", nargs="*", default=[], metavar="HASH",
                    help="engines to delete in this order (oldest unused first) while less than --min-free is free")
    gc.add_argument("--min-free", type=int, default=0, metavar="BYTES", help="free space to keep (default: 0)")
    gc.add_argument("--no-build-running", action="store_true",
                    help="no build writes into the cache now (the operator's cleanup): a build's temporary folder "
                         "of an engine to delete is a killed build's leftover and is deleted too")
    gc.add_argument("--termination-log", default=TERMINATION_LOG,
                    help="write the report here when the file exists (default: %(default)s)")
    return p


def human_bytes(n: int | None) -> str:
    """``1.5Gi``-style size; ``-`` when unknown."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if x < 1024 or unit == "Ti":
            return f"{x:.0f}{unit}" if unit == "" else f"{x:.1f}{unit}"
        x /= 1024
    return str(n)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def record_rows(records: list[Mapping[str, Any]]) -> list[dict]:
    """The engine records as plain rows: namespace, claim, hash, bytes, usedBy, unusedSince,
    completedAt, deleting (from ``builders.engine_record``'s data and annotations)."""
    from . import constants as c  # noqa: PLC0415

    out = []
    for r in records:
        data, meta = r.get("data") or {}, r.get("metadata") or {}
        ann = meta.get("annotations") or {}
        size = data.get("sizeBytes")
        out.append({"namespace": meta.get("namespace", ""), "claim": data.get("claimName", ""),
                    "hash": data.get("engineHash", ""), "bytes": int(size) if size and size.isdigit() else None,
                    "usedBy": [u for u in (data.get("usedBy") or "").split(",") if u],
                    "unusedSince": ann.get(c.ANNOTATION_UNUSED_SINCE), "completedAt": data.get("completedAt"),
                    "deleting": ann.get(c.ANNOTATION_DELETING)})
    return sorted(out, key=lambda x: (x["namespace"], x["claim"], x["hash"]))


def _list_cluster(args: argparse.Namespace) -> int:
    from . import constants as c  # noqa: PLC0415
    from .kube import ApiError, Kube, KubeConfig  # noqa: PLC0415

    kube = Kube(KubeConfig(kubeconfig=args.kubeconfig))
    ns = None if args.all_namespaces else (args.namespace or _context_namespace(kube))
    try:
        records = kube.list("v1", "ConfigMap", ns, label_selector=f"{c.LABEL_COMPONENT}={c.COMPONENT_RECORD}")
    except ApiError as e:
        print(f"kiln engines: error: {e}", file=sys.stderr)
        return 1
    finally:
        kube.close()
    rows = record_rows(records)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [["NAMESPACE", "CLAIM", "ENGINE", "SIZE", "USED BY", "UNUSED SINCE", "BUILT"]]
    for r in rows:
        table.append([r["namespace"], r["claim"], r["hash"], human_bytes(r["bytes"]), ",".join(r["usedBy"]) or "-",
                      "deleting" if r["deleting"] else (r["unusedSince"] or "-"), r["completedAt"] or "-"])
    print(_table(table) if rows else "no engines recorded")
    return 0


def _context_namespace(kube) -> str:
    """The namespace of the kubeconfig's current context, else ``default``."""
    try:
        from kubernetes import config  # noqa: PLC0415

        _, ctx = config.list_kube_config_contexts(config_file=kube.cfg.kubeconfig)
        return (ctx or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # noqa: BLE001 - in-cluster or no kubeconfig: the default namespace
        return "default"


def _list_folder(args: argparse.Namespace) -> int:
    try:
        entries = enginecache.list_engines(args.cache_dir)
    except FileNotFoundError as e:
        print(f"kiln engines: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.__dict__ for e in entries], indent=1))
        return 0
    rows = [["ENGINE", "KIND", "SIZE", "STATE"]] + [
        [e.hash, e.kind, human_bytes(e.bytes), "complete" if e.complete else ("building" if e.building else "incomplete")]
        for e in entries]
    print(_table(rows) if entries else f"no engines in {args.cache_dir}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    try:
        report = enginecache.collect(args.cache_dir, args.remove, args.spare, args.min_free, args.no_build_running)
    except (FileNotFoundError, ValueError) as e:
        print(f"kiln engines: error: {e}", file=sys.stderr)
        return 2
    text = report.to_json()
    print(text)
    for h, n in report.removed.items():
        print(f"kiln engines: removed {h} ({human_bytes(n)})", file=sys.stderr)
    if args.termination_log and os.path.isfile(args.termination_log):
        try:
            with open(args.termination_log, "w") as f:
                f.write(text)
        except OSError:
            pass  # the report is on stdout too
    return 0


def run_engines(args: argparse.Namespace) -> int:
    """Run ``kiln engines`` from parsed arguments.  Returns the exit code."""
    if args.engines_command == "gc":
        return _gc(args)
    if args.cache_dir:
        return _list_folder(args)
    return _list_cluster(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.operator.engines_cli ...`` (the same as ``kiln engines ...``)."""
    p = add_engines_args(argparse.ArgumentParser(prog="kiln engines", description=__doc__.splitlines()[0]))
    return run_engines(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
