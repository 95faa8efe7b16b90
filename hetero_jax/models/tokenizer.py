"""Tokenizers: a byte-level one for the embedded presets, Hugging Face's for model directories.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_token_ids`, `bos_token_id`
and `special_token_ids` (what truncation keeps at the end of an input).
A model directory's tokenizer is built from its files only: code it ships (an `auto_map` in
`tokenizer_config.json` or `config.json`) is never imported and never asked about; a tokenizer
that needs it fails with a ValueError naming the directory.
"""
from __future__ import annotations

import os

from hetero_jax.models.config import read_json


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS=256, EOS=257. No download, no files."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    @property
    def eos_token_ids(self) -> tuple:
        return (self.eos_token_id,)

    @property
    def special_token_ids(self) -> frozenset:
        return frozenset((self.bos_token_id, self.eos_token_id))

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _auto_maps(model_dir: str) -> list:
    """The files of `model_dir` whose `auto_map` points transformers at code in the directory."""
    files = ("tokenizer_config.json", "config.json")
    return [f for f in files if os.path.isfile(os.path.join(model_dir, f))
            and "auto_map" in read_json(os.path.join(model_dir, f))]


class HFTokenizer:
    """transformers.AutoTokenizer from local files only, with the library's built-in classes."""

    def __init__(self, model_dir: str, eos_token_ids: tuple):
        from transformers import AutoTokenizer

        try:  # trust_remote_code=False: no prompt on a terminal, no import from model_dir
            self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                      trust_remote_code=False)
        except (ValueError, OSError) as e:
            custom = _auto_maps(model_dir)
            if not custom:
                raise
            raise ValueError(f"{model_dir}: the tokenizer needs custom code (auto_map in "
                             f"{', '.join(custom)}) and transformers has no built-in class "
                             f"for it; hetero-jax never runs code from a model directory") from e
        self.bos_token_id = self._tok.bos_token_id
        own = () if self._tok.eos_token_id is None else (self._tok.eos_token_id,)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids + own))
        self.special_token_ids = frozenset(self._tok.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


BYTE_TOKENIZER_CLASS = "hetero_jax.ByteTokenizer"  # tokenizer_config.json of a byte-level model


def load_tokenizer(model_dir: str, eos_token_ids: tuple):
    """The directory's tokenizer, or None when it ships none (token-id inputs only). A
    `tokenizer_config.json` whose `tokenizer_class` is `BYTE_TOKENIZER_CLASS` (the shipped
    build of `scripts/build_default_model.py`) means `ByteTokenizer`."""
    config = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config) and read_json(config).get("tokenizer_class") == BYTE_TOKENIZER_CLASS:
        return ByteTokenizer()
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    return HFTokenizer(model_dir, eos_token_ids)
