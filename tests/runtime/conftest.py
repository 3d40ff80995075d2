"""Fixtures for the runtime's model tests: the embedded default model, loaded once, and
transformers' greedy reference outputs on the same GGUF."""

from __future__ import annotations

import pytest

from prompts import CHATS, MAX_NEW_TOKENS, RAW_PROMPTS




@pytest.fixture(scope="session")
def smollm_source():
    from kiln.runtime import loader

    return loader.materialize_gguf(loader.resolve_source(None))


@pytest.fixture(scope="session")
def tokenizer(smollm_source):
    from kiln.runtime import loader

    return loader.load_tokenizer(smollm_source)


@pytest.fixture(scope="session")
def prompt_token_ids(tokenizer) -> list[list[int]]:
    """16 prompts as token ids: 10 raw, 6 chat-templated."""
    ids = [list(tokenizer.encode(p)) for p in RAW_PROMPTS]
    for chat in CHATS:
        t = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if hasattr(t, "keys"):
            t = t["input_ids"]
        ids.append(list(t))
    return ids


@pytest.fixture(scope="session")
def hf_greedy(smollm_source, prompt_token_ids) -> list[list[int]]:
    """transformers' greedy continuations (float32, from the GGUF itself), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.runtime import loader

    gguf = loader.resolve_source(None)
    model = AutoModelForCausalLM.from_pretrained(gguf.gguf_dir, gguf_file=gguf.gguf_name, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_token_ids:
            inp = torch.tensor([ids])
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=2)
            outs.append(gen[0, len(ids):].tolist())
    return outs
