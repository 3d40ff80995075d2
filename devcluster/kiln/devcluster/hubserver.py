"""A local server that speaks the parts of the Hugging Face Hub's HTTP API that
``huggingface_hub`` (1.x) calls to download a model snapshot or a dataset's file, for tests and
the test plane.

Endpoints (as the real Hub answers them):

- ``GET /api/models/{org}/{name}`` and ``.../revision/{rev}``: ``model_info``; JSON with
  ``id``, ``sha`` (the commit) and ``siblings`` (``rfilename`` each).
- ``GET /api/datasets/{org}/{name}`` and ``.../revision/{rev}``: ``dataset_info``, the same JSON.
- ``HEAD`` / ``GET /{org}/{name}/resolve/{rev}/{path}`` (a dataset's:
  ``/datasets/{org}/{name}/resolve/...``): a file, with ``X-Repo-Commit``,
  ``ETag`` (the file's sha256, quoted) and ``Content-Length``; ``Range: bytes=N-`` gives 206
  with ``Content-Range`` (how the client resumes an ``.incomplete`` file).
- Errors with ``X-Error-Code``: 404 ``RepoNotFound`` / ``RevisionNotFound`` /
  ``EntryNotFound``; 401 ``GatedRepo`` for a gated repo without its token (403 with a wrong one).

Faults for tests: ``drop_gets`` (a file GET sends its headers and ``drop_after`` bytes of the
body, then closes the connection; ``drop_gets`` counts down, -1 forever).  ``gets`` counts the
file GETs served, per ``(repo, path)`` (a dataset's repo as ``datasets/org/name``); ``infos``
the ``model_info`` and ``dataset_info`` requests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    """One model repo: the files of ``folder`` at commit ``sha``; ``refs`` maps branch and tag
    names to it (``main`` always); ``token`` set makes it gated (the token gives access)."""

    folder: Path
    sha: str
    refs: tuple[str, ...] = ("main",)
    token: str | None = None
    _etags: dict[str, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())

    def etag(self, name: str) -> str:
        if name not in self._etags:
            h = hashlib.sha256()
            with open(self.folder / name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            self._etags[name] = h.hexdigest()
        return self._etags[name]


class HubServer:
    """The server on ``127.0.0.1`` (a free port unless given); ``url`` is what ``HF_ENDPOINT``
    takes.  Use as a context manager or ``start()`` / ``stop()``."""

    def __init__(self, port: int = 0):
        self.repos: dict[str, HubRepo] = {}
        self.datasets: dict[str, HubRepo] = {}
        self.gets: dict[tuple[str, str], int] = {}
        self.infos = 0  # model_info requests answered (any status)
        self.drop_gets = 0
        self.drop_after = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def add(self, repo: str, folder: Path, sha: str | None = None, refs: tuple[str, ...] = ("main",),
            token: str | None = None) -> HubRepo:
        """Serve ``folder`` as ``repo`` (``org/name``); ``sha`` defaults to one derived from the name."""
        r = HubRepo(Path(folder), sha or hashlib.sha1(repo.encode()).hexdigest(), tuple(refs), token)
        self.repos[repo] = r
        return r

    def add_dataset(self, repo: str, folder: Path, sha: str | None = None, refs: tuple[str, ...] = ("main",),
                    token: str | None = None) -> HubRepo:
        """Serve ``folder`` as dataset ``repo`` (``org/name``), as :meth:`add` a model."""
        r = HubRepo(Path(folder), sha or hashlib.sha1(f"datasets/{repo}".encode()).hexdigest(), tuple(refs), token)
        self.datasets[repo] = r
        return r

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def total_gets(self) -> int:
        with self._lock:
            return sum(self.gets.values())

    def _take_drop(self) -> bool:
        with self._lock:
            if self.drop_gets == 0:
                return False
            if self.drop_gets > 0:
                self.drop_gets -= 1
            return True


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: tests read their own output
            pass

        def _error(self, status: int, code: str, msg: str, commit: str | None = None) -> None:
            body = json.dumps({"error": msg}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", msg)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo(self, repo: str, rev: str | None, dataset: bool = False) -> HubRepo | None:
            """The repo (a dataset's when ``dataset``) when it exists, is accessible and has
            ``rev``; else answers the error."""
            r = (hub.datasets if dataset else hub.repos).get(repo)
            if r is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                return None
            if r.token is not None:
                auth = self.headers.get("Authorization") or ""
                if not auth.startswith("Bearer "):
                    self._error(401, "GatedRepo", f"Access to model {repo} is restricted. You must be authenticated.")
                    return None
                if auth[len("Bearer "):] != r.token:
                    self._error(403, "GatedRepo", f"Access to model {repo} is restricted and you are not in the "
                                                  f"authorized list.")
                    return None
            if rev is not None and rev not in r.refs and rev != r.sha:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return r

        def _info(self, parts: list[str]) -> None:
            # api/{models,datasets}/{org}/{name}[/revision/{rev}]
            repo = "/".join(parts[2:4])
            rev = unquote(parts[5]) if len(parts) >= 6 and parts[4] == "revision" else None
            with hub._lock:
                hub.infos += 1
            r = self._repo(repo, rev, dataset=parts[1] == "datasets")
            if r is None:
                return
            body = json.dumps({"_id": r.sha[:24], "id": repo, "modelId": repo, "sha": r.sha, "private": False,
                               "gated": "manual" if r.token else False, "disabled": False, "tags": [],
                               "siblings": [{"rfilename": f} for f in r.files()]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self, parts: list[str], dataset: bool = False) -> None:
            # {org}/{name}/resolve/{rev}/{path...} (after datasets/ for a dataset's)
            repo, rev, name = "/".join(parts[:2]), unquote(parts[3]), unquote("/".join(parts[4:]))
            r = self._repo(repo, rev, dataset)
            if r is None:
                return
            path = r.folder / name
            if not name or ".." in Path(name).parts or not path.is_file():
                self._error(404, "EntryNotFound", f"Entry not found: {name}", commit=r.sha)
                return
            size = path.stat().st_size
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng[6:].endswith("-") and rng[6:-1].isdigit():
                start = min(int(rng[6:-1]), size)
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", r.sha)
            self.send_header("ETag", f'"{r.etag(name)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if self.command == "HEAD":
                return
            key = (f"datasets/{repo}" if dataset else repo, name)
            with hub._lock:
                hub.gets[key] = hub.gets.get(key, 0) + 1
            drop = hub._take_drop()
            with open(path, "rb") as f:
                f.seek(start)
                if drop:
                    self.wfile.write(f.read(hub.drop_after))
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    self.wfile.write(chunk)

        def _route(self) -> None:
            parts = [p for p in urlsplit(self.path).path.split("/") if p]
            if len(parts) >= 4 and parts[0] == "api" and parts[1] in ("models", "datasets") and self.command == "GET":
                self._info(parts)
            elif len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve":
                self._file(parts[1:], dataset=True)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts)
            else:
                self._error(404, "EntryNotFound", f"no route {self.path}")

        do_GET = _route
        do_HEAD = _route

    return Handler
