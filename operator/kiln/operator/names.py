"""Names and label values of the operator's children: valid Kubernetes names and labels from any
valid resource name, distinct for distinct inputs (a cut or rewritten one carries a digest of
the whole).  Re-exported by ``builders``."""

from __future__ import annotations

import hashlib
import re

__all__ = ["MAX_NAME", "child_name", "label_value", "dns_label"]

MAX_NAME = 63  # DNS label: Job, Service and label values
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def child_name(base: str, suffix: str = "", limit: int = MAX_NAME) -> str:
    """``base-suffix`` cut to ``limit`` chars; a cut name gets 6 hex chars of sha256 of the
    full name so distinct long names stay distinct."""
    full = f"{base}-{suffix}" if suffix else base
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:6]
    keep = limit - len(digest) - 1 - (len(suffix) + 1 if suffix else 0)
    head = base[:max(keep, 1)].rstrip("-.")
    return f"{head}-{digest}-{suffix}" if suffix else f"{head}-{digest}"


def label_value(value: str) -> str:
    """``value`` as a valid label value (at most 63 characters, alphanumeric at both ends).
    A longer value keeps its head and gets 8 hex chars of sha256 of the whole, so two names
    that share their first 63 characters never share a label (and so never a selector)."""
    if len(value) <= MAX_NAME:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{value[:MAX_NAME - 9].rstrip('-._')}-{digest}"


def dns_label(value: str) -> str:
    """``value`` as an RFC 1035 label (what a Service name must be: lowercase alphanumerics
    and ``-``, a letter first, at most 63 characters).  A name that already is one stays as it
    is; any other (dots, a leading digit, too long) is rewritten and gets 8 hex chars of sha256
    of the original, so distinct resource names give distinct child names."""
    if len(value) <= MAX_NAME and _DNS1035.fullmatch(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    head = re.sub(r"[^a-z0-9-]+", "-", value.lower())
    if not head[:1].isalpha():
        head = "x" + head
    head = head[:MAX_NAME - 9].strip("-")
    return f"{head}-{digest}"
