"""Replica choice: which ready replica of a model takes a request.

Three policies behind one call, ``choose(replicas, load, key) -> replica``:

- ``PrefixAffinity``: consistent hashing with bounded loads (CHWBL; Mirrokni, Thorup and
  Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018; the scheme KubeAI's
  load balancer uses). Each replica owns ``num_points`` points on a 64-bit hash ring; a
  request's key (the first characters of its rendered prompt, ``prefix_key``) hashes to a
  point, and the request goes to the first replica clockwise whose outstanding requests,
  counting this one, stay within ``ceil(load_factor * (total + 1) / n)``. Requests sharing a
  prompt prefix land on the same replica (its prefix cache holds their blocks) until it is
  loaded past the bound; then they spill to the next replica on the ring, the same one for
  every such request. Adding or removing a replica moves only the keys of its ring points.
- ``LeastOutstanding``: the replica with the fewest outstanding requests (ties: the first in
  order, after a round-robin rotation so ties do not all land on one replica).
- ``RoundRobin``: each replica in turn (the baseline of the prefix benchmark).

Plain Python, no I/O: ``load`` is the proxy's count of requests in flight per replica.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from typing import Any, Mapping, Protocol, Sequence


class Policy(Protocol):
    def choose(self, replicas: Sequence[str], load: Mapping[str, int], key: str) -> str:
        """One of ``replicas`` (non-empty) for a request with prefix ``key``."""


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class PrefixAffinity:
    """CHWBL over the replicas (see the module docstring).

    Args:
        load_factor: the bound ``c`` (> 1): a replica takes a request while its load + 1 is at
            most ``ceil(c * (total load + 1) / num replicas)``.
        num_points: ring points per replica (more: a more even share of keys).
    """

    def __init__(self, load_factor: float = 1.25, num_points: int = 128):
        if load_factor <= 1.0:
            raise ValueError(f"load_factor {load_factor} must be above 1")
        self.load_factor = load_factor
        self.num_points = num_points
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, replicas: Sequence[str]) -> None:
        key = tuple(sorted(replicas))
        if key == self._ring_of:
            return
        pts = sorted((_hash64(f"{r}#{i}"), r) for r in key for i in range(self.num_points))
        self._points = [p for p, _ in pts]
        self._owners = [r for _, r in pts]
        self._ring_of = key

    def choose(self, replicas: Sequence[str], load: Mapping[str, int], key: str) -> str:
        self._ring(replicas)
        total = sum(load.get(r, 0) for r in replicas)
        bound = math.ceil(self.load_factor * (total + 1) / len(replicas))
        start = bisect.bisect_left(self._points, _hash64(key)) % len(self._points)
        seen: set[str] = set()
        for i in range(len(self._points)):
            r = self._owners[(start + i) % len(self._points)]
            if r in seen:
                continue
            if load.get(r, 0) + 1 <= bound:
                return r
            seen.add(r)
            if len(seen) == len(self._ring_of):
                break
        return min(replicas, key=lambda r: load.get(r, 0))  # unreachable with c > 1: a safe fallback


class LeastOutstanding:
    """The replica with the fewest requests in flight."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[str], load: Mapping[str, int], key: str) -> str:
        k = next(self._turn) % len(replicas)
        rotated = list(replicas[k:]) + list(replicas[:k])
        return min(rotated, key=lambda r: load.get(r, 0))


class RoundRobin:
    """Each replica in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[str], load: Mapping[str, int], key: str) -> str:
        return replicas[next(self._turn) % len(replicas)]


def make_policy(name: str, load_factor: float = 1.25) -> Policy:
    """The policy called ``name`` (``prefix``, ``least-outstanding``, ``round-robin``).
    Raises ``ValueError`` for another name."""
    if name == "prefix":
        return PrefixAffinity(load_factor)
    if name == "least-outstanding":
        return LeastOutstanding()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}")


def prefix_key(body: Mapping[str, Any], num_chars: int) -> str:
    """The first ``num_chars`` characters of a request's prompt, as the engine would see it
    first: a completion's ``prompt`` (the first one of a list; token ids joined by spaces), a
    chat's messages rendered ``role: content`` one per line (text parts of multi-part
    contents), a v2 generate's ``text_input``. Empty when the body has none of them."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        lines = []
        for m in body["messages"]:
            if not isinstance(m, Mapping):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            lines.append(f"{m.get('role', '')}: {content or ''}")
            if sum(len(x) + 1 for x in lines) >= num_chars:
                break
        return "\n".join(lines)[:num_chars]
    if prompt is None:
        prompt = body.get("text_input")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = " ".join(str(t) for t in prompt)  # one prompt of token ids
    elif isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""  # the first of a batch
        if isinstance(prompt, list):  # of token id lists
            prompt = " ".join(str(t) for t in prompt)
    return prompt[:num_chars] if isinstance(prompt, str) else ""
