"""The embedded SmolLM2 with two adapters that peft trained a few steps on different texts
(CPU): Kiln's greedy outputs in one batch mixing both adapters and the base equal
transformers + peft's, adapter by adapter."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.lora import LoRARequest

TEXTS = {
    "pirate": "Arr matey, the sea be wide and the rum be sweet. Arr, hoist the sails, ye scallywags! " * 2,
    "french": "Bonjour, je suis un assistant et je parle toujours en français avec plaisir. " * 2,
}


@pytest.fixture(scope="module")
def trained_adapters(smollm_source, tmp_path_factory):
    """``(hf base, {name: (folder, PeftModel)})``: rank 8 on q/v, 3 AdamW steps each."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln.runtime import loader

    gguf = loader.resolve_source(None)
    tok = loader.load_tokenizer(smollm_source)
    hf = AutoModelForCausalLM.from_pretrained(gguf.gguf_dir, gguf_file=gguf.gguf_name, dtype=torch.float32)
    root = tmp_path_factory.mktemp("smollm-lora")
    for i, (name, text) in enumerate(TEXTS.items()):
        torch.manual_seed(i)
        pm = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           lora_dropout=0.0))
        ids = torch.tensor([tok.encode(text)])
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=3e-3)
        pm.train()
        for _ in range(3):
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        pm.save_pretrained(str(root / name))
        hf = pm.unload()  # the base back, without LoRA layers
    hf.eval()
    return hf, {name: (str(root / name), None) for name in TEXTS}


def _greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        inp = torch.tensor([ids])
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_trained_adapters_mixed_batch_equal_peft(trained_adapters, prompt_token_ids):
    from kiln.runtime import LLM, SamplingParams

    hf, models = trained_adapters
    refs = {}
    prompts = prompt_token_ids[:2] + prompt_token_ids[-1:]
    for name, (folder, _) in models.items():
        pm = _peft_for(hf, folder, name)
        refs[name] = [_greedy(pm, p, 8) for p in prompts]
        pm.unload()
    base_refs = [_greedy(hf, p, 8) for p in prompts]
    for name in TEXTS:
        assert refs[name] != base_refs, f"adapter {name} changed no output"
    llm = LLM(lora_modules={n: f for n, (f, _) in models.items()}, max_loras=2, max_lora_rank=8,
              num_kv_blocks=256)
    assert {a.name for a in llm.list_loras()} == set(TEXTS)
    names = [None, "pirate", "french"]
    batch = [(p, names[(i + j) % 3]) for i, p in enumerate(prompts) for j in range(3)]
    outs = llm.generate([p for p, _ in batch], SamplingParams(temperature=0.0, max_tokens=8),
                        lora_request=[LoRARequest(n) if n else None for _, n in batch])
    for (p, n), o in zip(batch, outs):
        ref = (refs[n] if n else base_refs)[prompts.index(p)]
        got = o.outputs[0].token_ids
        assert got[: len(ref)] == ref, f"adapter {n}: kiln {got} vs peft {ref}"


def _peft_for(hf, folder: str, name: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf, folder, adapter_name=name).eval()
