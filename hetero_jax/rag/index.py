"""An exact cosine-similarity vector index on the device, and filling it from an engine.

In: vectors `[n, d]` (any norm) with their documents and ids, or documents embedded by an
`Engine` (`from_engine`) or any `EngineClient` (`build_index`). Out: `search(queries, k) ->
(scores [Q, k], rows [Q, k])`.

`VectorIndex` keeps L2-normalised fp32 vectors `[C, d]` on the device; the capacity C is a
power-of-two bucket and rows past `size` are zero. `search` is one jitted matmul, a mask of
the rows past `size` and `lax.top_k`, compiled ahead of time per (C, query bucket, k bucket);
`size` is an array argument, so adding documents within a capacity bucket never recompiles.
`add` writes rows with a jitted scatter that donates the old buffer.
"""
from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.sched.shapes import pad_to_bucket
from hetero_jax.requests import PoolingParams
from hetero_jax.runner.executables import ExecutableCache
from hetero_jax.runner.pooler import l2_normalize

_CAPACITY_BUCKETS = tuple(2**i for i in range(6, 27))  # 64 .. 64M rows
_QUERY_BUCKETS = tuple(2**i for i in range(11))  # 1 .. 1024 queries per search call
_WRITE_BUCKETS = tuple(2**i for i in range(3, 11))  # 8 .. 1024 rows per write
_K_BUCKETS = tuple(2**i for i in range(27))  # 1 .. the largest capacity


def search_step(vectors, size, queries, *, k: int):
    """vectors [C, d] unit rows, size [] int32, queries [Q, d] -> (scores [Q, k], rows [Q, k]).

    Cosine similarity by one matmul; rows at or past `size` score -inf, so they come last.
    """
    scores = jnp.matmul(l2_normalize(queries), vectors.T,
                        precision=jax.lax.Precision.HIGHEST)  # [Q, C]
    valid = jnp.arange(vectors.shape[0]) < size  # [C]
    return jax.lax.top_k(jnp.where(valid[None, :], scores, -jnp.inf), k)


def write_step(vectors, rows, start, count):
    """vectors [C, d] (donated), rows [M, d], start/count [] int32 -> [C, d] with the first
    `count` rows normalised into positions start..start+count; padding rows are dropped."""
    m = rows.shape[0]
    pos = jnp.where(jnp.arange(m) < count, start + jnp.arange(m), vectors.shape[0])  # [M]
    return vectors.at[pos].set(l2_normalize(rows), mode="drop")


class VectorIndex:
    """An exact cosine-similarity index on the device, with the documents and ids beside it."""

    def __init__(self, dim: int, min_capacity: int = 64):
        if dim < 1:
            raise ValueError(f"dim={dim} must be >= 1")
        self.dim = dim
        self.size = 0
        self.docs: list = []  # row -> document text (or None)
        self.ids: list = []  # row -> caller's id
        self._buckets = tuple(c for c in _CAPACITY_BUCKETS if c >= min_capacity)
        self._vectors = jnp.zeros((self._buckets[0], dim), jnp.float32)  # [C, d]
        self._executables = ExecutableCache(self._compile)

    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return self._vectors.shape[0]

    @property
    def compiles(self) -> int:
        """Search and write executables compiled so far."""
        return len(self._executables)

    @property
    def vectors(self) -> np.ndarray:
        """The stored unit vectors `[size, d]` (a device->host copy)."""
        return np.asarray(self._vectors[:self.size])

    @classmethod
    def from_engine(cls, engine, docs: Sequence[str], ids: Sequence | None = None,
                    params: PoolingParams | None = None, min_capacity: int = 64) -> "VectorIndex":
        """Embed `docs` with a synchronous `Engine` (one heterogeneous run) and index them."""
        docs = _check_docs(docs)
        try:
            vectors = engine.embed(docs, params, use_tqdm=False)  # [N, d]
        except ValueError as e:
            raise ValueError(f"cannot index the documents: {e}") from e
        index = cls(vectors.shape[1], min_capacity)
        index.add(vectors, docs, ids)
        return index

    def add(self, vectors, docs: Sequence | None = None, ids: Sequence | None = None) -> np.ndarray:
        """Append vectors `[n, d]` (normalised on the device) with their documents and ids
        (default: the row numbers); returns the rows they got."""
        rows = np.asarray(vectors, np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"vectors have shape {rows.shape}; expected [n, {self.dim}]")
        if not np.isfinite(rows).all():
            raise ValueError("vectors contain NaN or inf")
        n, start = rows.shape[0], self.size
        docs = [None] * n if docs is None else list(docs)
        ids = list(range(start, start + n)) if ids is None else list(ids)
        if len(docs) != n or len(ids) != n:
            raise ValueError(f"{n} vectors but {len(docs)} documents and {len(ids)} ids")
        if start + n > self.capacity:
            cap = pad_to_bucket(start + n, self._buckets)
            self._vectors = jnp.zeros((cap, self.dim), jnp.float32).at[:self.capacity].set(
                self._vectors)
        step = _WRITE_BUCKETS[-1]
        for lo in range(0, n, step):
            chunk = rows[lo:lo + step]
            padded = np.zeros((pad_to_bucket(len(chunk), _WRITE_BUCKETS), self.dim), np.float32)
            padded[:len(chunk)] = chunk
            write = self._executables(("write", self.capacity, padded.shape[0]))
            self._vectors = write(self._vectors, padded, np.int32(start + lo), np.int32(len(chunk)))
        self.size += n
        self.docs += docs
        self.ids += ids
        return np.arange(start, start + n)

    def check_k(self, k: int) -> None:
        """Raise ValueError unless 1 <= k <= size."""
        if self.size == 0:
            raise ValueError("the index is empty: add documents before searching")
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= self.size:
            raise ValueError(f"k={k!r} must be an integer in [1, {self.size}] (the index size)")

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries `[Q, d]` (or `[d]`) -> (scores `[Q, k]` fp32, rows `[Q, k]` int32), best first.

        Scores are cosine similarities; queries need not be normalised.
        """
        self.check_k(k)
        q = np.asarray(queries, np.float32)
        single = q.ndim == 1
        q = q[None] if single else q
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries have shape {np.shape(queries)}; expected [Q, {self.dim}]")
        if not np.isfinite(q).all():
            raise ValueError("queries contain NaN or inf")
        kb = min(pad_to_bucket(k, _K_BUCKETS), self.capacity)
        scores, rows = [np.zeros((0, k), np.float32)], [np.zeros((0, k), np.int32)]
        step = _QUERY_BUCKETS[-1]
        for lo in range(0, len(q), step):
            chunk = q[lo:lo + step]
            padded = np.zeros((pad_to_bucket(len(chunk), _QUERY_BUCKETS), self.dim), np.float32)
            padded[:len(chunk)] = chunk
            fn = self._executables(("search", self.capacity, padded.shape[0], kb))
            s, r = jax.device_get(fn(self._vectors, np.int32(self.size), padded))
            scores.append(s[:len(chunk), :k])
            rows.append(r[:len(chunk), :k])
        scores, rows = np.concatenate(scores), np.concatenate(rows)
        return (scores[0], rows[0]) if single else (scores, rows)

    def warmup(self, k: int, num_queries: int = 1) -> int:
        """Compile the search for the current capacity; returns the compile count."""
        self.check_k(k)
        kb = min(pad_to_bucket(k, _K_BUCKETS), self.capacity)
        self._executables(("search", self.capacity, pad_to_bucket(num_queries, _QUERY_BUCKETS), kb))
        return self.compiles

    def _compile(self, key: tuple):
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        if key[0] == "search":
            _, c, q, k = key
            fn = jax.jit(functools.partial(search_step, k=k))
            return fn.lower(f32(c, self.dim), i32, f32(q, self.dim)).compile()
        _, c, m = key
        return jax.jit(write_step, donate_argnums=0).lower(f32(c, self.dim), f32(m, self.dim),
                                                             i32, i32).compile()


def check_text(text, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name} is a {type(text).__name__}; expected a string")
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text


def _check_docs(docs) -> list[str]:
    docs = [docs] if isinstance(docs, str) else list(docs)
    return [check_text(d, f"document {i}") for i, d in enumerate(docs)]


async def build_index(front, docs: Sequence[str], ids: Sequence | None = None,
                      params: PoolingParams | None = None, min_capacity: int = 64) -> VectorIndex:
    """Embed `docs` through an `EngineClient` (one request each, batched by its engine) and
    index them (a synchronous `Engine`: `VectorIndex.from_engine`). A bad document raises
    ValueError naming it."""
    docs = _check_docs(docs)

    async def one(i: int, doc: str) -> np.ndarray:
        try:
            return (await front.embed(doc, params)).embedding
        except ValueError as e:
            raise ValueError(f"document {i}: {e}") from e

    tasks = [asyncio.ensure_future(one(i, d)) for i, d in enumerate(docs)]
    try:
        vectors = np.stack(await asyncio.gather(*tasks))  # [N, d]
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    index = VectorIndex(vectors.shape[1], min_capacity)
    index.add(vectors, docs, ids)
    return index


def load_corpus(path: str) -> tuple[list, list[str]]:
    """A JSON-lines corpus with `id` and `text` (and optional `title`) -> (ids, texts)."""
    ids, texts = [], []
    with open(path) as f:
        for line in filter(str.strip, f):
            row = json.loads(line)
            ids.append(row["id"])
            texts.append(f"{row['title']}: {row['text']}" if row.get("title") else row["text"])
    return ids, texts
