"""The Hub source's reference parsing and its no-network error (a closed loopback port as
HF_ENDPOINT, reached by the real huggingface_hub client): one line, exit 2, nothing written."""

import json
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


def _small_model_folder(tmp_path):
    """A model folder of small files (the client treats them as any other file)."""
    d = tmp_path / "model"
    d.mkdir()
    # a config Kiln can run: the download checks config.json before it fetches the weights
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu"}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "README.md").write_text("not downloaded")
    return d


def test_download_errors_and_cache_through_real_client(tmp_path):
    from kiln.devcluster.hubserver import HubServer

    with HubServer() as srv:
        srv.add("org/open", _small_model_folder(tmp_path))
        srv.add("org/gated", tmp_path / "model", token="secret")
        opts = hub.HubOptions(endpoint=srv.url, cache_dir=tmp_path / "cache", timeout_s=10)
        folder, sha = hub.download(hub.HubRef("org/open"), opts)
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
        assert (folder / "model.safetensors").read_bytes() == (tmp_path / "model" / "model.safetensors").read_bytes()
        n = srv.total_gets()
        assert hub.download(hub.HubRef("org/open", sha), opts) == (folder, sha)
        assert srv.total_gets() == n  # the cached commit is not fetched again
        for ref, reason in [(hub.HubRef("org/missing"), "ModelNotFound"),
                            (hub.HubRef("org/open", "no-such-branch"), "RevisionNotFound"),
                            (hub.HubRef("org/gated"), "Unauthorized")]:
            with pytest.raises(hub.HubError) as e:
                hub.download(ref, opts)
            assert e.value.reason == reason and "\n" not in str(e.value), str(e.value)
        folder2, _ = hub.download(hub.HubRef("org/gated"), hub.HubOptions(srv.url, "secret", tmp_path / "cache"))
        assert (folder2 / "config.json").is_file()
