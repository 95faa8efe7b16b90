"""The encoder runner: batches whole inputs for a separate BERT-family embedding model.

In: token-id inputs with a pooling kind and a normalisation flag each (`embed`), or the
scheduler's encoder items of one step (`execute`, plain data whose `EmbedKnobs` carry both).
Out: fp32 vectors `[N, d]` in input order (`embed`), or a `RunnerOutput` with one embedding
per item. Inputs are sorted by length, cut into batches of at most the largest batch bucket,
and each batch is padded to a (batch, length) bucket and run by one ahead-of-time compiled
`(params, batch) -> [B, d]` executable: encoder, pooling and normalisation all on the device,
then one device->host copy per batch. Pooling kind and normalisation are per-row arrays, so
changing them never recompiles; `compiles` counts the executables and `warmup()` builds every
bucket variant. Inputs were validated by the serving layer; here only shapes are asserted.

Pooling reads `last_hidden_state` over each row's real tokens: mean, weighted_mean (weight of
token j proportional to j, 1-based, as sentence-transformers' weightedmean), cls (first token)
and last (last real token), then `pooler.select_and_normalize`.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.sched.shapes import pad_to_bucket
from hetero_jax.models import bert
from hetero_jax.models.layers import for_layer_loop, is_unrolled
from hetero_jax.requests import POOLING_KINDS, STREAMING_KINDS
from hetero_jax.runner.executables import ExecutableCache
from hetero_jax.runner.pooler import select_and_normalize
from hetero_jax.sched import RunnerOutput


@flax.struct.dataclass
class EncodeBatch:
    token_ids: jax.Array  # [B, N] int32, right-padded with 0
    lengths: jax.Array  # [B] int32; 0 for padding rows
    pooling: jax.Array  # [B] int32 index into POOLING_KINDS (a streaming kind)
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
    return select_and_normalize(jnp.stack([sums[0], sums[1], h[:, 0], last]), pooling,
                                normalize)


def embed_step(params, batch: EncodeBatch, *, cfg: bert.BertConfig):
    """One encoder pass and its pooling: -> fp32 [B, d]."""
    model = bert.BertEncoder(cfg, unrolled=is_unrolled(params))
    hidden = model.apply({"params": params}, batch.token_ids, batch.lengths)  # [B, N, d]
    return pool(hidden, batch.lengths, batch.pooling, batch.normalize)


def _per_input(value, n: int) -> list:
    values = [value] * n if isinstance(value, (str, bool)) else list(value)
    assert len(values) == n, f"{len(values)} values for {n} inputs"
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
        self.params = for_layer_loop(params, layer_loop)
        self.executable = ExecutableCache(self._compile)  # (B, N) -> compiled step

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

    def embed(self, inputs: Sequence[Sequence[int]], pooling: str | Sequence[str] = "mean",
              normalize: bool | Sequence[bool] = False) -> np.ndarray:
        """Token-id lists -> fp32 `[N, d]` in input order; pooling/normalize per input or one."""
        kinds = [POOLING_KINDS.index(k) for k in _per_input(pooling, len(inputs))]
        assert all(POOLING_KINDS[k] in STREAMING_KINDS for k in kinds), f"{pooling=}"
        return self._embed(inputs, kinds, _per_input(normalize, len(inputs)))

    def execute(self, items: list) -> RunnerOutput:
        """The encoder items of one step (whole inputs) -> their embeddings; `step_time`
        leaves out compiling, as the decoder's does."""
        t0, compile0 = time.perf_counter(), self.compile_s
        vectors = self._embed([it.token_ids for it in items], [it.knobs.kind for it in items],
                              [it.knobs.normalize for it in items])
        return RunnerOutput(embeddings={it.request_id: v for it, v in zip(items, vectors)},
                            step_time=time.perf_counter() - t0 - (self.compile_s - compile0))

    def _embed(self, inputs: Sequence, kinds: list, norms: list) -> np.ndarray:
        assert all(0 < len(ids) <= self.max_len for ids in inputs), f"{self.max_len=}"
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
                batch.pooling[r], batch.normalize[r] = kinds[i], bool(norms[i])
            out[rows] = np.asarray(self.executable((b, n))(self.params, batch))[:len(rows)]
        return out
