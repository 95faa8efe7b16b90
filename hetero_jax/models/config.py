"""Static description of a Llama-family decoder, read from a Hugging Face `config.json`.

`ModelConfig` is frozen and hashable: it is a static argument of every jitted function.
"""
from __future__ import annotations

import dataclasses
import json
import os

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 rope scaling as a sorted tuple of (key, value) pairs, hashable; () when absent.
    rope_scaling: tuple = ()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        per_layer = attn + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d


def _rope_scaling(raw: dict | None) -> tuple:
    if not raw:
        return ()
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return ()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: 'llama3'")
    return tuple(sorted((k, v) for k, v in raw.items() if k != "type"))


def _eos_ids(raw) -> tuple:
    if raw is None:
        return ()
    return tuple(raw) if isinstance(raw, (list, tuple)) else (raw,)


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Map a Hugging Face config dict to a ModelConfig; unsupported architectures fail here."""
    archs = hf.get("architectures") or [ARCH_OF_MODEL_TYPE.get(hf.get("model_type"), "")]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{source}: unsupported architectures {archs}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias/mlp_bias in a {arch} is not supported")
    heads = hf["num_attention_heads"]
    rope_params = hf.get("rope_parameters") or {}
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope_params),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        sliding_window=window,
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a model directory needs a config.json")
    with open(path) as f:
        return json.load(f)
