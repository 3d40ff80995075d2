"""Certificates, keys and kubeconfigs of the test control plane, made with the openssl CLI.

Everything is ECDSA P-256 (a key takes milliseconds, RSA would take seconds on 2 cores) and is
made once per plane folder: later `up`s reuse it, since ports do not appear in certificates.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

# The cluster's service range; the first address is the `kubernetes` Service (a SAN of the server).
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"

# Client identities: file stem -> (common name, organization). RBAC's bootstrap policy binds these
# names, so each component runs with its own identity rather than as admin.
CLIENTS = {
    "admin": ("kiln-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", ""),
    "scheduler": ("system:kube-scheduler", ""),
    "kwok": ("kiln-kwok", "system:masters"),
    "custom-metrics": ("kiln-custom-metrics", "system:masters"),
}

# Host names of the custom-metrics server as the aggregator sees it (Service <name>.<namespace>.svc).
METRICS_NAMESPACE = "kiln-plane-system"
METRICS_SERVICE = "custom-metrics"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _cert(pki: Path, stem: str, cn: str, *, org: str = "", ca: str = "", sans: str = "",
          is_ca: bool = False, usage: str = "serverAuth,clientAuth") -> None:
    """Writes <stem>.key and <stem>.crt, signed by <ca>.crt (or self-signed when ca is empty)."""
    if (pki / f"{stem}.crt").exists():
        return
    lines = ["[req]", "distinguished_name=dn", "prompt=no", "[dn]", f"CN={cn}"]
    if org:
        lines.append(f"O={org}")
    lines.append("[ext]")
    if is_ca:
        lines += ["basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"]
    else:
        lines += ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
                  f"extendedKeyUsage={usage}"]
        if sans:
            lines.append(f"subjectAltName={sans}")
    cfg = pki / f"{stem}.cnf"
    cfg.write_text("\n".join(lines) + "\n")
    args = ["req", "-x509", "-config", str(cfg), "-extensions", "ext", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650",
            "-keyout", str(pki / f"{stem}.key"), "-out", str(pki / f"{stem}.crt.tmp")]
    if ca:
        args += ["-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key")]
    _openssl(*args)
    (pki / f"{stem}.crt.tmp").rename(pki / f"{stem}.crt")
    cfg.unlink()


def ensure_pki(pki: Path, advertise_address: str) -> None:
    """Creates the plane's CAs, serving and client certificates and service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    _cert(pki, "ca", "kiln-plane-ca", is_ca=True)
    _cert(pki, "front-proxy-ca", "kiln-plane-front-proxy-ca", is_ca=True)
    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           "kubernetes.default.svc.cluster.local"]
    ips = sorted({"127.0.0.1", advertise_address, KUBERNETES_SERVICE_IP})
    sans = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
    _cert(pki, "apiserver", "kube-apiserver", ca="ca", sans=sans, usage="serverAuth")
    metrics_dns = [METRICS_SERVICE, f"{METRICS_SERVICE}.{METRICS_NAMESPACE}",
                   f"{METRICS_SERVICE}.{METRICS_NAMESPACE}.svc", "localhost"]
    _cert(pki, "custom-metrics-serving", "custom-metrics", ca="ca", usage="serverAuth",
          sans=",".join([f"DNS:{d}" for d in metrics_dns] + ["IP:127.0.0.1"]))
    _cert(pki, "front-proxy-client", "front-proxy-client", ca="front-proxy-ca", usage="clientAuth")
    for stem, (cn, org) in CLIENTS.items():
        _cert(pki, stem, cn, org=org, ca="ca", usage="clientAuth")
    if not (pki / "sa.pub").exists():
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(pki / "sa.key"))
        _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub.tmp"))
        (pki / "sa.pub.tmp").rename(pki / "sa.pub")


def write_kubeconfig(path: Path, pki: Path, server: str, user: str, context: str = "kiln-plane") -> None:
    """Writes a kubeconfig (JSON is YAML) for client certificate <pki>/<user>.crt against server."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki / f"{user}.crt"),
                                          "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.rename(path)
