"""Tensor parallelism on the CPU (gloo): TP = 2 and 4 give the greedy tokens of TP = 1 on the
parity prompts (bytes as token ids) of a small random Llama in float32, with chunked prefill,
prefix caching and preemption happening; a bad size is refused before any worker starts."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.model.config import ModelConfig
from kiln.runtime.model.llama import LlamaForCausalLM, to_hf_state_dict

from prompts import MAX_NEW_TOKENS, RAW_PROMPTS

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "eos_token_id": 258, "bos_token_id": 257}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp")
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(CONFIG))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        p.data = torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.08
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


def _prompts():
    return [list(p.encode())[:200] for p in RAW_PROMPTS] + [list(RAW_PROMPTS[7].encode())[:200]]


def _run(model: str, tp: int):
    llm = LLM(model=model, tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=24, block_size=16,
              max_num_batched_tokens=32, max_model_len=384, cpu_threads=1)
    try:
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True))
        sched = llm.engine.scheduler
        stats = (sched.num_preemptions_total, sched.kv_cache_manager.prefix_cache_hits)
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.engine.runner.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1(tiny_model, tp):
    ref, ref_stats = _run(tiny_model, 1)
    got, stats = _run(tiny_model, tp)
    assert ref_stats[0] > 0 and ref_stats[1] > 0  # preemption and prefix-cache hits happened
    assert stats[0] > 0
    assert got == ref


def test_tp_size_that_does_not_split_heads(tiny_model):
    with pytest.raises(ValueError, match="does not split"):
        LLM(model=tiny_model, tensor_parallel_size=3, device="cpu", dtype="float32")


def test_tp_float_engine_sharded_at_load(tiny_model, tmp_path):
    """A ``kiln build`` engine (full tensors, fused QKV and gate-up) sharded at load serves the
    same greedy tokens at TP = 2 as at TP = 1."""
    from kiln.runtime.build_cli import main as build_main
    from kiln.runtime.synthetic_tokenizer import synthetic_tokenizer

    synthetic_tokenizer(259, 257, [258], tmp_path / "tok").save_pretrained(tiny_model)
    out = tmp_path / "engine"
    assert build_main(["--model", tiny_model, "--output", str(out), "--device", "cpu"]) == 0
    res = {}
    for tp in (1, 2):
        llm = LLM(engine=str(out), tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=24,
                  max_num_batched_tokens=32, max_model_len=384, cpu_threads=1)
        try:
            outs = llm.generate(_prompts(), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            res[tp] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.runner.close()
    assert res[2] == res[1]


def test_killed_rank_takes_the_server_down(tiny_model):
    """``kiln serve --tensor-parallel-size 2``: SIGKILL rank 1, the server exits non-zero with
    one error naming the rank, and no process of it is left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import psutil

    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "serve", "--model", tiny_model, "--device",
                             "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--tensor-parallel-size", "2",
                             "--cpu-threads", "1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        # rank 1: the engine core's spawned child (not multiprocessing's resource tracker)
        ranks = [p for p in family if p.ppid() != proc.pid and "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in family]
        os.kill(ranks[0].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "tensor-parallel rank 1" in err
        time.sleep(1)
        assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_tp_int4_engine_sharded_at_load(tmp_path):
    """An int4-awq engine (groups of 32; each rank's K a multiple of the packing's 64-column
    blocks) sharded at load: TP = 2 gives TP = 1's greedy tokens."""
    from kiln.runtime.build_cli import main as build_main
    from kiln.runtime.synthetic_tokenizer import synthetic_tokenizer

    cfg = {**CONFIG, "hidden_size": 128, "intermediate_size": 256}
    src = tmp_path / "src"
    src.mkdir()
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(cfg))
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        p.data = torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.08
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model).items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    synthetic_tokenizer(259, 257, [258], tmp_path / "tok").save_pretrained(str(src))
    out = tmp_path / "engine"
    assert build_main(["--model", str(src), "--output", str(out), "--quantization", "int4-awq", "--group-size", "32",
                       "--calibration-samples", "4", "--device", "cpu"]) == 0
    res = {}
    for tp in (1, 2):
        llm = LLM(engine=str(out), tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=24,
                  max_num_batched_tokens=32, max_model_len=384, cpu_threads=1)
        try:
            outs = llm.generate(_prompts(), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            res[tp] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.runner.close()
    assert res[2] == res[1]
