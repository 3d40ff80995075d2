"""Calibration: the samples, and a layer-by-layer pass that collects the statistics
quantization methods read.

Data: ``kiln build --calibration-data FILE`` (plain text or JSONL chat records), else the
shipped mixture ``kiln/runtime/data/calibration_mix.jsonl`` (chat answers through the chat
template, prose, code, markdown, numbers, several languages; see ``calibration_data``), frozen
into the project so every build sees the same bytes.  The held-out evaluation texts
(``data/heldout/``, ``data/heldout.txt``) differ from it.  Nothing is downloaded.

The pass (``LayerwiseCalibrator``) runs the calibration samples through the model one decoder
layer at a time, as GPTQ and AWQ do: statistics of layer ``i``'s linear inputs are collected
with forward pre-hooks, the caller quantizes layer ``i``, and the samples are then pushed
through the *quantized* layer to become layer ``i + 1``'s inputs, so later layers calibrate
against the errors of earlier ones.  Memory holds one layer's activations for all samples.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..attention import AttentionMetadata
from .base import LayerStats, decoder_linears
from .calibration_data import (  # noqa: F401  (data_path: shipped files, for callers)
    Record,
    data_path,
    default_calibration_path,
    domain_streams,
    read_records,
    samples_from_streams,
    sha256_of,
)

SAMPLE_TOKENS = 128  # tokens per calibration sample
MAX_SAVED_ROWS = 1024  # input rows kept per linear for AWQ's loss (deterministic stride)


def calibration_samples(tokenizer, num_samples: int, sample_tokens: int = SAMPLE_TOKENS,
                        text: str | None = None, data: str | Path | None = None) -> list[list[int]]:
    """Calibration samples of at most ``sample_tokens`` tokens (the first ``num_samples``;
    fewer when the data is shorter), taken round-robin over the data's domains.

    Args:
        tokenizer: the model's tokenizer (with its chat template for chat records).
        num_samples: samples wanted.
        sample_tokens: tokens per sample.
        text: a plain text to cut instead of a data file (tests).
        data: a data file (``calibration_data.read_records``); default: the shipped mixture.
    Raises:
        ValueError: ``num_samples < 1``.
        CalibrationDataError: a data file that cannot be used.
    """
    return calibration_samples_by_domain(tokenizer, num_samples, sample_tokens, text, data)[0]


def calibration_samples_by_domain(tokenizer, num_samples: int, sample_tokens: int = SAMPLE_TOKENS,
                                  text: str | None = None, data: str | Path | None = None
                                  ) -> tuple[list[list[int]], dict[str, int]]:
    """``calibration_samples`` and the number of samples taken from each domain."""
    if num_samples < 1:
        raise ValueError(f"calibration samples must be at least 1, got {num_samples}")
    if text is not None:
        records = [Record("text", text=text)]
    else:
        records = read_records(data if data is not None else default_calibration_path())
    return samples_from_streams(domain_streams(records, tokenizer), num_samples, sample_tokens)


def single_sequence_meta(num_tokens: int, block_size: int, device) -> AttentionMetadata:
    """Attention metadata of one sequence prefilled from position 0 into blocks 0, 1, ..."""
    nblk = math.ceil(num_tokens / block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(nblk, dtype=torch.int32, device=device).view(1, -1),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens, seq_lens_list=[num_tokens],
        query_lens_list=[num_tokens], block_size=block_size)


class _Collector:
    """Accumulates ``LayerStats`` for one linear from its inputs."""

    def __init__(self, wants: frozenset[str], stride: int):
        self.wants = wants
        self.stride = stride
        self.stats = LayerStats()
        self._abssum: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []
        self._seen = 0

    def __call__(self, module, args) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [T, K]
        st = self.stats
        a = x.abs()
        if "absmax" in self.wants:
            m = a.amax(dim=0)
            st.absmax = m if st.absmax is None else torch.maximum(st.absmax, m)
        if "absmean" in self.wants:
            s = a.sum(dim=0)
            self._abssum = s if self._abssum is None else self._abssum + s
        if "hessian" in self.wants:
            xd = x.double()
            h = xd.t() @ xd
            st.hessian = h if st.hessian is None else st.hessian + h
        if "samples" in self.wants:
            idx = torch.arange(x.shape[0], device=x.device)
            keep = ((idx + self._seen) % self.stride) == 0
            self._rows.append(x[keep])
        self._seen += x.shape[0]
        st.num_tokens += x.shape[0]

    def finish(self) -> LayerStats:
        st = self.stats
        n = max(st.num_tokens, 1)
        if self._abssum is not None:
            st.absmean = self._abssum / n
        if st.hessian is not None:
            st.hessian = st.hessian * (2.0 / n)
        if self._rows:
            st.samples = torch.cat(self._rows)[:MAX_SAVED_ROWS]
        return st


class LayerwiseCalibrator:
    """Pushes calibration samples through a ``LlamaForCausalLM`` one decoder layer at a time.

    Args:
        model: the float model (its weights are rewritten layer by layer by the caller).
        samples: token id lists (each at most a few hundred tokens).
        block_size: block size of the temporary KV cache.
    """

    def __init__(self, model: nn.Module, samples: list[list[int]], block_size: int = 16):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.block_size = block_size
        cfg = model.config
        longest = max(len(s) for s in samples)
        nblk = math.ceil(longest / block_size)
        shape = (nblk, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.total_tokens = sum(len(s) for s in samples)
        self.inputs = []
        with torch.inference_mode():
            for ids in samples:
                t = torch.tensor(ids, dtype=torch.int64, device=self.device)
                pos = torch.arange(len(ids), dtype=torch.int64, device=self.device)
                meta = single_sequence_meta(len(ids), block_size, self.device)
                self.inputs.append([pos, model.model.embed_tokens(t), None, meta])

    def _run(self, layer: nn.Module, update: bool) -> None:
        attn = layer.self_attn.attn
        saved = (attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale)
        attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = self.k_cache, self.v_cache, None, None
        try:
            with torch.inference_mode():
                for item in self.inputs:
                    pos, hidden, residual, meta = item
                    # clones: a fused residual-add kernel may update its inputs in place
                    h, r = layer(pos, hidden.clone(), None if residual is None else residual.clone(), meta)
                    if update:
                        item[1], item[2] = h, r
        finally:
            attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = saved

    def collect(self, index: int, wants: frozenset[str], names: tuple[str, ...] | None = None) -> dict[str, LayerStats]:
        """Statistics of the inputs of the linears ``names`` (default: every linear) of decoder
        layer ``index``, as the layer is now (linears already quantized run quantized); the
        layer's weights are not changed and nothing advances."""
        layer = self.model.model.layers[index]
        stride = max(1, math.ceil(self.total_tokens / MAX_SAVED_ROWS))
        mods = [(n, m) for n, m in decoder_linears(layer) if names is None or n in names]
        collectors = {name: _Collector(wants, stride) for name, _ in mods}
        handles = [mod.register_forward_pre_hook(collectors[name]) for name, mod in mods]
        try:
            self._run(layer, update=False)
        finally:
            for h in handles:
                h.remove()
        return {name: c.finish() for name, c in collectors.items()}

    def collect_lm_head(self, wants: frozenset[str]) -> LayerStats:
        """Statistics of the LM head's inputs: the final norm applied to the last decoder
        layer's outputs (call after ``advance`` of the last layer)."""
        col = _Collector(wants, max(1, math.ceil(self.total_tokens / MAX_SAVED_ROWS)))
        norm = self.model.model.norm
        with torch.inference_mode():
            for _, hidden, residual, _ in self.inputs:
                h = norm(hidden.clone()) if residual is None else norm(hidden.clone(), residual.clone())[0]
                col(None, (h,))
        return col.finish()

    def advance(self, index: int, kv_absmax: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run decoder layer ``index`` (as it is now, e.g. quantized) on the samples; its
        outputs become the next layer's inputs.  With ``kv_absmax`` also return max |K| and
        max |V| per KV head (float32 [Hkv] each) written to the KV cache (after RoPE), for FP8
        KV cache scales."""
        layer = self.model.model.layers[index]
        amax: list = [None, None]

        def hook(module, args):
            _, k, v, _ = args  # [T, Hkv, D]
            for j, t in enumerate((k, v)):
                m = t.detach().abs().amax(dim=(0, 2)).float().cpu()
                amax[j] = m if amax[j] is None else torch.maximum(amax[j], m)

        h = layer.self_attn.attn.register_forward_pre_hook(hook) if kv_absmax else None
        try:
            self._run(layer, update=True)
        finally:
            if h is not None:
                h.remove()
        return (amax[0], amax[1]) if kv_absmax else None


def quantize_model(model: nn.Module, handler, samples: list[list[int]] | None, kv_fp8: bool,
                   progress: Callable[[str, int, int], None] | None = None,
                   lm_head: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Apply ``handler`` to every decoder layer, calibrating when needed: per layer,
    ``handler.prepare_layer`` (when it wants statistics), then ``handler.quantize_layer`` once,
    or once per group of ``handler.sequential_groups`` with statistics re-collected each time;
    with ``lm_head``, then ``handler.quantize_lm_head`` on the final norm's outputs (computed
    from the quantized layers, like every other layer's inputs).

    Args:
        model: float32 ``LlamaForCausalLM`` (rewritten in place).
        handler: a ``QuantHandler``.
        samples: calibration token ids (required when the handler calibrates or ``kv_fp8``).
        kv_fp8: also measure K/V ranges for an FP8 KV cache.
        progress: ``progress(stage, done, total)`` callback.
        lm_head: quantize the LM head too (the handler must calibrate).
    Returns:
        per-layer ``(max|K|, max|V|)`` per KV head (float32 [Hkv]) when ``kv_fp8``, else None.
    Raises:
        ValueError: no samples for a calibrating handler, or ``lm_head`` with one that does not
            calibrate.
    """
    if lm_head and not handler.needs_calibration:
        raise ValueError("quantizing the LM head needs a calibrating method")
    layers = model.model.layers
    n = len(layers)
    calibrate = handler.needs_calibration or kv_fp8
    if not calibrate:
        for i, layer in enumerate(layers):
            handler.quantize_layer(layer, f"model.layers.{i}", None)
            if progress:
                progress("quantize", i + 1, n)
        return None
    if not samples:
        raise ValueError("calibration needs at least one sample")
    cal = LayerwiseCalibrator(model, samples)
    kv: list = []
    for i, layer in enumerate(layers):
        if handler.needs_calibration and handler.prepare_wants:
            handler.prepare_layer(layer, f"model.layers.{i}", cal.collect(i, handler.prepare_wants))
        if not handler.needs_calibration:
            handler.quantize_layer(layer, f"model.layers.{i}", None)
        elif handler.sequential_groups:  # GPTQ's "true sequential": later groups see earlier ones quantized
            for names in handler.sequential_groups:
                handler.quantize_layer(layer, f"model.layers.{i}", cal.collect(i, handler.wants, names))
        else:
            handler.quantize_layer(layer, f"model.layers.{i}", cal.collect(i, handler.wants))
        r = cal.advance(i, kv_absmax=kv_fp8)
        if kv_fp8:
            kv.append(r)  # type: ignore[arg-type]
        if progress:
            progress("calibrate+quantize", i + 1, n)
    if lm_head:
        handler.quantize_lm_head(model, cal.collect_lm_head(handler.wants))
        if progress:
            progress("calibrate+quantize LM head", 1, 1)
    return kv if kv_fp8 else None
