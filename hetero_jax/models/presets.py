"""Embedded models with the byte-level tokenizer, no download.

- `mini`: 1.9M parameters (7.6 MB in fp32), trained (`scripts/build_default_model.py`): it
  answers "Question: ...about <title>...\nAnswer:" with a sentence of the bundled corpus
  (`data/corpus.jsonl`), and its LoRA embedding adapter retrieves the passage a question asks
  about. The default model of `batch`, `generate`, `embed` and `serve`.
- `tiny`: 2.6M parameters, random weights from a seed, for tests.
- `small`: 104.6M parameters (418 MB in fp32), random, so that decode is memory-bound on a
  CPU whose last-level cache is tens of MB.
- `llama-8b-shape`: Llama-3-8B's shapes (32 query heads, 8 KV heads, head_dim 128, hidden
  4096, MLP 14336, vocabulary 128,256) with 4 of its 32 layers (1.9B parameters), random, for
  GPU benchmarks (`scripts/gpu_check.sh`): per layer it moves and computes what the 8B does.

A preset named in `SHIPPED` is a trained model directory in `preset_weights/<name>` (with its
LoRA embedding adapter in `adapter/`); the others are random from a seed, for tests and
benchmarks.
"""
from __future__ import annotations

import os
import re

from hetero_jax.models.config import ModelConfig
from hetero_jax.models.tokenizer import ByteTokenizer

_VOCAB = 512  # ByteTokenizer ids fit; padded to a round size for the LM head.

PRESETS = {
    # 4 heads of 64: in training, attention (heads x length^2) is most of a step at this size
    "mini": ModelConfig(vocab_size=_VOCAB, hidden_size=256, intermediate_size=512, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=2048,
                        tie_word_embeddings=True, bos_token_id=ByteTokenizer.bos_token_id,
                        eos_token_ids=(ByteTokenizer.eos_token_id,)),
    "tiny": ModelConfig(vocab_size=_VOCAB, hidden_size=256, intermediate_size=512, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=2048,
                        bos_token_id=ByteTokenizer.bos_token_id,
                        eos_token_ids=(ByteTokenizer.eos_token_id,)),
    "small": ModelConfig(vocab_size=_VOCAB, hidden_size=768, intermediate_size=3072,
                         num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
                         max_position_embeddings=4096, bos_token_id=ByteTokenizer.bos_token_id,
                         eos_token_ids=(ByteTokenizer.eos_token_id,)),
    "llama-8b-shape": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128,
                                  max_position_embeddings=8192, rope_theta=500000.0,
                                  bos_token_id=ByteTokenizer.bos_token_id,
                                  eos_token_ids=(ByteTokenizer.eos_token_id,)),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}"
                         f"{_hub_hint(name, ' (a model directory goes to from_pretrained)')}")
    return PRESETS[name]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name


def _hub_hint(path: str, otherwise: str = "") -> str:
    """What to do when `path` names a Hugging Face Hub model rather than a local directory."""
    if not _HUB_ID.fullmatch(path) or os.path.exists(path):
        return otherwise
    return (f". {path!r} looks like a Hugging Face Hub id: hetero-jax fetches nothing at run "
            f"time; download it first (huggingface-cli download {path} --local-dir DIR) and "
            "pass DIR")


def require_local_dir(path: str, what: str = "model") -> str:
    """`path` if it is a local directory, else a FileNotFoundError that says so (and, for a
    Hub id, how to download it)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the {what} path is a {type(path).__name__}; expected a directory")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} directory {path!r} does not exist{_hub_hint(path)}")
    return path


# presets whose trained weights ship in preset_weights/<name> (a model directory with its
# embedding adapter in adapter/); the others are random from a seed
SHIPPED = ("mini",)


def preset_dir(name: str) -> str | None:
    """The model directory of a preset shipped with trained weights, else None (random)."""
    if name not in SHIPPED:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "preset_weights", name)
