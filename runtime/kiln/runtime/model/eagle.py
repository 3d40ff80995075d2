"""EAGLE and EAGLE-3 draft heads, loaded from their published checkpoint layouts.

EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; checkpoints such as ``yuhuili/EAGLE-LLaMA3-Instruct-8B``): ``fc`` [H, 2H]
(optionally with a bias) maps ``concat(token embedding, target feature)`` to H, then one
Llama decoder layer whose first norm is absent (``layers.0.*``); its output
(``hidden + residual``) is both the next step's feature and the input of the *target's*
LM head.  The target feature is the target's last hidden state after its final norm.

EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"; ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``fc`` [H, 3H]
fuses the target's low, middle and high residual streams (the inputs of layers 2,
L / 2 and L - 3) into H; the decoder layer (``midlayer.*``) attends over
``concat(input_layernorm(embedding), hidden_norm(feature))`` (q/k/v take 2H), with the
feature as residual; ``norm`` then its own ``lm_head`` over a reduced draft vocabulary,
mapped to the target's ids by ``d2t`` (target id = draft id + d2t[draft id]).  Later steps
feed the layer's pre-norm output back as the feature (no ``fc``).

The embedding is the checkpoint's ``embed_tokens`` when it has one, else the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from .config import ModelConfig, ModelConfigError
from .layers import QKVParallelLinear, ReplicatedLinear, RMSNorm, default_weight_loader
from .llama import LlamaAttention, LlamaMLP


def eagle_kind(names: Iterable[str]) -> str:
    """``eagle3`` when the tensors hold a ``midlayer`` or a 3H ``fc`` (checked by the
    caller), else ``eagle``."""
    return "eagle3" if any(n.startswith("midlayer.") or n == "d2t" for n in names) else "eagle"


def aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's target layers whose inputs (the residual stream) are fused: low, middle,
    high (the layout EAGLE-3's training code and vLLM use)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class EagleHead(nn.Module):
    """One EAGLE / EAGLE-3 head.

    Args:
        cfg: the head's decoder shape (its ``config.json``; one layer).
        kind: ``eagle`` or ``eagle3``.
        draft_vocab_size: EAGLE-3's LM head rows (its ``draft_vocab_size``; the target's
            vocabulary when absent).
        target_vocab_size: the target's vocabulary (logits are returned over it).
        fc_bias: EAGLE's ``fc`` has a bias.
    """

    def __init__(self, cfg: ModelConfig, kind: str, draft_vocab_size: int, target_vocab_size: int,
                 fc_bias: bool = False, own_embedding: bool = False):
        super().__init__()
        H = cfg.hidden_size
        self.kind = kind
        self.target_vocab_size = target_vocab_size
        self.fc = ReplicatedLinear((3 if kind == "eagle3" else 2) * H, H, bias=fc_bias)
        self.self_attn = LlamaAttention(cfg)
        if kind == "eagle3":  # q/k/v over concat(embedding, feature)
            self.self_attn.qkv_proj = QKVParallelLinear(2 * H, cfg.head_dim, cfg.num_attention_heads,
                                                        cfg.num_key_value_heads, bias=cfg.qkv_bias)
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = ReplicatedLinear(H, draft_vocab_size)
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if own_embedding else None
        if self.embed_tokens is not None:
            self.embed_tokens.weight.requires_grad_(False)

    def attention_layers(self):
        return [self.self_attn.attn]

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta,
                fuse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over T rows.

        Args:
            embeds: [T, H] token embeddings; features: [T, H] (or [T, 3H] for EAGLE-3 rows
                that take the target's fused states); positions: int64 [T]; meta: attention
                metadata over the head's KV cache; fuse: bool, whether ``features`` are the
                target's (through ``fc``) or the head's own (EAGLE-3 only; EAGLE always fcs).
        Returns:
            ``(for_logits [T, H], next_features [T, H])``.
        """
        if self.kind == "eagle":
            h = self.fc(torch.cat([embeds, features], dim=-1))
            a = self.self_attn(positions, h, meta)
            x, residual = self.post_attention_layernorm(a, h)
            out = self.mlp(x) + residual
            return out, out
        if fuse:
            features = self.fc(features)
        residual = features
        h = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        a = self.self_attn(positions, h, meta)
        x, residual = self.post_attention_layernorm(a, residual)
        out = self.mlp(x) + residual
        return self.norm(out), out

    def compute_logits(self, h: torch.Tensor, target_lm_head) -> torch.Tensor:
        """float32 logits [T, target vocab]; EAGLE-3's draft vocabulary is scattered to the
        target's ids (-inf elsewhere)."""
        if self.kind == "eagle":
            return target_lm_head.compute_logits(h)
        small = self.lm_head(h).float()
        out = small.new_full((h.shape[0], self.target_vocab_size), float("-inf"))
        ids = torch.arange(small.shape[1], device=h.device) + self.d2t
        out[:, ids] = small
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint's tensors (EAGLE's ``layers.0.*`` or EAGLE-3's ``midlayer.*``
        names).  Returns the parameter names set; ValueError for an unknown tensor."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        done: set[str] = set()
        for name, t in weights:
            name = name.removeprefix("model.")
            for prefix in ("layers.0.", "midlayer."):
                name = name.replace(prefix, "") if name.startswith(prefix) else name
            if name == "t2d" or "rotary_emb" in name or (self.kind == "eagle" and name == "input_layernorm.weight"):
                continue
            if name == "d2t":
                buffers["d2t"].copy_(t.to(torch.int64))
                done.add(name)
                continue
            shard = None
            for src, dst, sid in ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
                                  (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", 0),
                                  (".up_proj.", ".gate_up_proj.", 1)):
                if src in f".{name}":
                    name, shard = f".{name}".replace(src, dst)[1:], sid
                    break
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"EAGLE checkpoint tensor {name!r} has no matching parameter")
            getattr(param, "weight_loader", default_weight_loader)(param, t.to(param.dtype), shard)
            done.add(name)
        return done


def read_head_config(folder: Path) -> tuple[ModelConfig, dict]:
    """The head's decoder shape and raw ``config.json`` (ModelConfigError when malformed)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"config.json: cannot be read: {e}") from None
    shaped = dict(raw, num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
    return ModelConfig.from_hf_dict(shaped), raw
