"""CRDs of the optional APIs the operator works with, fetched from their Go modules and cached.

The Gateway API (``sigs.k8s.io/gateway-api``: HTTPRoute), the Gateway API Inference Extension
(``sigs.k8s.io/gateway-api-inference-extension``: InferencePool) and KEDA
(``github.com/kedacore/keda/v2``: ScaledObject) publish their CRD YAML in their module's
``config/crd/...``; ``GOFLAGS=-mod=mod go mod download -json MODULE@VERSION`` (the Go module
proxy, like the plane's binaries: devcluster/build.sh) gives the module's folder, and the files
are copied to ``~/.cache/kiln/cluster/crds/<module>@<version>/`` (``KILN_CLUSTER_CACHE``), so a
second call reads only the cache.  Versions are pinned in devcluster/versions.env.

    python -m kiln.devcluster.crds gateway-api inference-extension keda   # fetch, print the paths
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.devcluster.paths import DEVCLUSTER

__all__ = ["CRDSet", "CRD_SETS", "crd_files", "module_dir", "versions"]


@dataclass(frozen=True)
class CRDSet:
    """The CRDs of one module: ``files`` relative to the module's root."""

    module: str
    version_key: str  # the versions.env key of its version
    files: tuple[str, ...]


CRD_SETS = {
    "gateway-api": CRDSet("sigs.k8s.io/gateway-api", "GATEWAY_API_VERSION", (
        "config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
        "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
        "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
        "config/crd/standard/gateway.networking.k8s.io_referencegrants.yaml")),
    "inference-extension": CRDSet("sigs.k8s.io/gateway-api-inference-extension",
                                  "GATEWAY_API_INFERENCE_EXTENSION_VERSION", (
        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
        "config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml")),
    "keda": CRDSet("github.com/kedacore/keda/v2", "KEDA_VERSION", (
        "config/crd/bases/keda.sh_scaledobjects.yaml",
        "config/crd/bases/keda.sh_triggerauthentications.yaml")),
}


def versions() -> dict[str, str]:
    """The pins of devcluster/versions.env."""
    out = {}
    for line in (DEVCLUSTER / "versions.env").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _cache() -> Path:
    return Path(os.environ.get("KILN_CLUSTER_CACHE") or Path.home() / ".cache/kiln/cluster") / "crds"


def module_dir(module: str, version: str) -> Path:
    """The folder of ``module@version`` in Go's module cache (downloaded through the module
    proxy when missing).  Raises ``FileNotFoundError`` when go is missing or the download fails."""
    go = shutil.which("go")
    if go is None:
        raise FileNotFoundError("go is not installed: the CRDs come from Go modules")
    with tempfile.TemporaryDirectory() as tmp:  # outside any module: a plain download
        r = subprocess.run([go, "mod", "download", "-json", f"{module}@{version}"], cwd=tmp, capture_output=True,
                           text=True, env={**os.environ, "GOFLAGS": "-mod=mod"}, timeout=600)
    try:
        info = json.loads(r.stdout or "{}")
    except ValueError:
        info = {}
    if r.returncode != 0 or not info.get("Dir"):
        raise FileNotFoundError(f"go mod download {module}@{version} failed: "
                                f"{info.get('Error') or r.stderr.strip()[-400:]}")
    return Path(info["Dir"])


def crd_files(name: str) -> list[Path]:
    """The cached CRD files of set ``name`` (``CRD_SETS``), fetched on first use.  Raises
    ``KeyError`` for an unknown set, ``FileNotFoundError`` when they cannot be fetched."""
    crd_set = CRD_SETS[name]
    version = versions()[crd_set.version_key]
    dest = _cache() / f"{crd_set.module.replace('/', '_')}@{version}"
    out = [dest / Path(f).name for f in crd_set.files]
    if all(p.exists() for p in out):
        return out
    src = module_dir(crd_set.module, version)
    dest.mkdir(parents=True, exist_ok=True)
    for f, p in zip(crd_set.files, out):
        tmp = p.with_suffix(".tmp")
        shutil.copyfile(src / f, tmp)
        tmp.replace(p)  # a partial copy never looks cached
    return out


def main(argv: list[str]) -> int:
    names = argv or sorted(CRD_SETS)
    for n in names:
        if n not in CRD_SETS:
            print(f"unknown CRD set {n!r} (one of {', '.join(sorted(CRD_SETS))})", file=sys.stderr)
            return 2
        try:
            for p in crd_files(n):
                print(p)
        except FileNotFoundError as e:
            print(e, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
