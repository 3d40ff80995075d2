"""Multi-LoRA serving against transformers + peft, on adapters made by peft itself.

A small random Llama (CPU, float32) carries three adapters (all seven target modules, rank
8; q/v only with rsLoRA at rank 4; MLP only at rank 16); Kiln's greedy outputs in one batch
mixing them with base requests must equal peft's, adapter by adapter.  Plus the registry's
errors, the LRU slots (more adapters than slots), and prefix-cache keying by adapter.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kiln.runtime.lora import LoRAError, LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (target modules, r, alpha, rsLoRA)
    "all8": (ALL, 8, 16, False),
    "qv4rs": (["q_proj", "v_proj"], 4, 8, True),
    "mlp16": (["gate_proj", "up_proj", "down_proj"], 16, 16, False),
}


def _config(folder) -> str:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """An LLM with LoRA on (3 slots), its transformers peer, and three peft adapters saved
    as PEFT folders: ``(llm, hf, {name: (folder, PeftModel)})``."""
    return _lora_setup(tmp_path_factory.mktemp("lora"))


def _lora_setup(root, **llm_kw):
    from peft import LoraConfig, get_peft_model

    from kiln.runtime import LLM
    from kiln.runtime.bench import build_hf_peer

    model_dir = root / "base"
    model_dir.mkdir()
    llm = LLM(model=_config(model_dir), load_format="dummy", num_kv_blocks=128, max_num_batched_tokens=64,
              enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=4, **llm_kw)
    g = torch.Generator().manual_seed(0)
    for name, p in llm.engine.runner.model.named_parameters():
        if "norm" not in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    hf = build_hf_peer(llm)
    adapters = {}
    for i, (name, (targets, r, alpha, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs, lora_dropout=0.0,
            init_lora_weights=False))  # random A and B: every adapter changes the outputs
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.data.mul_(3.0)
        peft_model.eval()
        folder = root / name
        peft_model.save_pretrained(str(folder))
        adapters[name] = (str(folder), peft_model)
    return llm, hf, adapters


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        inp = torch.tensor([prompt], device=model.device)
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_mixed_batch_equals_peft(lora_setup):
    _check_mixed_batch(*lora_setup)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton LoRA kernels in CUDA graphs need a GPU")
def test_mixed_batch_equals_peft_on_the_gpu_in_cuda_graphs(tmp_path):
    """On a GPU in float32: the batched Triton shrink/expand kernels, replayed inside the decode
    CUDA graphs, give peft's greedy tokens for a batch mixing adapters and base requests."""
    llm, hf, adapters = _lora_setup(tmp_path, dtype="float32")
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.graphs, "no decode graphs captured"
    _check_mixed_batch(llm, hf, adapters)


def _check_mixed_batch(llm, hf, adapters):
    from kiln.runtime import SamplingParams

    for name, (folder, _) in adapters.items():
        if name not in {a.name for a in llm.list_loras()}:
            llm.add_lora(name, folder)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in (5, 23, 40, 9, 17, 31, 12, 50)]
    names = [None, "all8", "qv4rs", "mlp16", "all8", None, "mlp16", "qv4rs"]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[LoRARequest(n) if n else None for n in names])
    got = {}
    for p, n, o in zip(prompts, names, outs):
        ref = _greedy(adapters[n][1] if n else hf, p, 8)
        assert o.outputs[0].token_ids == ref, f"adapter {n}: kiln {o.outputs[0].token_ids} vs peft {ref}"
        got.setdefault(tuple(p), {})[n] = ref
    # every adapter changes the output of the same prompt
    base = llm.generate(prompts[1], sp)[0].outputs[0].token_ids
    for n in ADAPTERS:
        with_adapter = llm.generate(prompts[1], sp, lora_request=LoRARequest(n))[0].outputs[0].token_ids
        assert with_adapter != base, f"adapter {n} left the output unchanged"


def test_more_adapters_than_slots_and_prefix_cache(lora_setup, tmp_path):
    """Two slots' worth of LRU traffic: 4 adapters through 3 slots; the same prompt under
    the base, then an adapter, never reuses the base's cached blocks for the adapter."""
    from kiln.runtime import SamplingParams

    llm, hf, adapters = lora_setup
    for name, (folder, _) in adapters.items():
        if name not in {a.name for a in llm.list_loras()}:
            llm.add_lora(name, folder)
    llm.add_lora("all8-again", adapters["all8"][0])
    try:
        prompt = list(range(3, 3 + 48))  # 3 full blocks of 16
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        base = llm.generate(prompt, sp)[0]
        order = ["all8", "qv4rs", "mlp16", "all8-again", "qv4rs", "all8"]
        outs = llm.generate([prompt] * len(order), sp, lora_request=[LoRARequest(n) for n in order])
        for n, o in zip(order, outs):
            ref = _greedy(adapters[n.replace("-again", "")][1], prompt, 6)
            assert o.outputs[0].token_ids == ref, n
        assert base.outputs[0].token_ids == _greedy(hf, prompt, 6)
        # the base's cached blocks (3 full blocks of this prompt) served no adapter request,
        # and "all8-again" (the same weights under another load) did not share "all8"'s
        seen = set()
        for n, o in zip(order, outs):
            if n not in seen:
                assert o.num_cached_tokens == 0, f"{n} reused blocks computed under another adapter or the base"
            seen.add(n)
        again = llm.generate(prompt, sp)[0]
        assert again.num_cached_tokens == 32, again.num_cached_tokens  # the base still hits its own blocks
    finally:
        llm.remove_lora("all8-again")


def test_bad_adapters_are_refused(lora_setup, tmp_path):
    from peft import LoraConfig, get_peft_model

    from kiln.runtime import SamplingParams

    llm, hf, adapters = lora_setup
    with pytest.raises(LoRAError, match="does not exist") as e:
        llm.add_lora("missing", str(tmp_path / "nope"))
    assert e.value.reason == "NotFound"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAError, match="adapter_model.safetensors"):
        llm.add_lora("empty", str(empty))
    big = get_peft_model(copy.deepcopy(hf), LoraConfig(r=32, target_modules=["q_proj"]))
    big.save_pretrained(str(tmp_path / "r32"))
    with pytest.raises(LoRAError, match="rank 32 is larger than --max-lora-rank 16") as e:
        llm.add_lora("r32", str(tmp_path / "r32"))
    assert e.value.reason == "RankTooLarge"
    other = copy.deepcopy(hf)
    other.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 32, bias=False)  # another base's shape
    wrong = get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"]))
    wrong.save_pretrained(str(tmp_path / "wrong"))
    with pytest.raises(LoRAError, match="another base model") as e:
        llm.add_lora("wrong", str(tmp_path / "wrong"))
    assert e.value.reason == "ShapeMismatch"
    with pytest.raises(LoRAError, match="does not exist"):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=2), lora_request=LoRARequest("nobody"))
    with pytest.raises(LoRAError, match="NotFound|no adapter"):
        llm.remove_lora("nobody")
    assert {a.name for a in llm.list_loras()} <= set(ADAPTERS)  # nothing half-registered
    assert llm.engine.scheduler.kv_cache_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_lora_config_validation(tmp_path):
    from kiln.runtime.config import EngineArgs

    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=128)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)


def _dequantized_peer(llm):
    """A transformers model holding the int4 base's dequantized weights (each linear read
    back as ``W.T = base(I)``), so peft's float LoRA sits on the very base Kiln serves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = llm.engine.model_config
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{
        k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}), dtype=torch.float32)
    sd = {n: p.detach() for n, p in llm.engine.runner.model.named_parameters()
          if "norm" in n or "embed" in n or "lm_head" in n}
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    with torch.inference_mode():
        for (i, name), (lin, method) in llm.engine.lora.methods.items():
            w = method.base.apply(lin, torch.eye(lin.in_features)).T.float()
            pre = f"model.layers.{i}." + ("self_attn." if name in ("qkv_proj", "o_proj") else "mlp.")
            if name == "qkv_proj":
                sd.update({pre + "q_proj.weight": w[:q], pre + "k_proj.weight": w[q:q + kv],
                           pre + "v_proj.weight": w[q + kv:]})
            elif name == "gate_up_proj":
                sd.update({pre + "gate_proj.weight": w[:inter], pre + "up_proj.weight": w[inter:]})
            else:
                sd[pre + name + ".weight"] = w
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


def _save_random_adapter(hf, targets: list[str], seed: int, folder):
    """A rank-8 peft adapter with random A and B (scaled up so it changes greedy outputs) on
    ``hf``'s ``targets``, saved to ``folder``; returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=32, target_modules=targets,
                                                      init_lora_weights=False, lora_dropout=0.0))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data.mul_(4.0)
    pm.eval().save_pretrained(str(folder))
    return pm


def test_int4_base_with_lora_equals_peft_on_dequantized_base(tmp_path):
    """LoRA on int4 linears (round-to-nearest groups of 128): Kiln's greedy outputs equal
    peft's on a float model holding the dequantized base (the delta adds to the int4 output)."""
    from kiln.runtime import LLM, SamplingParams

    d = tmp_path / "base"
    d.mkdir()
    cfg = json.loads(open(_config(d) + "/config.json").read())
    cfg.update(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(d), load_format="dummy", quantization="int4-awq", num_kv_blocks=64,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert type(llm.engine.lora.methods[(0, "qkv_proj")][1].base).__name__ == "Int4LinearMethod"
    hf = _dequantized_peer(llm)
    pm = _save_random_adapter(hf, ["q_proj", "v_proj", "gate_proj", "down_proj"], seed=3, folder=tmp_path / "ad")
    llm.add_lora("ad", str(tmp_path / "ad"))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 30, 19, 44)]
    names = ["ad", None, "ad", None]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[LoRARequest(n) if n else None for n in names])
    changed = 0
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == _greedy(pm if n else hf, p, 8), n
        if n:
            changed += o.outputs[0].token_ids != _greedy(hf, p, 8)
    assert changed, "the adapter changed no output"


def _round_inputs_to_fp8(hf) -> None:
    """Make each decoder projection of ``hf`` see its input as W8A8 FP8 does: every token's
    row rounded to E4M3 with the scale ``max|x[t, :]| / 448`` (torch's float8_e4m3fn cast).  A
    forward pre-hook on the projection itself: peft's LoRA wraps it as ``base_layer``, so the
    adapter's A still reads the unrounded input."""

    def hook(_module, args):
        (x,) = args
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
        return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype),

    for name, mod in hf.named_modules():
        if name.split(".")[-1] in ALL:
            mod.register_forward_pre_hook(hook)


def test_fp8_base_with_lora_equals_peft_on_dequantized_base(tmp_path):
    """LoRA on FP8 W8A8 linears (E4M3 weights with per-channel scales, rounded to nearest;
    per-token E4M3 activations): Kiln's greedy outputs in a batch mixing the adapter and the
    base equal peft's on a float model holding the dequantized base whose projections round
    their input per token to E4M3 as Kiln's do (the delta adds to the FP8 output)."""

    from kiln.runtime import LLM, SamplingParams

    d = tmp_path / "base"
    d.mkdir()
    cfg = json.loads(open(_config(d) + "/config.json").read())
    cfg.update(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(d), load_format="dummy", quantization="fp8", num_kv_blocks=64,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    lin, method = llm.engine.lora.methods[(0, "qkv_proj")]
    assert type(method.base).__name__ == "Fp8LinearMethod" and lin.weight.dtype == torch.float8_e4m3fn
    hf = _dequantized_peer(llm)
    _round_inputs_to_fp8(hf)
    pm = _save_random_adapter(hf, ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], seed=4, folder=tmp_path / "ad")
    llm.add_lora("ad", str(tmp_path / "ad"))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 33, 17, 41)]
    names = [None, "ad", "ad", None]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=[LoRARequest(n) if n else None for n in names])
    changed = 0
    for p, n, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == _greedy(pm if n else hf, p, 8), n
        if n:
            changed += o.outputs[0].token_ids != _greedy(hf, p, 8)
    assert changed, "the adapter changed no output"


def test_serve_flags_reach_engine_args():
    from kiln.runtime.cli import build_parser, engine_args_from, parse_lora_modules

    ns = build_parser().parse_args(["serve", "--lora-modules", "a=/x/a", "b=/y/b", "--max-loras", "3",
                                    "--max-lora-rank", "32", "--max-cpu-loras", "5"])
    args = engine_args_from(ns)
    assert args.lora_modules == {"a": "/x/a", "b": "/y/b"} and args.lora_enabled
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (3, 32, 5)
    assert not engine_args_from(build_parser().parse_args(["serve"])).lora_enabled
    for bad, msg in ((["noequals"], "NAME=FOLDER"), (["a=/x", "a=/y"], "twice"), (["=/x"], "NAME=FOLDER")):
        with pytest.raises(ValueError, match=msg):
            parse_lora_modules(bad)


def test_adapter_named_like_the_base_is_refused(lora_setup, tmp_path):
    from kiln.runtime import LLM

    _, _, adapters = lora_setup
    folder, _ = next(iter(adapters.values()))
    model_dir = tmp_path / "base"
    model_dir.mkdir()
    with pytest.raises(ValueError, match="base model's name"):
        LLM(model=_config(model_dir), load_format="dummy", num_kv_blocks=16, served_model_name="m",
            lora_modules={"m": folder}, max_lora_rank=16)
