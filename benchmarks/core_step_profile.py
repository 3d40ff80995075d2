"""Per-step host cost of the engine core beside the forward pass (CPU, no GPU needed).

A tiny random Llama (1 layer, hidden 64, so the forward pass costs little) runs ``--seqs``
decoding sequences; for ``--steps`` steps this times, per step:

- ``core.step()`` as offline (no stat logger) and as served (the Prometheus stat logger);
- what the serving core adds after the step: encoding the step's outputs for the API process;
- what the API process does with one step's outputs: decoding the frame, the output processor
  (incremental detokenization with the synthetic tokenizer) and one SSE chunk per sequence.

Then a cProfile of the served ``core.step()`` (top functions by own time).
Usage: python benchmarks/core_step_profile.py [--seqs 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

from kiln.runtime.config import EngineArgs
from kiln.runtime.engine_core import messages as m
from kiln.runtime.engine_core.core import EngineCore
from kiln.runtime.engine_core.loading import load_model
from kiln.runtime.sampling_params import SamplingParams

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float32"}


def _fill(core: EngineCore, seqs: int, prompt_len: int, tag: str) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True, detokenize=True)
    for i in range(seqs):
        core.add_request(m.CoreRequest(f"{tag}-{i}#0", [3 + (i + j) % 4000 for j in range(prompt_len)], p,
                                       max_tokens=4000, arrival_time=time.monotonic()))
    while core.scheduler.num_waiting:  # prefill
        core.step()
    for _ in range(3):
        core.step()


def _time_steps(core: EngineCore, steps: int, after=None) -> tuple[float, float]:
    """(mean ms per core.step(), mean ms per ``after(outputs)``)."""
    t_step = t_after = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = core.step()
        t1 = time.perf_counter()
        if after is not None:
            after(outs)
        t_step += t1 - t0
        t_after += time.perf_counter() - t1
    return t_step / steps * 1e3, t_after / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=32)
    ns = ap.parse_args()
    from kiln.runtime.server.metrics import Metrics
    from kiln.runtime.processing.output import OutputProcessor
    from kiln.runtime.synthetic_tokenizer import build_tokenizer
    from kiln.runtime.server.http_utils import sse
    from kiln.runtime.server.protocol import CompletionChunk, CompletionStreamChoice

    folder = Path(tempfile.mkdtemp(prefix="kiln-prof-"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    args = EngineArgs(model=str(folder), load_format="dummy", device="cpu", max_num_seqs=ns.seqs,
                      max_num_batched_tokens=max(4096, ns.seqs * ns.prompt_len), num_kv_blocks=ns.seqs * 300 // 16 + 64,
                      max_model_len=4096, enable_prefix_caching=False, cpu_threads=1)
    loaded = load_model(args)
    res = {}
    core = EngineCore(args, loaded=loaded)
    _fill(core, ns.seqs, ns.prompt_len, "off")
    res["core.step offline (no stat logger)"] = _time_steps(core, ns.steps)[0]
    core.abort_requests([r for r in list(core._seqs)])
    core.stat_logger = Metrics("prof")
    _fill(core, ns.seqs, ns.prompt_len, "srv")
    frames = []
    step_ms, enc_ms = _time_steps(core, ns.steps, lambda outs: frames.append(
        m.encode(m.CoreOutputs(outputs=outs, accepted=[], rejected=[], timestamp=time.monotonic()))))
    res["core.step served (Prometheus stat logger)"] = step_ms
    res["core: encode one step's outputs"] = enc_ms
    res["frame bytes per step"] = sum(map(len, frames)) / len(frames)
    # the API process's side of a step
    tok = build_tokenizer(CONFIG["vocab_size"], 1, [2])
    op = OutputProcessor(tok, stream_outputs=True)
    p = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    for i in range(ns.seqs):
        op.add_request(f"srv-{i}", None, [3] * ns.prompt_len, p, time.monotonic())
    t_dec = t_proc = t_sse = 0.0
    for fr in frames:
        t0 = time.perf_counter()
        msg = m.decode_core_outputs(fr)
        t1 = time.perf_counter()
        results, _ = op.process_outputs(msg.outputs)
        t2 = time.perf_counter()
        for r in results:
            c = r.outputs[0]
            sse(CompletionChunk("cmpl-x", 0, "prof", [CompletionStreamChoice(0, c.delta_text, None, None)]))
        t3 = time.perf_counter()
        t_dec += t1 - t0
        t_proc += t2 - t1
        t_sse += t3 - t2
    k = len(frames)
    res["api: decode frame"] = t_dec / k * 1e3
    res["api: output processor (detokenize)"] = t_proc / k * 1e3
    res["api: SSE chunks"] = t_sse / k * 1e3
    pr = cProfile.Profile()
    pr.enable()
    _time_steps(core, ns.steps)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
    print(f"{ns.seqs} sequences decoding, {ns.steps} steps, ms per step:")
    for name, v in res.items():
        print(f"  {name:45s} {v:9.3f}")


if __name__ == "__main__":
    main()
