"""The encoder runner: batches token-id inputs for a separate BERT-family embedding model.

In: lists of token ids with a pooling kind and a normalisation flag per input (host data).
Out: `np.ndarray [N, d]` float32 in input order. Inputs are sorted by length, cut into batches
of at most the largest batch bucket, and each batch is padded to a (batch, length) bucket and
run by one ahead-of-time compiled `(params, batch) -> [B, d]` executable: encoder, pooling and
normalisation all on the device, then one device->host copy per batch. Pooling kind and
normalisation are per-row arrays, so changing them never recompiles; `compiles` counts the
executables and `warmup()` builds every bucket variant.

Pooling reads `last_hidden_state` over each row's real tokens: mean, weighted_mean (weight of
token j proportional to j, 1-based, as sentence-transformers' weightedmean), cls (first token)
and last (last real token); optional L2 normalisation. The pooling of a sentence-transformers
directory is read by `read_sentence_transformers_pooling`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.compile_cache import CompileCache
from hetero_jax.config import pad_to_bucket
from hetero_jax.models import bert, llama
from hetero_jax.params import POOLING_KINDS, STREAMING_KINDS  # the encoder has no buffered head

_ST_MODES = {"mean": "mean", "weightedmean": "weighted_mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean",
                   "pooling_mode_lasttoken": "lasttoken"}


def read_sentence_transformers_pooling(model_dir: str) -> tuple[str, bool]:
    """(pooling kind, normalize) from `modules.json` and its Pooling module's `config.json`.

    ("mean", False) when the directory has no `modules.json` or it lists no Pooling module.
    Reads both the legacy `pooling_mode_*_tokens` booleans and the newer `pooling_mode` key.
    """
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return "mean", False
    with open(modules_path) as f:
        modules = json.load(f)
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return "mean", normalize
    path = os.path.join(model_dir, kinds["Pooling"]["path"], "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {modules_path} lists a Pooling module there")
    with open(path) as f:
        raw = json.load(f)
    modes = raw.get("pooling_mode") or [m for k, m in _ST_LEGACY_KEYS.items() if raw.get(k)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling modes {modes} are not supported; supported: exactly "
                         f"one of {', '.join(_ST_MODES)}")
    return _ST_MODES[modes[0]], normalize


@flax.struct.dataclass
class EncodeBatch:
    token_ids: jax.Array  # [B, N] int32, right-padded with 0
    lengths: jax.Array  # [B] int32; 0 for padding rows
    pooling: jax.Array  # [B] int32 index into POOLING_KINDS
    normalize: jax.Array  # [B] bool


def pool(hidden, lengths, pooling, normalize):
    """hidden [B, N, d], lengths/pooling/normalize [B] -> fp32 vectors [B, d]."""
    h = hidden.astype(jnp.float32)
    n = h.shape[1]
    pos = jnp.arange(1, n + 1, dtype=jnp.float32)[None, :]  # [1, N], 1-based
    valid = pos <= lengths[:, None]  # [B, N]
    weights = jnp.stack([valid, valid * pos]).astype(jnp.float32)  # [2, B, N]: mean, weighted
    sums = jnp.einsum("wbn,bnd->wbd", weights, h) / jnp.maximum(
        weights.sum(-1, keepdims=True), 1.0)  # [2, B, d]
    last = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    vec = jnp.stack([sums[0], sums[1], h[:, 0], last])  # [kinds, B, d]
    vec = jnp.take_along_axis(vec, pooling[None, :, None], axis=0)[0]  # [B, d]
    norm = jnp.maximum(jnp.linalg.norm(vec, axis=-1, keepdims=True), 1e-12)
    return jnp.where(normalize[:, None], vec / norm, vec)


def embed_step(params, batch: EncodeBatch, *, cfg: bert.BertConfig):
    """One encoder pass and its pooling: -> fp32 [B, d]."""
    hidden = bert.encode(params, cfg, batch.token_ids, batch.lengths)
    return pool(hidden, batch.lengths, batch.pooling, batch.normalize)


def _per_input(value, n: int, name: str) -> list:
    values = [value] * n if isinstance(value, (str, bool)) else list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} inputs")
    return values


class EncoderRunner:
    """Owns the encoder's params on the device; embeds batches; counts compiles."""

    def __init__(self, cfg: bert.BertConfig, params, batch_buckets=(1, 2, 4, 8, 16, 32),
                 length_buckets=(16, 32, 64, 128, 256, 512), layer_loop: str = "auto"):
        if list(batch_buckets) != sorted(batch_buckets) or list(length_buckets) != sorted(
                length_buckets):
            raise ValueError(f"buckets must be ascending: {batch_buckets=}, {length_buckets=}")
        self.cfg, self.max_len = cfg, cfg.max_position_embeddings
        self.batch_buckets = tuple(batch_buckets)
        # Buckets above the position limit are dropped; the limit itself is always a bucket.
        self.length_buckets = tuple(b for b in length_buckets if b < self.max_len) + (
            self.max_len,)
        self.params = llama.for_layer_loop(params, layer_loop)
        self.executable = CompileCache(self._compile)  # (B, N) -> compiled step

    @property
    def compiles(self) -> int:
        return len(self.executable)

    @property
    def compile_s(self) -> float:
        return self.executable.seconds

    def _compile(self, key: tuple):
        b, n = key
        spec = EncodeBatch(token_ids=jax.ShapeDtypeStruct((b, n), jnp.int32),
                           lengths=jax.ShapeDtypeStruct((b,), jnp.int32),
                           pooling=jax.ShapeDtypeStruct((b,), jnp.int32),
                           normalize=jax.ShapeDtypeStruct((b,), jnp.bool_))
        fn = jax.jit(functools.partial(embed_step, cfg=self.cfg))
        return fn.lower(self.params, spec).compile()

    def warmup(self) -> int:
        """Compile every (batch, length) bucket variant; returns the number of compiles."""
        for b in self.batch_buckets:
            for n in self.length_buckets:
                self.executable((b, n))
        return self.compiles

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """Raise ValueError for an input that cannot be embedded, before any work starts."""
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_len:
                raise ValueError(f"input {i} has {len(ids)} tokens, more than the encoder's "
                                 f"limit of {self.max_len} (max_position_embeddings)")
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"input {i} has token id {lo if lo < 0 else hi} outside "
                                 f"[0, {self.cfg.vocab_size})")

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str | Sequence[str] = "mean",
              normalize: bool | Sequence[bool] = False) -> np.ndarray:
        """Token-id lists -> fp32 `[N, d]` in input order; pooling/normalize per input or one."""
        kinds = _per_input(pooling, len(inputs), "pooling")
        norms = _per_input(normalize, len(inputs), "normalize")
        unknown = sorted(set(kinds) - set(STREAMING_KINDS))
        if unknown:
            raise ValueError(f"unknown pooling {unknown}; expected one of {STREAMING_KINDS}")
        self.check(inputs)
        out = np.zeros((len(inputs), self.cfg.hidden_size), np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        step = self.batch_buckets[-1]
        for start in range(0, len(order), step):
            rows = order[start:start + step]
            b = pad_to_bucket(len(rows), self.batch_buckets)
            n = pad_to_bucket(max(len(inputs[i]) for i in rows), self.length_buckets)
            batch = EncodeBatch(token_ids=np.zeros((b, n), np.int32),
                                lengths=np.zeros(b, np.int32), pooling=np.zeros(b, np.int32),
                                normalize=np.zeros(b, bool))
            for r, i in enumerate(rows):
                batch.token_ids[r, :len(inputs[i])] = inputs[i]
                batch.lengths[r] = len(inputs[i])
                batch.pooling[r] = POOLING_KINDS.index(kinds[i])
                batch.normalize[r] = bool(norms[i])
            out[rows] = np.asarray(self.executable((b, n))(self.params, batch))[:len(rows)]
        return out


@dataclasses.dataclass
class SeparateEncoder:
    """An embedding model beside the decoder: its runner, tokenizer and default pooling."""

    runner: EncoderRunner
    tokenizer: object
    pooling: str
    normalize: bool

    @classmethod
    def from_pretrained(cls, model_dir: str, dtype=jnp.float32) -> "SeparateEncoder":
        from hetero_jax.tokenizer import load_tokenizer

        cfg, params = bert.load_bert(model_dir, dtype)
        pooling, normalize = read_sentence_transformers_pooling(model_dir)
        return cls(EncoderRunner(cfg, params), load_tokenizer(model_dir, ()), pooling, normalize)
