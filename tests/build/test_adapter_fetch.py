"""``kiln adapter fetch`` (the operator's adapter Job) through the real ``kiln`` parser: a
folder or a Hub repository (a local mirror) is checked against an engine and written
atomically; what the server would refuse fails here with its reason, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from kiln.devcluster.hubserver import HubServer
from kiln.devcluster.lora_adapters import write_random_adapter
from kiln.runtime.cli import main

from conftest import TINY_CONFIG


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, tiny_model):
    from kiln.common.enginespec import BuildSpec
    from kiln.runtime.build import build_engine

    root = tmp_path_factory.mktemp("engine")
    return build_engine(BuildSpec.from_cli(str(tiny_model)), str(tiny_model), root / "e", device="cpu").path


def _fetch(*args: str) -> int:
    return main(["adapter", "fetch", *args])


def test_fetch_folder_checked_against_the_engine(tiny_engine, tmp_path, capsys):
    src = write_random_adapter(tmp_path / "src", TINY_CONFIG, rank=8)
    out = tmp_path / "claim" / ".adapters" / "k1"
    assert _fetch("--source", str(src), "--output", str(out), "--engine", str(tiny_engine)) == 0
    assert sorted(p.name for p in out.iterdir()) == [".kiln-source", "adapter_config.json", "adapter_model.safetensors"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert _fetch("--source", str(src), "--output", str(out), "--engine", str(tiny_engine)) == 0
    assert "already there" in capsys.readouterr().err
    # a folder fetched from another source is not taken for this one
    assert _fetch("--source", str(tmp_path / "other"), "--output", str(out), "--engine", str(tiny_engine)) == 2
    err = capsys.readouterr().err
    assert f"OutputInUse: {out} holds the adapter of {src}" in err and len(err.splitlines()) == 1, err


def test_builtin_rank_above_the_limit_names_the_source_and_the_flag(tiny_engine, tmp_path, capsys):
    out = tmp_path / "a"
    assert _fetch("--source", "builtin:random?rank=32", "--output", str(out), "--engine", str(tiny_engine)) == 2
    err = capsys.readouterr().err
    assert "RankTooLarge: builtin:random?rank=32:" in err and "raise --max-lora-rank to 32" in err, err
    assert "kiln-adapter-" not in err and not out.exists()


@pytest.mark.parametrize("case, reason", [("missing", "NotFound"), ("file", "InvalidAdapter"),
                                          ("rank", "RankTooLarge"), ("shape", "ShapeMismatch")])
def test_refused_adapters_write_nothing(tiny_engine, tmp_path, capsys, case, reason):
    src = tmp_path / "src"
    if case == "file":
        src.write_text("not a folder")
    elif case == "rank":
        write_random_adapter(src, TINY_CONFIG, rank=32)
    elif case == "shape":
        write_random_adapter(src, {**TINY_CONFIG, "hidden_size": 96}, rank=4)  # another base's shapes
    log = tmp_path / "termination-log"
    log.write_text("")
    out = tmp_path / "out"
    assert _fetch("--source", str(src), "--output", str(out), "--engine", str(tiny_engine),
                  "--termination-log", str(log)) == 2
    err = capsys.readouterr().err
    assert f"kiln adapter: error: {reason}:" in err
    assert log.read_text().startswith(f"kiln adapter: error: {reason}:")
    assert not out.exists()
    if case == "file":
        assert "must be a PEFT adapter folder" in err
    if case == "rank":
        assert "larger than --max-lora-rank 16" in err


def test_fetch_from_the_hub(tiny_engine, tmp_path, monkeypatch):
    src = write_random_adapter(tmp_path / "src", TINY_CONFIG, rank=4, targets=["q_proj", "v_proj"])
    (src / "README.md").write_text("not fetched")
    with HubServer() as hub:
        hub.add("org/tiny-lora", src, sha="a" * 40, token="hf_secret")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        out = tmp_path / "out"
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        assert _fetch("--source", "hf://org/tiny-lora", "--output", str(out), "--engine", str(tiny_engine),
                      "--download-dir", str(tmp_path / "cache")) == 2
        assert not out.exists()
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert _fetch("--source", "hf://org/tiny-lora@main", "--output", str(out), "--engine", str(tiny_engine),
                      "--download-dir", str(tmp_path / "cache")) == 0
        assert sorted(p.name for p in out.iterdir()) == [".kiln-source", "adapter_config.json", "adapter_model.safetensors"]
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_CONFIG))
        hub.add("org/a-model", model, sha="b" * 40)
        assert _fetch("--source", "hf://org/a-model", "--output", str(tmp_path / "o2")) == 2  # a model, no adapter


BUILTIN = "builtin:random?rank=8&seed=3&targets=v_proj,q_proj,down_proj"


def test_builtin_adapter_is_written_for_the_engine_and_served_as_peft_serves_it(tiny_engine, tiny_model, tmp_path):
    """``builtin:random`` writes a PEFT folder shaped for the engine: the same parameters give
    the same bytes (also through ``--model``, the same shapes), another seed other bytes; the
    real ``peft`` loads it, and Kiln's greedy outputs with it equal peft's (and differ from
    the base's)."""
    import torch
    from peft import PeftModel

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.bench import build_hf_peer
    from kiln.runtime.lora import LoRARequest

    out = tmp_path / "a"
    assert _fetch("--source", BUILTIN, "--output", str(out), "--engine", str(tiny_engine)) == 0
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"]) == ("LORA", 8, 8)
    assert conf["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    same = tmp_path / "same"
    assert _fetch("--source", "builtin:random?targets=q_proj,v_proj,down_proj&seed=3&rank=8&alpha=8",
                  "--output", str(same), "--model", str(tiny_model)) == 0
    weights = (out / "adapter_model.safetensors").read_bytes()
    assert (same / "adapter_model.safetensors").read_bytes() == weights
    other = tmp_path / "other"
    assert _fetch("--source", BUILTIN.replace("seed=3", "seed=4"), "--output", str(other),
                  "--engine", str(tiny_engine)) == 0
    assert (other / "adapter_model.safetensors").read_bytes() != weights

    llm = LLM(engine=str(tiny_engine), num_kv_blocks=64, max_num_batched_tokens=64, enable_lora=True,
              max_loras=1, max_lora_rank=8, lora_modules={"b": str(out)})
    peer = build_hf_peer(llm)
    base_out = {}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (6, 21)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, sp)):
        base_out[tuple(p)] = o.outputs[0].token_ids
    pm = PeftModel.from_pretrained(peer, str(out)).eval()
    for p, o in zip(prompts, llm.generate(prompts, sp, lora_request=[LoRARequest("b")] * len(prompts))):
        with torch.inference_mode():
            inp = torch.tensor([p])
            ref = pm.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
        assert ref != base_out[tuple(p)], "the builtin adapter changed nothing"


@pytest.mark.parametrize("source, base, reason, text", [
    ("builtin:nope", "engine", "InvalidSource", "unknown builtin adapter 'nope' (available: random)"),
    ("builtin:random?rank=0", "engine", "InvalidSource", "rank: expected an integer in 1..64, got 0"),
    ("builtin:random?rank=65", "engine", "InvalidSource", "rank: expected an integer in 1..64, got 65"),
    ("builtin:random?rank=sixteen", "engine", "InvalidSource", "rank: expected an integer in 1..64"),
    ("builtin:random?alpha=0", "engine", "InvalidSource", "alpha: expected a positive number, got 0"),
    ("builtin:random?targets=q_proj,lm_head", "engine", "InvalidSource", "'lm_head' is not a target module"),
    ("builtin:random?size=3", "engine", "InvalidSource", "unknown parameter 'size'"),
    ("builtin:random?rank", "engine", "InvalidSource", "'rank' is not KEY=VALUE"),
    ("builtin:random?seed=1&seed=2", "engine", "InvalidSource", "seed is given twice"),
    ("builtin:random", None, "InvalidSource", "give --engine or --model"),
    ("builtin:random?rank=32", "engine", "RankTooLarge", "rank 32 is larger than --max-lora-rank 16"),
    ("builtin:random", "model", "InvalidModel", "does not exist"),
])
def test_bad_builtin_adapters_fail_in_one_line(tiny_engine, tmp_path, capsys, source, base, reason, text):
    out = tmp_path / "out"
    args = ["--source", source, "--output", str(out)]
    if base == "engine":
        args += ["--engine", str(tiny_engine)]
    elif base == "model":
        args += ["--model", str(tmp_path / "no-model")]
    assert _fetch(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kiln adapter: error: {reason}:") and err.count("\n") == 1, err
    assert text in err, err
    assert not out.exists()


def test_the_operators_builtin_fetch_job_runs_as_written(tiny_engine, tiny_model, tmp_path):
    """The fetch Job the operator writes for a builtin adapter, its arguments run by the real
    ``kiln`` (engine and claim paths moved under tmp_path): the folder lands at the key's path
    and loads against the engine; a second run keeps it."""
    from kiln.operator.adapters import fetch_args
    from kiln.operator.spec import parse_spec
    from kiln.runtime.lora.peft_format import load_peft_adapter
    from kiln.runtime.engine_folder import open_engine

    spec = parse_spec({"model": {"path": str(tiny_model)}, "resources": {"gpus": 0},
                       "adapters": [{"name": "demo", "builtin": {"name": "random", "rank": 4, "seed": 7,
                                                                 "targets": ["o_proj", "up_proj"]}}]})
    a = spec.adapters[0]
    args = fetch_args(a, spec.engine_hash, spec.runtime.lora.max_lora_rank)
    moved = [x.replace(f"/engines/{spec.engine_hash}", str(tiny_engine)).replace("/engines", str(tmp_path / "claim"))
             .replace("/dev/termination-log", str(tmp_path / "log")) for x in args]
    assert main(moved) == 0
    folder = tmp_path / "claim" / ".adapters" / a.key
    w = load_peft_adapter(folder, open_engine(str(tiny_engine), verify=False).model_config, 16)
    assert (w.rank, w.target_modules) == (4, ["o_proj", "up_proj"])
    assert main(moved) == 0  # already there: kept
