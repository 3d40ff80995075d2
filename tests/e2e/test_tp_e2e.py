"""Tensor parallelism on the test plane: an InferenceEngine with ``runtime.tensorParallelSize: 2``
and ``resources.gpus: 0`` (gloo on the CPU of the process-backed node) reaches Ready, its pod
runs two ranks, and it answers with the greedy tokens a single-rank engine gives.

The model is a tiny random Llama (4 heads, 2 KV heads: SmolLM2's 9 and 3 split only over 3 or
9 ranks) with Kiln's synthetic tokenizer, served to the build Job by the loopback Hub server
(``kiln.devcluster.hubserver``), as the Hub e2e test serves SmolLM2; building it without
quantizing takes seconds."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest
import torch
import yaml
from safetensors.torch import save_file

from kiln.devcluster.hubserver import HubServer

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO, SHA = "kiln-test/tiny-llama-tp", "7" * 40
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
PROMPT = "The capital of France is"


def _tiny_llama(folder) -> None:
    from kiln.runtime.model.config import ModelConfig
    from kiln.runtime.model.llama import LlamaForCausalLM, to_hf_state_dict
    from kiln.runtime.synthetic_tokenizer import synthetic_tokenizer

    folder.mkdir()
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(CONFIG))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data = torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.08
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model).items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    synthetic_tokenizer(CONFIG["vocab_size"], 1, [2], folder.parent / "tok-cache").save_pretrained(str(folder))


def _serve_pids(engine_hash: str) -> list[psutil.Process]:
    """The node's ``kiln serve`` processes of this engine."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "serve" in cmd and f"/{engine_hash}" in cmd and "--tensor-parallel-size 2" in cmd:
            out.append(p)
    return out


def test_tensor_parallel_engine_on_cpu_serves(stack, ns, tmp_path):
    from kiln.runtime import LLM, SamplingParams

    _tiny_llama(tmp_path / "tiny")
    name = "tiny-tp"
    ie = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceEngine", "metadata": {"name": name},
          "spec": {"model": {"huggingFace": {"repo": REPO, "revision": SHA}, "servedModelName": "tiny"},
                   "build": {"quantization": "none", "maxSeqLen": 512},
                   "runtime": {"tensorParallelSize": 2, "maxNumSeqs": 4},
                   "resources": {"gpus": 0}, "replicas": 1}}
    with HubServer() as hub:
        hub.add(REPO, tmp_path / "tiny", sha=SHA)
        ie["spec"]["model"]["huggingFace"]["endpoint"] = hub.url
        stack.apply_obj(ie, ns)
        stack.wait_ready(name, ns)
    h = stack.engine(name, ns)["status"]["engineHash"]
    # the pod's kiln serve runs rank 0 in its engine core and rank 1 as that core's child
    serve = _serve_pids(h)
    assert serve, "no kiln serve --tensor-parallel-size 2 process of the engine"
    family = [c for s in serve for c in s.children(recursive=True)]
    ranks = [p for p in family if "spawn_main" in " ".join(p.cmdline()) and p.ppid() != serve[0].pid]
    assert len(ranks) == 1, [p.cmdline() for p in family]

    proxy = stack.proxy(name, ns)
    proxy.wait_endpoints(1, progress=lambda: stack.progress(ns))
    r = httpx.post(f"{proxy.url}/v1/completions", timeout=120, headers={"Connection": "close"},
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]
    assert answer["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 16

    # the same engine folder (on the claim) at one rank gives the same greedy text
    dirs = list((stack.state_dir.parent / "volumes").glob(f"{ns}_kiln-engine-cache_*/{h}"))
    assert dirs, "no engine folder on the claim"
    assert yaml.safe_load((dirs[0] / "manifest.json").read_text())["source"]["ref"] == f"hf://{REPO}@{SHA}"
    llm = LLM(engine=str(dirs[0]), device="cpu", cpu_threads=1)
    try:
        ref = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.engine.runner.close()
    assert answer["text"] == ref.outputs[0].text
