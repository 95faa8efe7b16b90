"""Tokenizers: a byte-level one for the embedded presets, Hugging Face's for model directories.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_token_ids`, `bos_token_id`.
"""
from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS=256, EOS=257. No download, no files."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    @property
    def eos_token_ids(self) -> tuple:
        return (self.eos_token_id,)

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """transformers.AutoTokenizer from local files only."""

    def __init__(self, model_dir: str, eos_token_ids: tuple):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.bos_token_id = self._tok.bos_token_id
        own = () if self._tok.eos_token_id is None else (self._tok.eos_token_id,)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids + own))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_dir: str, eos_token_ids: tuple):
    """The directory's tokenizer, or None when it ships none (token-id inputs only)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    return HFTokenizer(model_dir, eos_token_ids)
