"""Tensor parallelism on the CPU (gloo): TP = 2 and 4 give the greedy tokens of TP = 1 on the
parity prompts (bytes as token ids) of a small random Llama in float32, with chunked prefill,
prefix caching and preemption happening; so do float, int4, FP8 and INT8 engines sharded at
load at TP = 2; a bad size (heads, int4 blocks, visible GPUs) is refused before any worker
starts; a killed rank takes the server down with one error line, and a killed engine core
takes its workers with it."""

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
    sched = llm.engine.scheduler
    schedule, chunks = sched.schedule, []

    def recording_schedule(*a, **kw):  # the real scheduler's step plan, its partial prefills noted
        out = schedule(*a, **kw)
        chunks.extend(sr.request.num_prompt_tokens for sr in out.scheduled
                      if sr.num_computed_tokens + sr.num_new_tokens < sr.request.num_prompt_tokens)
        return out

    sched.schedule = recording_schedule
    try:
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True))
        # (preemptions, prefix-cache hits, prompts longer than the token budget that a step
        # prefilled only part of)
        stats = (sched.num_preemptions_total, sched.kv_cache_manager.prefix_cache_hits,
                 sum(n > 32 for n in chunks))
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.engine.runner.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1(tiny_model, tp):
    ref, ref_stats = _run(tiny_model, 1)
    got, stats = _run(tiny_model, tp)
    assert ref_stats[0] > 0 and ref_stats[1] > 0  # preemption and prefix-cache hits happened
    assert stats[0] > 0 and stats[2] > 0  # at TP too: preemption, chunked prefill (32-token budget)
    assert got == ref


def test_tp_size_that_does_not_split_heads(tiny_model):
    import multiprocessing

    with pytest.raises(ValueError, match="tensor parallel size 3 does not split the model's 4 attention heads and 2 "
                                         "KV heads"):
        LLM(model=tiny_model, tensor_parallel_size=3, device="cpu", dtype="float32")
    assert not multiprocessing.active_children()  # refused before any worker started


def test_check_devices_counts_the_visible_gpus(monkeypatch):
    """``cuda`` (or ``auto`` where CUDA is available) with fewer visible GPUs than ranks is
    refused with the numbers; the CPU (gloo) needs none."""
    from kiln.runtime.distributed.parallel import check_devices

    for visible in (0, 1, 2):
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=visible: v > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda v=visible: v)
        check_devices("cpu", 2)
        check_devices(torch.device("cpu"), 4)
        for device in ("cuda", "auto", torch.device("cuda")):
            if visible >= 2:
                check_devices(device, 2)
            elif device == "auto" and visible == 0:
                check_devices(device, 2)  # auto without a GPU: the CPU
            else:
                word = "is" if visible == 1 else "are"
                with pytest.raises(ValueError, match=f"tensor parallel size 2 needs 2 GPUs, but {visible} {word} "
                                                     "visible"):
                    check_devices(device, 2)


def test_too_few_gpus_is_one_line_exit_2(tiny_model):
    """``kiln serve --device cuda --tensor-parallel-size 2`` with no GPU visible: exit 2 and
    one line on stderr."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "KILN_API_KEY": "k"}  # (no warning about a missing key)
    r = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "serve", "--model", tiny_model, "--device", "cuda",
                        "--tensor-parallel-size", "2", "--port", str(18000 + (os.getpid() + 250) % 1000)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["kiln: error: tensor parallel size 2 needs 2 GPUs, but 0 are visible "
                                     "(CUDA_VISIBLE_DEVICES / nvidia.com/gpu)"], r.stderr


def test_tensor_parallel_rule_agrees_with_the_runtime():
    """``kiln.common.tensorparallel`` (the operator's check too) carries the int4 packing's
    block size and the runtime's shape of a real model config."""
    from kiln.common.tensorparallel import INT4_KBLOCK, ParallelShape
    from kiln.kernels.int4_format import KBLOCK

    assert INT4_KBLOCK == KBLOCK
    cfg = ModelConfig.from_hf_dict(CONFIG)
    assert ParallelShape.from_hf_config(CONFIG) == ParallelShape(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                                 cfg.head_dim, cfg.intermediate_size)


def test_tp_float_engine_sharded_at_load(tiny_model, tmp_path):
    """A ``kiln build`` engine (full tensors, fused QKV and gate-up) sharded at load serves the
    same greedy tokens at TP = 2 as at TP = 1."""
    from kiln.runtime.build_cli import main as build_main
    from kiln.runtime.synthetic_tokenizer import synthetic_tokenizer

    synthetic_tokenizer(259, 257, [258], tmp_path / "tok").save_pretrained(tiny_model)
    out = tmp_path / "engine"
    log = tmp_path / "termination-log"
    log.write_text("")
    assert build_main(["--model", tiny_model, "--output", str(out), "--device", "cpu",
                       "--termination-log", str(log)]) == 0
    # the report the operator checks runtime.tensorParallelSize against (engine record's shape)
    from kiln.common.enginecache import parse_build_report

    assert parse_build_report(log.read_text())["shape"] == {
        "numAttentionHeads": 4, "numKeyValueHeads": 2, "headDim": 16, "intermediateSize": 96}
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


def _gauge(url: str, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)}
    return sum(s.value for s in fams[name].samples) if name in fams else 0.0


def _serve_tp2(model: str, port: int):
    """``kiln serve --tensor-parallel-size 2`` on the CPU in its own session (stderr piped)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "kiln.runtime.cli", "serve", "--model", model, "--device", "cpu",
                             "--dtype", "float32", "--num-kv-blocks", "64", "--tensor-parallel-size", "2",
                             "--cpu-threads", "1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ready_family(proc, url: str):
    """Wait until the server is ready (failing if it exits first); return its descendant
    processes, the engine core (rank 0) and the rank 1..N-1 workers."""
    import time

    import httpx
    import psutil

    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    family = psutil.Process(proc.pid).children(recursive=True)
    # the workers: the engine core's spawned children (not multiprocessing's resource tracker)
    ranks = [p for p in family if p.ppid() != proc.pid and "spawn_main" in " ".join(p.cmdline())]
    assert len(ranks) == 1, [p.cmdline() for p in family]
    core = psutil.Process(ranks[0].ppid())
    assert core.ppid() == proc.pid
    return family, core, ranks


def _alive(procs) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_killed_rank_takes_the_server_down(tiny_model):
    """``kiln serve --tensor-parallel-size 2`` with requests running: SIGKILL rank 1, the
    requests fail, ``/health`` fails, the server exits non-zero with one error line naming the
    rank (no traceback of the collective that lost its peer), and no process of it is left."""
    import os
    import signal
    import threading
    import time

    import httpx

    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    proc = _serve_tp2(tiny_model, port)
    try:
        family, _, ranks = _ready_family(proc, url)
        replies = []

        def request():
            try:
                r = httpx.post(f"{url}/v1/completions", timeout=120,
                               json={"prompt": [1, 2, 3, 4], "max_tokens": 400, "ignore_eos": True})
                replies.append((r.status_code, r.text))
            except httpx.HTTPError as e:
                replies.append((0, repr(e)))

        clients = [threading.Thread(target=request) for _ in range(2)]
        for c in clients:
            c.start()
        while _gauge(f"{url}/metrics", "kiln_num_requests_running") < 2:
            time.sleep(0.1)  # both requests running
        os.kill(ranks[0].pid, signal.SIGKILL)
        health = []
        while proc.poll() is None:
            try:
                health.append(httpx.get(f"{url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        err = proc.stderr.read()
        for c in clients:
            c.join(30)
        assert proc.returncode != 0
        assert 500 in health, health
        assert [code for code, _ in replies] == [500, 500], replies
        lines = [ln for ln in err.splitlines() if "tensor-parallel rank" in ln]
        assert len(lines) == 1 and "rank 1" in lines[0] and "SIGKILL" in lines[0], err
        assert "Traceback" not in err, err
        time.sleep(1)
        assert not _alive(family)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_killed_core_leaves_no_rank(tiny_model):
    """SIGKILL the engine core (rank 0, which cannot clean up): its worker ranks die with it,
    the API server exits non-zero, and no process of the server is left.  The worker is
    stopped (SIGSTOP) first, so it cannot notice the lost peer through its own collective
    failing: only the kernel's ``PR_SET_PDEATHSIG`` SIGKILL, delivered to a stopped process
    too, ends it."""
    import os
    import signal
    import time

    import psutil

    port = 18000 + (os.getpid() + 500) % 1000
    family = []
    proc = _serve_tp2(tiny_model, port)
    try:
        family, core, ranks = _ready_family(proc, f"http://127.0.0.1:{port}")
        for r in ranks:
            os.kill(r.pid, signal.SIGSTOP)
        while any(r.status() != psutil.STATUS_STOPPED for r in ranks):
            time.sleep(0.05)
        os.kill(core.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(ranks), [p.cmdline() for p in _alive(ranks)]
        assert proc.wait(30) != 0
        time.sleep(1)
        assert not _alive(family), [p.cmdline() for p in _alive(family)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in _alive(family):  # a failed run's leftovers
            p.kill()


def _quantized_engine(tmp_path, quantization: str, *extra: str) -> str:
    """``kiln build --quantization ...`` of a random Llama whose every rank's K at TP = 2 is a
    multiple of the int4 packing's 64-column blocks (hidden 128, intermediate 256)."""
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
    assert build_main(["--model", str(src), "--output", str(out), "--quantization", quantization,
                       "--calibration-samples", "4", "--device", "cpu", *extra]) == 0
    return str(out)


@pytest.mark.parametrize("quantization,extra", [("int4-awq", ("--group-size", "32")), ("fp8", ()),
                                                ("int8-smoothquant", ())])
def test_tp_quantized_engine_matches_tp1(tmp_path, quantization, extra):
    """A quantized engine sharded at load gives TP = 1's greedy tokens at TP = 2, with
    preemption happening, and the sampled tokens' log-probabilities agree to float32 rounding:
    int4 groups shard whole; FP8 and INT8 activations in the row-parallel layers (o, down) are
    quantized per token with the whole row's max (the ranks' maxima all-reduced), so each rank
    rounds its shard of K exactly as one rank rounds the row."""
    engine = _quantized_engine(tmp_path, quantization, *extra)
    res = {}
    for tp in (1, 2):
        llm = LLM(engine=engine, tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=24,
                  max_num_batched_tokens=32, max_model_len=384, cpu_threads=1)
        try:
            outs = llm.generate(_prompts(), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                           logprobs=0))
            res[tp] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
            assert llm.engine.scheduler.num_preemptions_total > 0
        finally:
            llm.engine.runner.close()
    assert [r[0] for r in res[2]] == [r[0] for r in res[1]]
    if quantization.startswith("int4"):  # 4 ranks: 32 of o_proj's 128 inputs each, less than a packed block
        with pytest.raises(ValueError, match="o_proj \\(128 input features\\): each rank's 32 must be a "
                                             "multiple of the group size 32 and of 64"):
            LLM(engine=engine, tensor_parallel_size=4, device="cpu", dtype="float32")
    # The float32 sums run in another order at TP = 2 (half-width GEMMs, the all-reduce), which
    # now and then moves one activation across an INT8 / FP8 rounding boundary: that token's
    # log-probability moves by ~1e-2 (one prefix, 2 of 132 here); the others agree to ~1e-5.
    diffs = [abs(a - b) for r1, r2 in zip(res[1], res[2]) for a, b in zip(r1[1], r2[1])]
    assert sum(d > 1e-4 for d in diffs) <= len(diffs) // 20 and max(diffs) < 0.05, sorted(diffs)[-10:]


def test_row_shard_quantized_with_the_rows_max():
    """The per-token quantizers given the whole row's max quantize a shard of a row exactly
    as they quantize the whole row (what a row-parallel rank relies on)."""
    from kiln.runtime.quantization.fp8 import quantize_rows_fp8
    from kiln.runtime.quantization.smoothquant import quantize_rows_int8

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * 2
    x[1, 40] = 30.0  # the row's max in the second shard
    amax = x.abs().amax(dim=-1, keepdim=True)
    for quant in (quantize_rows_fp8, quantize_rows_int8):
        q, s = quant(x)
        for half in (x[:, :32], x[:, 32:]):
            qh, sh = quant(half, amax=amax)
            assert torch.equal(sh, s)
        assert torch.equal(torch.cat([quant(x[:, :32], amax=amax)[0], quant(x[:, 32:], amax=amax)[0]], 1).float(),
                           q.float())
        assert not torch.equal(quant(x[:, :32])[1], s)  # without it the first shard's scale differs


def test_tp_lora_matches_tp1(tiny_model, tmp_path):
    """LoRA under TP = 2 (A replicated and B sharded on column-parallel layers, A sharded on
    row-parallel ones): a batch mixing a peft-made adapter on all seven projections with base
    requests gives TP = 1's greedy tokens, and the adapter changes them."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM as HFLlama

    from kiln.runtime.lora import LoRARequest

    torch.manual_seed(3)
    peft_model = get_peft_model(HFLlama.from_pretrained(tiny_model), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"], lora_dropout=0.0, init_lora_weights=False))
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            p.data.mul_(3.0)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    prompts = _prompts()[:6]
    reqs = [LoRARequest("a") if i % 2 == 0 else None for i in range(len(prompts))]
    res = {}
    for tp in (1, 2):
        llm = LLM(model=tiny_model, tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=48,
                  max_num_batched_tokens=64, max_model_len=384, cpu_threads=1,
                  lora_modules={"a": str(tmp_path / "adapter")}, max_loras=2, max_lora_rank=8)
        try:
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            res[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=reqs)]
            base = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp)]
        finally:
            llm.engine.runner.close()
    assert res[2] == res[1]
    assert base[0] != res[1][0], "the adapter did not change the output"
