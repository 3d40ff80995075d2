"""The synthetic tokenizer of the shape-only builtins: every id decodes, text round-trips, the
special tokens sit at the config's ids, it is the same on every build, and it is built once."""

from __future__ import annotations

import json
import random

import pytest

from kiln.runtime import loader
from kiln.runtime import synthetic_tokenizer as st


@pytest.fixture(scope="module")
def small():
    return st.build_tokenizer(1000, 997, [998, 3])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``builtin:llama-3.2-1b``'s tokenizer as ``kiln serve`` loads it (a fresh cache dir)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield loader.load_tokenizer(loader.resolve_source("builtin:llama-3.2-1b"))
    finally:
        mp.undo()


def test_every_id_is_a_token_and_decodes(small):
    toks = small.convert_ids_to_tokens(list(range(1000)))
    assert None not in toks and len(set(toks)) == 1000
    assert len(small) == 1000
    text = small.decode(list(range(1000)))
    assert len(text) > 1000


def test_special_tokens_at_the_config_ids(small):
    assert small.bos_token_id == 997 and small.eos_token_id == 998
    assert small.convert_ids_to_tokens([997, 998, 3]) == ["<|bos|>", "<|eos|>", "<|eos_1|>"]
    assert small("hi")["input_ids"][0] == 997  # BOS first, as Llama 3's tokenizer does
    assert small.decode([997, 3, 998], skip_special_tokens=True) == ""


@pytest.mark.parametrize("text", ["Hello world, this is 1999.", "  spaces\tand\nnewlines ",
                                  "Ünïcødé 日本語 😀", "<|eos|> as text"])
def test_text_round_trips(small, text):
    ids = small(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert all(0 <= i < 1000 for i in ids)
    assert small.decode(ids) == text


def test_random_ids_make_words(llama):
    rng = random.Random(0)
    ids = [rng.randrange(128000) for _ in range(200)]
    text = llama.decode(ids)
    words = text.split()
    assert len(words) > 50, text  # word-like pieces, many with a leading space
    assert sum(c.isascii() for c in text) > 0.95 * len(text), text


def test_llama_builtin_covers_its_vocabulary(llama):
    assert len(llama) == 128256
    toks = llama.convert_ids_to_tokens(list(range(128256)))
    assert None not in toks
    assert llama.bos_token_id == 128000 and llama.eos_token_id == 128001
    assert llama.convert_ids_to_tokens([128008, 128009]) == ["<|eos_1|>", "<|eos_2|>"]
    assert llama.chat_template
    ids = llama.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == 128000 and 128001 in ids


def test_deterministic():
    a = st.tokenizer_json(600, 300, [301])
    b = st.tokenizer_json(600, 300, [301])
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert len(a["model"]["merges"]) == 600 - 256 - 2


def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    tok = st.synthetic_tokenizer(700, 1, [2], tmp_path)
    folder = tmp_path / "tokenizers" / st.cache_name(700, 1, [2])
    assert (folder / "tokenizer.json").is_file()

    def no_build(*a, **k):
        raise AssertionError("built again")

    monkeypatch.setattr(st, "build_tokenizer", no_build)
    again = st.synthetic_tokenizer(700, 1, [2], tmp_path)
    ids = list(range(700))
    assert again.decode(ids) == tok.decode(ids)
    assert again.eos_token_id == 2 and again.bos_token_id == 1


@pytest.mark.parametrize("vocab,bos,eos,match", [(257, 1, [2], "at least 258"), (600, 600, [2], "outside")])
def test_bad_vocabularies(vocab, bos, eos, match):
    with pytest.raises(ValueError, match=match):
        st.tokenizer_json(vocab, bos, eos)


def test_own_shape_only_folder_has_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512}))
    assert loader.load_tokenizer(loader.resolve_source(str(tmp_path))) is None
