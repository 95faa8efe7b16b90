"""Static description of a Llama-family decoder, read from a Hugging Face `config.json`, and
the checked JSON reading every model file goes through.

`ModelConfig` is frozen and hashable: it is a static argument of every jitted function. A file
that is not valid JSON, lacks a key or holds a size that is not a positive integer fails with a
ValueError naming the file and the key (`read_json`, `positive_int`), never a JSONDecodeError
or KeyError.
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
        for name in _SIZES:
            check_positive(name, getattr(self, name), int)
        for name in ("rms_norm_eps", "rope_theta"):
            check_positive(name, getattr(self, name), (int, float))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        per_layer = attn + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d


# The decoder's projections a LoRA adapter may adapt (`lora.projection_dims`), by param name.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "max_position_embeddings")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


def check_positive(name: str, value, kind=int, where: str = "") -> None:
    """A positive `kind` (int, or (int, float) for a number), never a bool; else a ValueError
    that starts with `where` (the file)."""
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "integer" if kind is int else "number"
        raise ValueError(f"{where}{name}={value!r} must be a positive {what}")


def read_json(path: str, kind: type = dict):
    """The JSON value of the file `path`, which must be a `kind` (dict or list)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, kind):
        raise ValueError(f"{path}: expected a JSON {'object' if kind is dict else 'list'}, "
                         f"got {type(raw).__name__}")
    return raw


def require(raw: dict, key: str, source: str):
    """raw[key], or a ValueError naming `source` (the file, and where in it) and the key."""
    if key not in raw:
        raise ValueError(f"{source} missing key {key!r}")
    return raw[key]


def positive_int(raw: dict, key: str, source: str, default: int | None = None) -> int:
    """raw[key] as a positive int (`default` when absent or null, unless that is None)."""
    value = raw.get(key)
    if value is None and default is None:
        raise ValueError(f"{source} missing key {key!r}")
    value = default if value is None else value
    check_positive(key, value, int, f"{source} ")
    return value


def _rope_scaling(raw: dict | None, source: str) -> tuple:
    if not raw:
        return ()
    if not isinstance(raw, dict):
        raise ValueError(f"{source} rope_scaling={raw!r} must be a JSON object")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return ()
    if kind != "llama3":
        raise ValueError(f"{source} unsupported rope_scaling type {kind!r}; supported: 'llama3'")
    for key in _LLAMA3_ROPE_KEYS:
        require(raw, key, f"{source} rope_scaling")
    return tuple(sorted((k, v) for k, v in raw.items() if k != "type"))


def _eos_ids(raw) -> tuple:
    if raw is None:
        return ()
    return tuple(raw) if isinstance(raw, (list, tuple)) else (raw,)


def check_special_ids(hf: dict, vocab: int, where: str) -> None:
    """bos_token_id and eos_token_id (one id or a list) are token ids in [0, vocab_size), or
    absent: an EOS outside the vocabulary could never stop a generation."""
    for key in ("bos_token_id", "eos_token_id"):
        value = hf.get(key)
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool)
                                         and 0 <= i < vocab for i in ids):
            what = "a token id or a list of them" if key == "eos_token_id" else "a token id"
            raise ValueError(f"{where} {key}={value!r} must be {what} in [0, vocab_size={vocab})")


def model_config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Map a Hugging Face config dict to a ModelConfig; unsupported architectures fail here."""
    archs = hf.get("architectures") or [ARCH_OF_MODEL_TYPE.get(hf.get("model_type"), "")]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{source}: unsupported architectures {archs}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias/mlp_bias in a {arch} is not supported")
    where = f"{source}:"
    hidden, heads = positive_int(hf, "hidden_size", where), positive_int(hf, "num_attention_heads",
                                                                         where)
    check_special_ids(hf, positive_int(hf, "vocab_size", where), where)
    rope_params = hf.get("rope_parameters") or {}
    fields = dict(
        vocab_size=positive_int(hf, "vocab_size", where), hidden_size=hidden,
        intermediate_size=positive_int(hf, "intermediate_size", where),
        num_layers=positive_int(hf, "num_hidden_layers", where), num_heads=heads,
        num_kv_heads=positive_int(hf, "num_key_value_heads", where, heads),
        head_dim=positive_int(hf, "head_dim", where, hidden // heads),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(hf.get("rope_scaling") or rope_params, where),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", where, 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")))
    try:
        return ModelConfig(**fields)
    except ValueError as e:  # a relation between fields (heads) or a non-numeric norm/theta
        raise ValueError(f"{source}: {e}") from e


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a model directory needs a config.json")
    return read_json(path)
