"""The Hub source's reference parsing and its no-network error (a closed loopback port as
HF_ENDPOINT, reached by the real huggingface_hub client): one line, exit 2, nothing written."""

import os
import socket
import subprocess
import sys

import pytest

from kiln.runtime import hub


def test_parse_ref_forms(tmp_path):
    assert hub.parse_ref("hf://org/name") == hub.HubRef("org/name", None)
    assert hub.parse_ref("hf://org/name@v1.0") == hub.HubRef("org/name", "v1.0")
    assert hub.parse_ref("org/name@main") == hub.HubRef("org/name", "main")
    assert hub.parse_ref("builtin:smollm2-135m-instruct") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # an existing local folder wins over a plain org/name
        assert hub.parse_ref("org/name") is None
    finally:
        os.chdir(cwd)
    with pytest.raises(hub.HubError, match="^ModelNotFound: "):
        hub.parse_ref("hf://just-a-name")
    with pytest.raises(hub.HubError):
        hub.parse_ref("hf://org/name@")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_build_without_network_is_one_line_exit_2(tmp_path):
    out = tmp_path / "engine"
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "build", "--model", "hf://org/name",
                        "--output", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "DownloadFailed: cannot download hf://org/name" in lines[0], r.stderr
    assert not out.exists()
