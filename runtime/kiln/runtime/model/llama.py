"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) in Kiln's own code.

Architecture (Touvron et al., 2023): pre-norm decoder blocks of RMSNorm -> attention with
RoPE and grouped-query attention (Ainslie et al., 2023) -> RMSNorm -> SwiGLU MLP, with the
residual add fused into the next norm.  Projections are fused (QKV, gate-up) and laid out
for tensor parallelism; ``load_weights`` maps Hugging Face tensor names onto them.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kiln.kernels.options import DEFAULT_OPTIONS, KernelOptions

from ..attention import AttentionMetadata
from ..attention import backend as attn_backend
from .config import ModelConfig
from .layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
    set_kernel_options,
)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over it.

    ``k_cache``/``v_cache`` ([num_blocks, block_size, Hkv, D]) are bound by the model
    runner after it allocates the pool (``bind_kv_cache``).
    """

    kernel_options: KernelOptions = DEFAULT_OPTIONS

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Scales for an fp8 KV cache (None: cache holds the model dtype).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]; kv_written: k, v already in the cache
        if self.k_cache is None:
            raise RuntimeError("KV cache not bound: call ModelRunner.allocate_kv_cache first")
        if not kv_written:
            attn_backend.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale,
                                        self.v_scale, options=self.kernel_options)
        return attn_backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                            options=self.kernel_options)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.qkv_bias,
            tp_size=tp_size, tp_rank=tp_rank,
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False,
                                        tp_size=tp_size, tp_rank=tp_rank)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        a = self.attn
        if a.k_cache is not None and attn_backend.rotary_and_write_kv(
                positions, q, k, v, self.rotary_emb.cos_sin_cache, a.k_cache, a.v_cache, meta.slot_mapping,
                a.k_scale, a.v_scale, options=a.kernel_options):
            out = a(q, k, v, meta, kv_written=True)  # one kernel rotated q, k and wrote the cache
        else:
            q, k = self.rotary_emb(positions, q, k)
            out = a(q, k, v, meta)
        return self.o_proj(out.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False,
                                                       tp_size=tp_size, tp_rank=tp_rank)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False,
                                           tp_size=tp_size, tp_rank=tp_rank)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a quantization method may fuse SwiGLU into the gate|up GEMM (int4: the GEMV epilogue)
        fused = getattr(self.gate_up_proj.quant_method, "apply_silu_and_mul", None)
        h = fused(self.gate_up_proj, x) if fused is not None else None
        if h is not None:
            return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        # or SwiGLU into the down projection's input quantization (fp8: one kernel for both)
        after = getattr(self.down_proj.quant_method, "apply_after_swiglu", None)
        y = after(self.down_proj, gate_up) if after is not None else None
        return self.down_proj(self.act_fn(gate_up)) if y is None else y


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp_size, tp_rank)
        self.mlp = LlamaMLP(cfg, tp_size, tp_rank)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        # each norm may hand its output to the next linear already quantized (FP8: quant_for)
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant_for=qkv)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant_for=qkv)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, quant_for=gate_up)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, tp_size, tp_rank) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # EAGLE-3 speculative decoding: the layers whose input (the residual stream, [T, H])
        # is kept, concatenated, in ``aux_hidden`` [T, len * H] after each forward.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, meta)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Kiln's Llama-family causal LM.

    ``forward(input_ids [T] int64, positions [T] int64, meta) -> hidden [T, hidden]``;
    ``compute_logits(hidden [S, hidden]) -> float32 [S, vocab]`` for the rows to sample.
    ``kernel_options`` (the engine's kernel choices) go to every layer that launches kernels.
    """

    # HF checkpoint names -> (fused parameter, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp_size: int = 1, tp_rank: int = 0,
                 kernel_options: KernelOptions = DEFAULT_OPTIONS):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp_size, tp_rank)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        set_kernel_options(self, kernel_options)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors through each parameter's ``weight_loader``.

        Returns:
            The set of parameter names that received data.
        Raises:
            ValueError: an unknown tensor name or a shape mismatch (corrupt checkpoint).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = name, None
            for src, (dst, shard_id) in self.packed_modules.items():
                if f".{src}." in name:
                    target, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor.to(param.dtype), shard)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            loaded.add(target)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused QKV and gate-up split back), so
    transformers can run the very same weights (peer benchmarks, equivalence tests).
    Only valid at tensor-parallel size 1."""
    cfg = model.config
    q, kv = cfg.q_size, cfg.kv_size
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if ".qkv_proj." in name:
            for part, (a, b) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
                out[name.replace("qkv_proj", part)] = t[a:b]
        elif ".gate_up_proj." in name:
            i = cfg.intermediate_size
            out[name.replace("gate_up_proj", "gate_proj")] = t[:i]
            out[name.replace("gate_up_proj", "up_proj")] = t[i:]
        else:
            out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
