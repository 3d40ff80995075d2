"""The model's shape, read from a Hugging Face ``config.json`` (or the config transformers
derives from a GGUF file).  Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: ``architectures`` / ``model_type`` values this runtime can run (Llama family).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one Kiln's model code implements."""


class ModelConfigError(UnsupportedModelError):
    """config.json is malformed: not an object, a missing field, a size that is not a positive
    integer.  A subclass of UnsupportedModelError, so callers that refuse unsupported models
    (``kiln build``, ``kiln serve``: one line, exit 2) refuse these too."""


def _size(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    """``cfg[name]`` as a positive int (an integral float such as 4096.0 counts; a bool does
    not); ``default`` when it is missing or null.

    Raises:
        ModelConfigError: missing without a default, or not a positive integer.
    """
    value = cfg.get(name)
    if value is None:
        if default is None:
            raise ModelConfigError(f"config.json: required field {name} is missing")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
    return value


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Fields follow Hugging Face names.  ``rope_scaling`` is None or a dict with
    ``rope_type`` in {"llama3", "linear", "default"} (Llama 3.1 uses "llama3").
    ``qkv_bias`` is True for Qwen2 (biases on the q/k/v projections).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    torch_dtype: str | None = None  # dtype the checkpoint was saved in, e.g. "bfloat16"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a ``config.json`` dict.

        Raises:
            UnsupportedModelError: the architecture is not Llama/Mistral/Qwen2 or uses a
                feature this runtime lacks (non-SiLU activation, unknown RoPE scaling).
            ModelConfigError (an UnsupportedModelError): ``cfg`` is not a dict, a required
                size is missing, a size is not a positive integer, the head counts do not
                divide, or ``architectures`` is neither a name nor a list of names.
        """
        if not isinstance(cfg, dict):
            got = "null" if cfg is None else type(cfg).__name__
            raise ModelConfigError(f"config.json: expected a JSON object, got {got}")
        archs = cfg.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelConfigError(f"config.json: architectures must be a list of names, got {archs!r}")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
            if not known:
                raise UnsupportedModelError(
                    f"unsupported architecture {archs or model_type!r}: Kiln runs "
                    f"{sorted(SUPPORTED_ARCHITECTURES)}"
                )
            model_type = known[0]
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}: Kiln's MLP is SwiGLU (silu)")
        sizes = {name: _size(cfg, name) for name in
                 ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
        hidden, num_heads = sizes["hidden_size"], sizes["num_attention_heads"]
        num_kv_heads = _size(cfg, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(f"config.json: num_attention_heads ({num_heads}) must be divisible by "
                                   f"num_key_value_heads ({num_kv_heads})")
        if cfg.get("head_dim") is None and hidden % num_heads:
            raise ModelConfigError(f"config.json: hidden_size ({hidden}) must be divisible by num_attention_heads "
                                   f"({num_heads}) when head_dim is not given")
        head_dim = _size(cfg, "head_dim", hidden // num_heads)
        max_pos = _size(cfg, "max_position_embeddings", 2048)
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta", 10000.0)
        # transformers 5 folds theta and scaling into ``rope_parameters``.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = rtype
            if rtype == "default":
                rope_scaling = None
            elif rtype not in ("llama3", "linear"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {rtype!r} (supported: llama3, linear)")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        qkv_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            **sizes,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act="silu",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers can load as the matching architecture."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = False
        if self.torch_dtype:
            d["torch_dtype"] = self.torch_dtype
        return d

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h
