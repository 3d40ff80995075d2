"""LoRA over HTTP against a real ``kiln serve`` (a small random Llama, token-id prompts,
adapters made by peft): ``model`` selects an adapter, ``/v1/models`` lists them with
``parent``, load/unload behind the API key with clear 400/404s, and loading and unloading
while 32 streams run fails no request."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kiln_server import start_server, stop_server

KEY = "lora-test-key"
H = {"Authorization": f"Bearer {KEY}"}


def _peft_adapter(model_dir, out, r: int, targets: list[str], seed: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    pm = get_peft_model(hf, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data.mul_(20.0)  # the dummy base's weights are small (std 0.02): a visible delta
    pm.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = root / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    from kiln.runtime.synthetic_tokenizer import build_tokenizer

    build_tokenizer(512, 1, [2]).save_pretrained(str(base))  # a real tokenizer for the random model
    other = root / "other-base"  # another base: a wider MLP
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()),
                                                   "intermediate_size": 192}))
    ads = {"a1": _peft_adapter(base, root / "a1", 8, ["q_proj", "v_proj", "down_proj"], 1),
           "a2": _peft_adapter(base, root / "a2", 4, ["o_proj", "gate_proj", "up_proj"], 2),
           "big": _peft_adapter(base, root / "big", 32, ["q_proj"], 3),
           "other": _peft_adapter(other, root / "other", 8, ["q_proj", "down_proj"], 4)}
    s = start_server("--model", str(base), "--load-format", "dummy", "--served-model-name", "base",
                     "--lora-modules", f"a1={ads['a1']}", "--max-loras", "2", "--max-lora-rank", "16",
                     "--num-kv-blocks", "512", api_key=KEY)
    yield s, ads
    stop_server(s)


def _complete(s, model: str, prompt: list[int], n: int = 8) -> httpx.Response:
    return httpx.post(f"{s.v1}/completions", headers=H, timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})


def _tokens(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_models_select_load_unload_and_errors(lora_server):
    s, ads = lora_server
    models = httpx.get(f"{s.v1}/models", headers=H, timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("a1", "base")]
    prompt = list(range(10, 40))
    base, a1 = _tokens(_complete(s, "base", prompt)), _tokens(_complete(s, "a1", prompt))
    assert base != a1, "the adapter changed nothing"
    # unknown model: 404 model_not_found; the server keeps serving
    r = _complete(s, "a2", prompt)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    # the load endpoint is behind the API key
    r = httpx.post(f"{s.v1}/load_lora_adapter", json={"lora_name": "a2", "lora_path": ads["a2"]}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{s.v1}/load_lora_adapter", headers=H, json={"lora_name": "a2", "lora_path": ads["a2"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    a2 = _tokens(_complete(s, "a2", prompt))
    assert a2 != base and a2 != a1
    # bad loads: 400 with the reason, nothing registered
    for body, code, text in (
            ({"lora_name": "big", "lora_path": ads["big"]}, "RankTooLarge", "rank 32 is larger than --max-lora-rank"),
            ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, "NotFound", "does not exist"),
            ({"lora_name": "a1", "lora_path": ads["a2"]}, "AlreadyExists", "already loaded"),
            ({"lora_name": "base", "lora_path": ads["a2"]}, None, "base model's name")):
        r = httpx.post(f"{s.v1}/load_lora_adapter", headers=H, json=body, timeout=60)
        assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == code
    r = httpx.post(f"{s.v1}/load_lora_adapter", headers=H, json={"lora_name": "x"}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{s.v1}/unload_lora_adapter", headers=H, json={"lora_name": "nobody"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert {m["id"] for m in httpx.get(f"{s.v1}/models", headers=H).json()["data"]} == {"base", "a1", "a2"}
    r = httpx.post(f"{s.v1}/unload_lora_adapter", headers=H, json={"lora_name": "a2"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(s, "a2", prompt).status_code == 404
    assert _tokens(_complete(s, "a1", prompt)) == a1 and _tokens(_complete(s, "base", prompt)) == base


def test_adapter_of_another_base_is_refused_and_serving_goes_on(lora_server):
    """An adapter peft made for a base with a wider MLP: the load is a 400 ``ShapeMismatch``
    naming the tensor and both shapes, nothing is registered, and the base and the loaded
    adapters answer as before."""
    s, ads = lora_server
    prompt = list(range(50, 70))
    before = {m: _tokens(_complete(s, m, prompt)) for m in ("base", "a1")}
    r = httpx.post(f"{s.v1}/load_lora_adapter", headers=H, json={"lora_name": "other", "lora_path": ads["other"]},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "ShapeMismatch", err
    assert "down_proj.lora_A.weight has shape (8, 192), the base model needs (8, 128)" in err["message"], err
    assert "trained for another base model" in err["message"]
    assert "other" not in {m["id"] for m in httpx.get(f"{s.v1}/models", headers=H, timeout=10).json()["data"]}
    assert _complete(s, "other", prompt).status_code == 404
    assert {m: _tokens(_complete(s, m, prompt)) for m in ("base", "a1")} == before
    assert httpx.get(f"{s.base}/ready", timeout=10).status_code == 200


def test_load_unload_while_32_streams_run(lora_server):
    s, ads = lora_server

    admitted: list[int] = []
    all_admitted = asyncio.Event()

    async def stream(client, i: int, model: str) -> int:
        body = {"model": model, "prompt": list(range(5 + i, 45 + i)), "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        n = 0
        async with client.stream("POST", f"{s.v1}/completions", headers=H, json=body) as r:
            assert r.status_code == 200, await r.aread()
            admitted.append(i)  # its adapter resolved: the request holds it from here on
            if len(admitted) == 32:
                all_admitted.set()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, line
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
        return n  # tokens generated, from the final usage chunk

    async def churn(client):
        for k in range(4):
            name = f"hot{k}"
            r = await client.post(f"{s.v1}/load_lora_adapter", headers=H,
                                  json={"lora_name": name, "lora_path": ads["a2" if k % 2 else "a1"]})
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.2)
            r = await client.post(f"{s.v1}/unload_lora_adapter", headers=H, json={"lora_name": name})
            assert r.status_code == 200, r.text

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            # streams on the base, on a1, and on an adapter unloaded while they run
            r = await client.post(f"{s.v1}/load_lora_adapter", headers=H,
                                  json={"lora_name": "leaving", "lora_path": ads["a2"]})
            assert r.status_code == 200, r.text
            models = ["base", "a1", "leaving", "base"]
            tasks = [asyncio.create_task(stream(client, i, models[i % 4])) for i in range(32)]
            # unload once every stream is admitted (a loaded machine may take seconds to send
            # all 32 requests); a stream that fails before that fails the test here
            pending = {asyncio.create_task(all_admitted.wait()), *tasks}
            while not all_admitted.is_set():
                done, pending = await asyncio.wait(pending, timeout=120, return_when=asyncio.FIRST_COMPLETED)
                assert done, f"only {len(admitted)} of 32 streams admitted in 120 s"
                for t in done:
                    t.result()
            r = await client.post(f"{s.v1}/unload_lora_adapter", headers=H, json={"lora_name": "leaving"})
            assert r.status_code == 200, r.text
            await churn(client)
            return await asyncio.gather(*tasks)

    counts = asyncio.run(main())
    assert all(c == 48 for c in counts), counts
    assert {m["id"] for m in httpx.get(f"{s.v1}/models", headers=H).json()["data"]} == {"base", "a1"}


def test_the_operators_pod_client_on_a_real_server(lora_server):
    """``kiln.operator.podapi`` (what the operator calls pods with) against the real server:
    what it serves, a load and an unload with the API key, the reasons of refusals."""
    from kiln.operator.adapters import LoRAOp
    from kiln.operator.podapi import PodLoRAClient, PodUnreachable

    s, ads = lora_server
    host, port = s.base.rsplit("//", 1)[1].rsplit(":", 1)
    client = PodLoRAClient(port=int(port))
    assert client.adapters(host, KEY) == {"a1": ads["a1"]}
    with pytest.raises(PodUnreachable, match="401"):
        client.adapters(host, None)  # no key: not an empty list
    ok = client.call(LoRAOp("p", host, "load", "op-a2", ads["a2"]), KEY)
    assert (ok.status, ok.reason) == (200, "")
    assert set(client.adapters(host, KEY)) == {"a1", "op-a2"}
    big = client.call(LoRAOp("p", host, "load", "op-big", ads["big"]), KEY)
    assert (big.status, big.reason) == (400, "RankTooLarge") and "--max-lora-rank 16" in big.message
    gone = client.call(LoRAOp("p", host, "unload", "nobody"), KEY)
    assert gone.status == 404
    assert client.call(LoRAOp("p", host, "unload", "op-a2"), KEY).status == 200
    assert client.adapters(host, KEY) == {"a1": ads["a1"]}
    down = PodLoRAClient(port=1, timeout=2).call(LoRAOp("p", host, "load", "x", "y"), KEY)
    assert (down.status, down.reason) == (0, "PodUnreachable")
