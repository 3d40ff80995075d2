"""``kiln bench``: offline throughput (with transformers as the peer in the same run) and,
in ``bench_serve``, what users of a live server see (TTFT, TPOT, ITL, e2e latency, goodput).

Offline, ``LLM.generate`` runs the workload (``bench_common``: random token-id prompts, fixed,
uniform or lognormal lengths, EOS ignored).  The transformers peer runs the same prompts:
batched ``generate`` with left padding on CPU (vLLM's ``run_hf``: each batch runs to its
longest request, only requested tokens are counted) or continuous batching
(``generate_batch``) on CUDA.  ``--quantization`` with ``--load-format dummy`` quantizes the
random weights at load (round to nearest), so FP8 and int4 throughput need no engine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from .bench_common import (Workload, add_workload_args, check_workload_flags, check_writable,  # noqa: F401
                           describe_workload, json_safe, make_workload, pct, positive_int, workload_from_flags)

# --quantization of random weights (kiln build's methods, quantization.rtn)
RTN_LOAD_METHODS = ("fp8", "int8-smoothquant", "int4-awq", "int4-gptq")


def run_kiln_offline(llm, wl: Workload) -> dict:
    """``LLM.generate`` on the workload after a warm-up: throughput (tokens/s, requests/s),
    TTFT and TPOT percentiles (seconds, all requests arriving at once), steps, preemptions."""
    from .sampling_params import SamplingParams  # noqa: PLC0415

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True, detokenize=False) for o in wl.output_lens]
    # Warm up (kernels, allocator) outside the timed region.
    llm.generate([wl.prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))
    _sync(llm)
    spec = llm.engine.core.spec
    if spec is not None:  # count the timed run only
        from .spec_decode.stats import SpecDecodeStats  # noqa: PLC0415

        spec.stats = SpecDecodeStats()
    steps0, pre0 = llm.engine.num_steps, llm.engine.scheduler.num_preemptions_total
    t0 = time.perf_counter()
    t0m = time.monotonic()
    outs = llm.generate(wl.prompts, params)
    _sync(llm)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - t0m for o in outs if "first_token_time" in o.metrics]
    tpot = []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        if n > 1 and "first_token_time" in o.metrics:
            tpot.append((o.metrics["last_token_time"] - o.metrics["first_token_time"]) / (n - 1))
    return {"engine": "kiln", "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
            "requests_s": len(outs) / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99), "steps": llm.engine.num_steps - steps0,
            "preemptions": llm.engine.scheduler.num_preemptions_total - pre0,
            **(spec_summary(llm) if spec is not None else {})}


def spec_summary(llm) -> dict:
    """Speculative decoding's counts of the engine (``SpecDecodeStats.as_dict``) with its
    method and draft length."""
    spec = llm.engine.core.spec
    return {"spec_method": spec.config.method, "spec_k": spec.config.num_speculative_tokens,
            "spec_max_batch_size": spec.config.max_batch_size, "spec_adaptive": spec.switch_off.adaptive,
            "spec_switch_off_rates": spec.switch_off.rates(), **spec.stats.as_dict()}


def _sync(llm) -> None:
    import torch  # noqa: PLC0415

    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def build_hf_peer(llm):
    """A transformers model holding exactly the Kiln model's weights (same dtype/device)."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    from .model.llama import to_hf_state_dict  # noqa: PLC0415

    runner = llm.engine.runner
    cfg = AutoConfig.for_model(**{k: v for k, v in llm.engine.model_config.to_hf_dict().items()
                                  if k not in ("architectures",)})
    with torch.device(runner.device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=runner.dtype)
    sd = to_hf_state_dict(runner.model)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m and not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"peer weights mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.eval()
    return hf


def run_hf_offline(hf, wl: Workload, batch_size: int, device) -> dict:
    """transformers' batched ``generate`` (vLLM ``run_hf`` style) on the same prompts."""
    import torch  # noqa: PLC0415

    pad = 0
    n_done = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(wl.prompts), batch_size):
            batch = wl.prompts[i : i + batch_size]
            outs = wl.output_lens[i : i + batch_size]
            L = max(len(p) for p in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.long)
            for j, p in enumerate(batch):
                ids[j, L - len(p):] = torch.tensor(p)
                mask[j, L - len(p):] = 1
            new = max(outs)
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad, use_cache=True)
            n_done += sum(outs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"engine": "transformers.generate", "wall_s": wall, "output_tokens": n_done,
            "output_tok_s": n_done / wall, "requests_s": len(wl.prompts) / wall}


def run_hf_continuous(hf, wl: Workload) -> dict:
    """transformers' continuous batching (``generate_batch``) on the same prompts (CUDA)."""
    import torch  # noqa: PLC0415
    from transformers import GenerationConfig  # noqa: PLC0415

    gc = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0,
                          use_cuda_graph=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = hf.generate_batch(inputs=wl.prompts, generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(min(len(r.generated_tokens), o) for r, o in zip(res.values(), wl.output_lens))
    return {"engine": "transformers.generate_batch", "wall_s": wall, "output_tokens": n,
            "output_tok_s": n / wall, "requests_s": len(wl.prompts) / wall}


def cmd_offline(ns: argparse.Namespace) -> int:
    """Run ``kiln bench offline``; returns the exit code."""
    from .cli import engine_args_from  # noqa: PLC0415
    from .llm import LLM  # noqa: PLC0415

    check_workload_flags(ns)
    if ns.peer != "none" and ns.quantization != "none":
        raise ValueError(f"--peer runs float weights in transformers; it cannot be compared with --quantization "
                         f"{ns.quantization}")
    if ns.json:
        check_writable(ns.json)
    args = replace(engine_args_from(ns), quantization=ns.quantization)  # ValueError: not with a real model
    llm = LLM(**{k: v for k, v in vars(args).items()})
    wl = workload_from_flags(ns, llm.engine.model_config.vocab_size, llm.tokenizer)
    runner = llm.engine.runner
    quant = f", {ns.quantization} weights (round to nearest)" if ns.quantization != "none" else ""
    kv_dtype = str(runner.kv_cache_dtype()).removeprefix("torch.")
    print(f"[bench] model {llm.engine.model_ref} on {runner.device}/{runner.dtype}{quant}, KV cache {kv_dtype}; "
          f"{describe_workload(ns, wl)}", flush=True)
    results = [run_kiln_offline(llm, wl)]
    results[0]["quantization"] = ns.quantization
    results[0]["kv_cache_dtype"] = kv_dtype
    print(json.dumps(json_safe(results[-1])), flush=True)
    if ns.peer != "none":
        hf = build_hf_peer(llm)
        if ns.peer == "transformers-cb":
            results.append(run_hf_continuous(hf, wl))
        else:
            results.append(run_hf_offline(hf, wl, ns.peer_batch_size, runner.device))
        print(json.dumps(json_safe(results[-1])), flush=True)
        results.append({"ratio_kiln_over_peer": results[0]["output_tok_s"] / results[1]["output_tok_s"]})
    _print_table(results)
    if "spec_method" in results[0]:
        r = results[0]
        rule = "where measured to pay" if r["spec_adaptive"] else "at every step"
        head = (f"speculative {r['spec_method']} k={r['spec_k']} (drafts {rule} up to "
                f"{r['spec_max_batch_size']} sequences)")
        if r["spec_num_drafts"]:
            per_pos = " ".join(f"{x:.2f}" for x in r["spec_acceptance_per_position"])
            print(f"{head}: acceptance {r['spec_acceptance_rate']:.3f}, mean accepted length "
                  f"{r['spec_mean_accepted_length']:.2f} tokens, per position [{per_pos}], {r['spec_draft_tokens']} "
                  f"draft tokens in {r['spec_num_drafts']} verifications")
        else:
            print(f"{head}: no drafts proposed")
        shown = {b: ["-" if x is None else f"{x:.0f}" for x in (v["speculative"], v["plain"])]
                 for b, v in r["spec_switch_off_rates"].items()}
        rates = ", ".join(f"{b}: {on} vs {off}" for b, (on, off) in shown.items())
        print(f"output tok/s with vs without drafts, per batch size, as the switch-off measured them: "
              f"{rates or 'no decode step measured'}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(ns).items() if k not in ("func", "workload_defaults")},
                       "results": [json_safe(r) for r in results]}, f, indent=2)
    return 0


def _print_table(results: list[dict]) -> None:
    print(f"{'engine':32s} {'out tok/s':>10s} {'req/s':>8s} {'wall s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'TPOT p50':>9s} {'TPOT p99':>9s}")
    for r in results:
        if "engine" not in r:
            print(" ".join(f"{k}={v:.2f}" for k, v in r.items()))
            continue
        f = lambda k: f"{r[k] * 1e3:8.1f}ms" if k in r and r[k] == r[k] else f"{'-':>10s}"  # noqa: E731
        print(f"{r['engine']:32s} {r['output_tok_s']:10.1f} {r['requests_s']:8.2f} {r['wall_s']:8.1f} "
              f"{f('ttft_p50_s')}{f('ttft_p99_s')}{f('tpot_p50_s')}{f('tpot_p99_s')}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """``kiln bench offline ...`` and ``kiln bench serve ...``."""
    from .bench_serve import add_serve_args  # noqa: PLC0415
    from .cli import add_engine_args  # noqa: PLC0415

    sub = p.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", help="offline throughput of LLM.generate (+ transformers peer)")
    add_engine_args(off)
    add_workload_args(off, (128, 128, 0.0), seed=False)  # --seed is an engine flag
    off.add_argument("--quantization", choices=["none", *RTN_LOAD_METHODS], default="none",
                     help="with --load-format dummy: quantize the random weights at load by rounding to nearest "
                          "(int4: groups of 128; int4-awq and int4-gptq differ only in calibration, so both run "
                          "the same W4A16 kernels); a real model is quantized by `kiln build`")
    off.add_argument("--peer", choices=["none", "transformers", "transformers-cb"], default="none")
    off.add_argument("--peer-batch-size", type=positive_int, default=64)
    off.add_argument("--json", default=None, help="write the arguments and results here")
    add_serve_args(sub.add_parser("serve", help="TTFT / TPOT / ITL / e2e percentiles and goodput against a live "
                                  "server, measured from its stream"))


def run_bench(ns: argparse.Namespace) -> int:
    """Run ``kiln bench offline ...`` or ``kiln bench serve ...``; returns the exit code."""
    if ns.mode == "offline":
        return cmd_offline(ns)
    from .bench_serve import cmd_serve  # noqa: PLC0415

    return cmd_serve(ns)
