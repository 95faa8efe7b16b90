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

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template  # from a model directory's tokenizer_config.json

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
        except Exception as e:  # noqa: BLE001 - whatever the files do, the error names them
            custom = _auto_maps(model_dir)
            if custom:
                raise ValueError(f"{model_dir}: the tokenizer needs custom code (auto_map in "
                                 f"{', '.join(custom)}) and transformers has no built-in class "
                                 "for it; hetero-jax never runs code from a model directory"
                                 ) from e
            files = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
            raise ValueError(f"{model_dir}: its tokenizer files ({', '.join(files)}) cannot be "
                             f"loaded: {type(e).__name__}: {e}") from e
        self.bos_token_id = self._tok.bos_token_id
        own = () if self._tok.eos_token_id is None else (self._tok.eos_token_id,)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids + own))
        self.special_token_ids = frozenset(self._tok.all_special_ids)
        # what a chat template reads: its source (None: the model ships none) and specials
        self.chat_template = getattr(self._tok, "chat_template", None)
        self.bos_token, self.eos_token = self._tok.bos_token or "", self._tok.eos_token or ""
        # ids it can give: its length, or past it when a vocabulary file skips ids
        self.vocab_size = max(len(self._tok), max(self._tok.get_vocab().values(), default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


BYTE_TOKENIZER_CLASS = "hetero_jax.ByteTokenizer"  # tokenizer_config.json of a byte-level model


def check_tokenizer_files(model_dir: str) -> None:
    """ValueError naming the file when `tokenizer.json` or `tokenizer_config.json` is not a
    JSON object of the expected shape (before transformers reads them: its errors name no
    file, and random bytes took it 90 s to refuse)."""
    for name, keys in (("tokenizer.json", {"model": dict, "added_tokens": list}),
                       ("tokenizer_config.json", {})):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        raw = read_json(path)
        for key, kind in keys.items():
            if not isinstance(raw.get(key), kind):
                got = "nothing" if key not in raw else type(raw[key]).__name__
                raise ValueError(f"{path}: {key!r} must be a JSON "
                                 f"{'object' if kind is dict else 'list'} (got {got}): not a "
                                 "Hugging Face tokenizers file")


def load_tokenizer(model_dir: str, eos_token_ids: tuple, vocab_size: int | None = None):
    """The directory's tokenizer, or None when it ships none (token-id inputs only). A
    `tokenizer_config.json` whose `tokenizer_class` is `BYTE_TOKENIZER_CLASS` (the build of
    `scripts/build_default_model.py`) means `ByteTokenizer`. With `vocab_size` (the model's),
    a tokenizer of more tokens is refused naming its file."""
    files = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
    if not files:
        return None
    check_tokenizer_files(model_dir)
    config = os.path.join(model_dir, "tokenizer_config.json")
    settings = read_json(config) if os.path.isfile(config) else {}
    if settings.get("tokenizer_class") == BYTE_TOKENIZER_CLASS:
        template = settings.get("chat_template")
        return ByteTokenizer(template if isinstance(template, str) else None)
    tokenizer = HFTokenizer(model_dir, eos_token_ids)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{os.path.join(model_dir, files[0])}: the tokenizer has "
                         f"{tokenizer.vocab_size} tokens (ids up to {tokenizer.vocab_size - 1}), "
                         f"more than the model's vocab_size={vocab_size} (config.json): the "
                         "tokenizer of another model?")
    return tokenizer
