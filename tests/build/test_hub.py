"""The Hugging Face Hub source (``hf://org/name[@rev]``) through the real ``huggingface_hub``
client against a loopback server speaking the Hub's HTTP API (``kiln.devcluster.hubserver``),
reached through ``HF_ENDPOINT`` as a mirror would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kiln.devcluster.hubserver import HubServer
from kiln.runtime.demo import free_port, wait_ready

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "kiln-test/tiny-llama"
GATED = "kiln-test/gated"
GPT2 = "kiln-test/gpt2-like"
TOKEN = "hf_kilntesttoken"
DATA = "kiln-test/calib"  # a dataset: data/cal.jsonl (domain hubtext), data/other.jsonl, README.md
GATED_DATA = "kiln-test/gated-calib"
CAL_RECORDS = [{"text": f"Record {i}: the river runs past the mill, and the miller counts {i * 7} sacks of "
                        f"flour before the evening bell.", "domain": "hubtext"} for i in range(24)]


@pytest.fixture(scope="module")
def hub(smollm_hf, tiny_model, tmp_path_factory):
    gpt2 = tmp_path_factory.mktemp("gpt2-like")  # an architecture Kiln does not run, with 4 MB of "weights"
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                  "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256}))
    (gpt2 / "model.safetensors").write_bytes(b"\0" * (4 << 20))
    with HubServer() as s:
        s.add(REPO, Path(smollm_hf.path))
        s.add(TINY, tiny_model, refs=("main", "v1"))
        s.add(GATED, tiny_model, token=TOKEN)
        s.add(GPT2, gpt2)
        data = tmp_path_factory.mktemp("calib-dataset")
        (data / "data").mkdir()
        (data / "data" / "cal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CAL_RECORDS))
        (data / "data" / "other.jsonl").write_text(json.dumps({"text": "another file", "domain": "other"}) + "\n")
        (data / "README.md").write_text("# calibration text\n")
        s.add_dataset(DATA, data, refs=("main", "v2"))
        s.add_dataset(GATED_DATA, data, token=TOKEN)
        yield s


def _env(hub: HubServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": hub.url, "PYTHONUNBUFFERED": "1", **extra}


def _kiln(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.runtime.cli", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def test_build_from_the_hub_pins_the_commit_and_reuses_the_cache(hub, tiny_model, tmp_path, monkeypatch):
    from kiln.common.manifest import read_manifest
    from kiln.runtime.build_cli import main

    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    cache = tmp_path / "hf-cache"
    gets0, infos0 = hub.total_gets(), hub.infos
    assert main(["--model", f"hf://{TINY}@v1", "--quantization", "none", "--output", str(tmp_path / "a"),
                 "--download-dir", str(cache), "--termination-log", ""]) == 0
    downloaded = hub.total_gets() - gets0
    assert hub.infos - infos0 == 1  # the revision is resolved once per build
    assert downloaded == len([f for f in os.listdir(tiny_model)])  # config, weights, tokenizer files
    m = read_manifest(tmp_path / "a")
    sha = hub.repos[TINY].sha
    assert m["build_spec"]["source"] == {"kind": "huggingFace", "repo": TINY, "revision": sha}
    assert m["source"]["ref"] == f"hf://{TINY}@{sha}"
    # the same weights as the engine built from the local folder
    assert main(["--model", str(tiny_model), "--quantization", "none", "--output", str(tmp_path / "local"),
                 "--termination-log", ""]) == 0
    local = read_manifest(tmp_path / "local")
    assert m["source"]["sha256"] == local["source"]["sha256"]
    assert m["weights"]["files"] == local["weights"]["files"]
    assert m["engine_hash"] != local["engine_hash"]  # the hash names the source (repo@commit)
    # plain org/name (the default branch) is the same commit, so the same engine; another
    # quantization of it downloads nothing (the cache)
    gets1 = hub.total_gets()
    assert main(["--model", TINY, "--quantization", "none", "--output", str(tmp_path / "a"),
                 "--download-dir", str(cache), "--termination-log", ""]) == 0
    assert main(["--model", f"hf://{TINY}", "--quantization", "fp8", "--calibration-samples", "2",
                 "--output", str(tmp_path / "b"), "--download-dir", str(cache), "--termination-log", ""]) == 0
    assert hub.total_gets() == gets1
    assert read_manifest(tmp_path / "b")["build_spec"]["source"]["revision"] == sha


def test_a_dropped_download_resumes(hub, tmp_path, monkeypatch):
    from kiln.runtime import hub as hubmod

    hub.drop_gets, hub.drop_after = 1, 100  # the first file GET breaks after 100 bytes
    try:
        folder, sha = hubmod.download(hubmod.HubRef(TINY), hubmod.HubOptions(endpoint=hub.url, cache_dir=tmp_path))
    finally:
        hub.drop_gets = 0
    assert sha == hub.repos[TINY].sha
    src = hub.repos[TINY].folder
    for f in os.listdir(folder):
        assert (folder / f).read_bytes() == (src / f).read_bytes(), f


@pytest.mark.parametrize("model, env_extra, reason", [
    (f"hf://{TINY[:-1]}x", {}, "ModelNotFound"),
    (f"hf://{TINY}@no-such-branch", {}, "RevisionNotFound"),
    (f"hf://{GATED}", {}, "Unauthorized"),
    (f"hf://{GATED}", {"HF_TOKEN": "hf_wrong"}, "Unauthorized"),
    (f"hf://{GATED}", {"HF_TOKEN": TOKEN, "drop": "1"}, "DownloadFailed"),
    (f"hf://{TINY}", {"HF_ENDPOINT": "closed"}, "DownloadFailed"),
    (f"hf://{GPT2}", {}, "UnsupportedModel"),
])
def test_build_errors_are_one_line_exit_2_and_write_nothing(hub, tmp_path, model, env_extra, reason):
    env_extra = dict(env_extra)
    drop = env_extra.pop("drop", None)
    if env_extra.get("HF_ENDPOINT") == "closed":
        env_extra["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    out, term = tmp_path / "engine", tmp_path / "termination-log"
    term.write_text("")
    if drop:
        hub.drop_gets, hub.drop_after = -1, 0  # every file GET breaks: the client's retries cannot heal it
    try:
        r = _kiln("build", "--model", model, "--quantization", "none", "--output", str(out),
                  "--download-dir", str(tmp_path / "cache"), "--termination-log", str(term),
                  env=_env(hub, **env_extra))
    finally:
        hub.drop_gets = 0
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kiln build: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"kiln build: error: {reason}: "), r.stderr
    assert term.read_text().startswith(f"kiln build: {reason}: ")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["termination-log"]  # no engine
    assert "HTTP Request" not in r.stderr  # the Hub client's per-request log lines stay at debug level
    if reason == "UnsupportedModel":  # refused from config.json, before the weights are fetched
        assert "GPT2LMHeadModel" in errors[0] and hub.gets.get((GPT2, "model.safetensors"), 0) == 0
    if reason == "Unauthorized":
        assert TOKEN not in r.stderr


def test_serve_from_the_hub_generates_as_the_local_folder(hub, smollm_hf, tmp_path):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "--log-level", "WARNING", "serve",
                             "--model", f"hf://{REPO}", "--download-dir", str(tmp_path / "cache"),
                             "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "64"],
                            env=_env(hub), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(base, proc, timeout_s=600)
        except RuntimeError:
            raise AssertionError((tmp_path / "serve.log").read_text()[-4000:]) from None
        r = httpx.post(f"{base}/v1/completions", json={"model": REPO, "prompt": "The capital of France is",
                                                        "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == REPO
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "kiln: hub: [" in (tmp_path / "serve.log").read_text()  # a progress line per file
    llm = LLM(model=str(smollm_hf.path), num_kv_blocks=64)
    local = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert served == local.outputs[0].text


def test_serve_error_is_one_line_exit_2(hub, tmp_path):
    r = _kiln("serve", "--model", f"hf://{GATED}", "--port", "0", "--download-dir", str(tmp_path), env=_env(hub))
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kiln: error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("kiln: error: Unauthorized: access to model kiln-test/gated"), r.stderr


def test_parse_ref():
    from kiln.runtime.hub import HubError, HubRef, parse_ref

    assert parse_ref("hf://a/b@v1") == HubRef("a/b", "v1")
    assert parse_ref("a/b") == HubRef("a/b")
    assert parse_ref("builtin:smollm2-135m-instruct") is None
    assert parse_ref("./a/b") is None and parse_ref("/a/b") is None
    with pytest.raises(HubError, match="ModelNotFound"):
        parse_ref("hf://justaname")
    assert json.dumps(HubRef("a/b", "c").uri()) == '"hf://a/b@c"'
    with pytest.raises(HubError, match="names a dataset, not a model"):
        parse_ref("hf://datasets/a/b")


def test_parse_dataset_file():
    from kiln.runtime.hub import HubError, HubRef, parse_dataset_file

    ds = HubRef("org/data", "v1", repo_type="dataset")
    assert parse_dataset_file("hf://datasets/org/data@v1/sub/cal.jsonl") == (ds, "sub/cal.jsonl")
    assert parse_dataset_file("hf://datasets/org/data/cal.jsonl") == (HubRef("org/data", repo_type="dataset"),
                                                                      "cal.jsonl")
    assert ds.uri() == "hf://datasets/org/data@v1"
    assert parse_dataset_file("/data/cal.jsonl") is None
    with pytest.raises(HubError, match="a file of a dataset repository: hf://datasets/"):
        parse_dataset_file("hf://org/data/cal.jsonl")  # a model repository's spelling
    for bad in ("hf://datasets/org/data", "hf://datasets/org/data@/c", "hf://datasets/data/c.txt"[:-6],
                "hf://datasets/org/data/../c", "hf://datasets/org/data//c"):
        with pytest.raises(HubError, match="DatasetNotFound"):
            parse_dataset_file(bad)


def test_eval_and_llm_read_the_hub_model_as_the_local_folder(hub, tiny_model, tmp_path, monkeypatch):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    ppl = {}
    for name, model in (("hub", f"hf://{TINY}@v1"), ("local", str(tiny_model))):
        r = _kiln("eval", "perplexity", "--model", model, "--max-tokens", "64", "--json",
                  env=_env(hub, HF_HOME=str(tmp_path / "hf")))
        assert r.returncode == 0, r.stderr
        ppl[name] = json.loads(r.stdout)
    assert ppl["hub"]["perplexity"] == ppl["local"]["perplexity"]
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the cache eval filled: nothing downloaded again
    gets = hub.total_gets()
    params = SamplingParams(max_tokens=6, temperature=0)
    got = LLM(model=TINY, num_kv_blocks=32).generate(["Hello there"], params)[0].outputs[0].token_ids
    assert hub.total_gets() == gets
    want = LLM(model=str(tiny_model), num_kv_blocks=32).generate(["Hello there"], params)[0].outputs[0].token_ids
    assert list(got) == list(want)


def _hub_env(monkeypatch, hub: HubServer) -> None:
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)


def test_build_calibrates_on_a_hub_dataset_file(hub, tiny_model, tmp_path, monkeypatch):
    """``--calibration-data hf://datasets/ORG/NAME@REV/PATH``: the revision is resolved once, the
    one file is downloaded (into --download-dir, once), its records calibrate the engine, and
    the manifest and the engine hash name repo, commit and path."""
    from kiln.common.manifest import read_manifest
    from kiln.runtime.build_cli import main
    from kiln.runtime.quantization.calibration_data import sha256_of

    _hub_env(monkeypatch, hub)
    cache = tmp_path / "hf-cache"
    sha = hub.datasets[DATA].sha
    common = ["--model", str(tiny_model), "--quantization", "fp8", "--calibration-samples", "2",
              "--download-dir", str(cache), "--termination-log", ""]
    infos0 = hub.infos
    assert main([*common, "--calibration-data", f"hf://datasets/{DATA}@v2/data/cal.jsonl",
                 "--output", str(tmp_path / "a")]) == 0
    assert hub.infos - infos0 == 1  # dataset_info once: the revision is resolved once per build
    assert hub.gets[(f"datasets/{DATA}", "data/cal.jsonl")] == 1
    assert {k for k in hub.gets if k[0] == f"datasets/{DATA}"} == {(f"datasets/{DATA}", "data/cal.jsonl")}
    m = read_manifest(tmp_path / "a")
    cal = m["calibration"]
    assert cal["data"] == f"hf://datasets/{DATA}@{sha}/data/cal.jsonl"
    assert cal["data_sha256"] == sha256_of(hub.datasets[DATA].folder / "data" / "cal.jsonl")
    assert set(cal["samples_per_domain"]) == {"hubtext"}  # the dataset's records, not the shipped mixture
    assert m["build_spec"]["calibration_data"] == {"hf_dataset": {"repo": DATA, "revision": sha,
                                                                  "path": "data/cal.jsonl"}}
    # the default branch is the same commit: the same engine, nothing downloaded again
    assert main([*common, "--calibration-data", f"hf://datasets/{DATA}/data/cal.jsonl",
                 "--output", str(tmp_path / "a")]) == 0
    assert hub.gets[(f"datasets/{DATA}", "data/cal.jsonl")] == 1
    # another file of the dataset is another engine; --print-hash resolves without downloading
    hashes = set()
    for ref in (f"hf://datasets/{DATA}@{sha}/data/cal.jsonl", f"hf://datasets/{DATA}/data/other.jsonl"):
        r = subprocess.run([sys.executable, "-m", "kiln.runtime.build_cli", *common, "--calibration-data", ref,
                            "--output", str(tmp_path / "x"), "--print-hash"], env=_env(hub), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        hashes.add(r.stdout.strip())
    assert m["engine_hash"] in hashes and len(hashes) == 2
    assert (f"datasets/{DATA}", "data/other.jsonl") not in hub.gets and not (tmp_path / "x").exists()


def test_a_hub_calibration_file_with_other_bytes_than_its_checksum_is_refused(hub, tiny_model, tmp_path,
                                                                             monkeypatch):
    from kiln.runtime.build_cli import main

    _hub_env(monkeypatch, hub)
    term = tmp_path / "termination-log"
    term.write_text("")
    rc = main(["--model", str(tiny_model), "--quantization", "fp8", "--calibration-samples", "2",
               "--calibration-data", f"hf://datasets/{DATA}/data/cal.jsonl", "--calibration-checksum",
               "sha256:" + "0" * 64, "--download-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "e"),
               "--termination-log", str(term)])
    assert rc == 2 and "checksum mismatch" in term.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "termination-log"]


@pytest.mark.parametrize("data, env_extra, reason", [
    (f"hf://datasets/{DATA}x/data/cal.jsonl", {}, "DatasetNotFound"),  # unknown dataset
    (f"hf://datasets/{DATA}/data/missing.jsonl", {}, "DatasetNotFound"),  # a file the dataset does not hold
    (f"hf://datasets/{DATA}@no-such-tag/data/cal.jsonl", {}, "RevisionNotFound"),
    (f"hf://datasets/{GATED_DATA}/data/cal.jsonl", {}, "Unauthorized"),  # gated, no token
    (f"hf://datasets/{DATA}/data/cal.jsonl", {"HF_ENDPOINT": "closed"}, "DownloadFailed"),  # no network
    (f"hf://datasets/{DATA}", {}, "DatasetNotFound"),  # no file named
], ids=["unknown-dataset", "unknown-file", "bad-revision", "gated", "closed-port", "no-file"])
def test_calibration_dataset_errors_are_one_line_exit_2_and_write_nothing(hub, tiny_model, tmp_path, data,
                                                                         env_extra, reason):
    env_extra = dict(env_extra)
    if env_extra.get("HF_ENDPOINT") == "closed":
        env_extra["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    out, term = tmp_path / "engine", tmp_path / "termination-log"
    term.write_text("")
    r = _kiln("build", "--model", str(tiny_model), "--quantization", "fp8", "--calibration-samples", "2",
              "--calibration-data", data, "--output", str(out), "--download-dir", str(tmp_path / "cache"),
              "--termination-log", str(term), env=_env(hub, **env_extra))
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kiln build: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"kiln build: error: {reason}: "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no traceback, no client log lines
    assert term.read_text().startswith(f"kiln build: {reason}: ")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["termination-log"]
    if reason == "DatasetNotFound" and "missing" in data:
        assert "data/missing.jsonl" in errors[0]


@pytest.mark.parametrize("cmd", ["serve", "eval"])
@pytest.mark.parametrize("model, endpoint, reason", [
    (f"hf://{TINY}x", None, "ModelNotFound"),
    (f"hf://{TINY}@no-such-branch", None, "RevisionNotFound"),
    (f"hf://{TINY}", "closed", "DownloadFailed"),
], ids=["404-repo", "bad-revision", "closed-port"])
def test_serve_and_eval_hub_errors_are_one_line_exit_2(hub, tmp_path, cmd, model, endpoint, reason):
    env = _env(hub, HF_HOME=str(tmp_path / "hf"))
    if endpoint == "closed":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    args = (["serve", "--model", model, "--port", str(free_port()), "--download-dir", str(tmp_path / "cache")]
            if cmd == "serve" else ["eval", "perplexity", "--model", model, "--max-tokens", "16"])
    r = _kiln(*args, env=env)
    assert r.returncode == 2, r.stderr
    prefix = "kiln: error:" if cmd == "serve" else "kiln eval: error:"
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith(prefix)]
    assert len(errors) == 1 and errors[0].startswith(f"{prefix} {reason}: "), r.stderr
    assert TINY in errors[0] and "Traceback" not in r.stderr and r.stdout == ""
