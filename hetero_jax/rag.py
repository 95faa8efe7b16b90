"""Iterative retrieval (Iter-RetGen, Shao et al. 2023) on the heterogeneous engine.

In: documents and questions (strings) and an `AsyncEngine` (an `Engine` also builds an index).
Out: a `VectorIndex` on the device and, per question, an `IterRetGenResult`.

`VectorIndex` keeps L2-normalised fp32 vectors `[C, d]` on the device; the capacity C is a
power-of-two bucket and rows past `size` are zero. `search` is one jitted matmul, a mask of
the rows past `size` and `lax.top_k`, compiled ahead of time per (C, query bucket, k bucket);
`size` is an array argument, so adding documents within a capacity bucket never recompiles.
`add` writes rows with a jitted scatter that donates the old buffer.

`run_iter_retgen` is one question's program, a coroutine on the event loop:
embed(question) -> [search -> generate(prompt(docs, question)) -> embed(question + generation)]
x iterations (the last embed is skipped: nothing would search with it). Embeds and generates go
through the AsyncEngine, whose one stepper thread batches them with every other coroutine's
requests in heterogeneous steps; the search runs on the loop (one small device call). A bad
question raises in its own coroutine before any request is made; `iter_retgen_many` runs many
questions and returns each one's result or exception in its slot. Any front with async
`embed`/`generate` and an `engine` carrying `tokenizer` and `config.max_model_len` can stand
in for the AsyncEngine (the bench's dedicated front does).

`synthetic_iter_retgen` makes a corpus and `QueryPlan`s with the paper's Iter-RetGen lengths
(prompt avg 500 / max 2000 tokens, decode avg 3000 / max 4000, 1-10 documents per query),
scaled down for CPU runs; see its docstring for the distributions.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import math
import random
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.async_engine import AsyncEngine
from hetero_jax.compile_cache import CompileCache
from hetero_jax.config import pad_to_bucket
from hetero_jax.params import PoolingParams, SamplingParams

_CAPACITY_BUCKETS = tuple(2**i for i in range(6, 27))  # 64 .. 64M rows
_QUERY_BUCKETS = tuple(2**i for i in range(11))  # 1 .. 1024 queries per search call
_WRITE_BUCKETS = tuple(2**i for i in range(3, 11))  # 8 .. 1024 rows per write
_K_BUCKETS = tuple(2**i for i in range(27))  # 1 .. the largest capacity


def _normalise(x):
    """[n, d] -> rows scaled to unit L2 norm (zero rows stay zero)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def search_step(vectors, size, queries, *, k: int):
    """vectors [C, d] unit rows, size [] int32, queries [Q, d] -> (scores [Q, k], rows [Q, k]).

    Cosine similarity by one matmul; rows at or past `size` score -inf, so they come last.
    """
    scores = jnp.matmul(_normalise(queries), vectors.T,
                        precision=jax.lax.Precision.HIGHEST)  # [Q, C]
    valid = jnp.arange(vectors.shape[0]) < size  # [C]
    return jax.lax.top_k(jnp.where(valid[None, :], scores, -jnp.inf), k)


def write_step(vectors, rows, start, count):
    """vectors [C, d] (donated), rows [M, d], start/count [] int32 -> [C, d] with the first
    `count` rows normalised into positions start..start+count; padding rows are dropped."""
    m = rows.shape[0]
    pos = jnp.where(jnp.arange(m) < count, start + jnp.arange(m), vectors.shape[0])  # [M]
    return vectors.at[pos].set(_normalise(rows), mode="drop")


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
        self._executables = CompileCache(self._compile)

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


def _check_text(text, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{name} is a {type(text).__name__}; expected a string")
    if not text.strip():
        raise ValueError(f"{name} is empty")
    return text


def _check_docs(docs) -> list[str]:
    docs = [docs] if isinstance(docs, str) else list(docs)
    return [_check_text(d, f"document {i}") for i, d in enumerate(docs)]


async def build_index(engine, docs: Sequence[str], ids: Sequence | None = None,
                      params: PoolingParams | None = None, min_capacity: int = 64) -> VectorIndex:
    """Embed `docs` through an `AsyncEngine` (one request each, batched by its stepper; any
    front with an async `embed` will do) or a synchronous `Engine`, and index them. A bad
    document raises ValueError naming it."""
    if not inspect.iscoroutinefunction(engine.embed):
        return VectorIndex.from_engine(engine, docs, ids, params, min_capacity)
    docs = _check_docs(docs)

    async def one(i: int, doc: str) -> np.ndarray:
        try:
            return await engine.embed(doc, params)
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


# -- Iter-RetGen ----------------------------------------------------------------------------
def build_prompt(docs: Sequence[str], question: str) -> str:
    """The generation prompt: numbered documents, then the question."""
    lines = [f"[{i + 1}] {d}" for i, d in enumerate(docs)]
    return "\n".join(lines + [f"Q: {question}", "A:"])


def fit_prompt(docs: Sequence[str], question: str, tokenizer, budget: int,
               prompt_fn: Callable = build_prompt) -> tuple[str, int]:
    """The prompt with every document cut to the same largest number of characters that keeps
    it within `budget` tokens (shorter documents stay whole) -> (prompt, its token count)."""
    def fitted(cap: int) -> tuple[str, int]:
        prompt = prompt_fn([d[:cap] for d in docs], question)
        return prompt, len(tokenizer.encode(prompt))

    hi = max((len(d) for d in docs), default=0)
    whole = fitted(hi)
    if whole[1] <= budget:
        return whole
    lo, best = 0, None
    while lo < hi:  # the largest cap that fits; cap 0 fits (checked by the caller)
        mid = (lo + hi + 1) // 2
        trial = fitted(mid)
        if trial[1] <= budget:
            lo, best = mid, trial
        else:
            hi = mid - 1
    return best or fitted(0)


@dataclasses.dataclass
class IterationResult:
    rows: list[int]  # index rows retrieved, best first
    doc_ids: list  # their ids
    scores: list[float]  # their cosine similarities
    prompt_tokens: int
    generation: str
    token_ids: list[int]
    retrieve_s: float
    generate_s: float
    embed_s: float  # embedding the next query; 0 after the last iteration


@dataclasses.dataclass
class IterRetGenResult:
    question: str
    iterations: list[IterationResult]
    question_embed_s: float
    total_s: float

    @property
    def retrieved(self) -> list[list]:
        """Per iteration, the retrieved document ids."""
        return [it.doc_ids for it in self.iterations]

    @property
    def generations(self) -> list[str]:
        return [it.generation for it in self.iterations]

    @property
    def answer(self) -> str:
        return self.iterations[-1].generation


@dataclasses.dataclass(frozen=True)
class QueryPlan:
    """One synthetic question and its lengths; `run_iter_retgen` takes it as the question."""

    question: str
    k: int  # documents retrieved per iteration
    max_tokens: int  # decode length of each generation
    prompt_budget: int  # prompt length in tokens (documents are cut to fit it)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


def _plan_defaults(question, k, params, prompt_budget) -> tuple:
    """(text, k, params, prompt_budget), taking a QueryPlan's values where none were given."""
    if not isinstance(question, QueryPlan):
        return (question, 3 if k is None else k,
                params or SamplingParams(max_tokens=32, temperature=0.0), prompt_budget)
    return (question.question, question.k if k is None else k,
            params or question.sampling_params(),
            question.prompt_budget if prompt_budget is None else prompt_budget)


def _check_question(engine, index: VectorIndex, text, iterations, k: int,
                    params: SamplingParams, prompt_budget: int | None, prompt_fn) -> int:
    """Raise ValueError for a pipeline that cannot run; returns its prompt limit in tokens."""
    _check_text(text, "question")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 1")
    index.check_k(k)
    if engine.tokenizer is None:
        raise ValueError("the generation model has no tokenizer; Iter-RetGen builds text prompts")
    max_len = engine.config.max_model_len
    budget = max_len - params.max_tokens
    if budget < 1:
        raise ValueError(f"max_tokens={params.max_tokens} leaves no room for a prompt under "
                         f"max_model_len={max_len}")
    budget = budget if prompt_budget is None else min(budget, prompt_budget)
    bare = len(engine.tokenizer.encode(prompt_fn([""] * k, text)))
    if bare > budget:
        raise ValueError(f"question {text[:40]!r} makes a prompt of {bare} tokens without "
                         f"documents, more than the prompt limit of {budget} tokens "
                         f"(max_model_len={max_len} - max_tokens={params.max_tokens}, "
                         f"prompt_budget={prompt_budget})")
    return budget


async def run_iter_retgen(aengine: AsyncEngine, index: VectorIndex, question: str | QueryPlan,
                          iterations: int = 2, k: int | None = None,
                          params: SamplingParams | None = None, *,
                          pooling: PoolingParams | None = None, prompt_budget: int | None = None,
                          prompt_fn: Callable = build_prompt) -> IterRetGenResult:
    """Iter-RetGen for one question: retrieve k -> generate -> embed(question + generation).

    `question` may be a `QueryPlan`, whose k, decode length and prompt budget are then the
    defaults. `params` defaults to greedy decoding of 32 tokens, `k` to 3 and `pooling` to the
    model's default; queries after the first are embedded with `truncate=True`. The prompt
    (documents cut evenly to fit) is at most `prompt_budget` and max_model_len - max_tokens
    tokens. Raises ValueError (in this coroutine only) for an empty or too-long question, a
    bad `iterations` or a `k` outside [1, index size], before any request is made.
    """
    text, k, params, prompt_budget = _plan_defaults(question, k, params, prompt_budget)
    pooling = pooling or PoolingParams()
    engine = aengine.engine
    budget = _check_question(engine, index, text, iterations, k, params, prompt_budget, prompt_fn)
    start = time.perf_counter()
    try:
        query = await aengine.embed(text, pooling)  # [d]
    except ValueError as e:
        raise ValueError(f"question {text[:40]!r}: {e}") from e
    first_embed_s = time.perf_counter() - start
    records = []
    for it in range(iterations):
        t0 = time.perf_counter()
        scores, rows = index.search(query, k)
        docs = [index.docs[r] or "" for r in rows]
        prompt, n_prompt = fit_prompt(docs, text, engine.tokenizer, budget, prompt_fn)
        t1 = time.perf_counter()
        out = await aengine.generate(prompt, params)
        t2 = t3 = time.perf_counter()
        if it + 1 < iterations:
            next_query = f"{text}\n{out.text}" if out.text and out.text.strip() else text
            query = await aengine.embed(next_query, dataclasses.replace(pooling, truncate=True))
            t3 = time.perf_counter()
        records.append(IterationResult(
            rows=[int(r) for r in rows], doc_ids=[index.ids[r] for r in rows],
            scores=[float(s) for s in scores], prompt_tokens=n_prompt, generation=out.text,
            token_ids=out.token_ids, retrieve_s=t1 - t0, generate_s=t2 - t1,
            embed_s=t3 - t2))
    return IterRetGenResult(text, records, first_embed_s, time.perf_counter() - start)


async def iter_retgen_many(aengine: AsyncEngine, index: VectorIndex, questions: Sequence,
                           iterations: int = 2, k: int | None = None,
                           params: SamplingParams | None = None, *, concurrency: int | None = None,
                           return_exceptions: bool = True, **kwargs) -> list:
    """Many questions at once through one AsyncEngine -> results in question order.

    At most `concurrency` pipelines run at a time (None: all). With `return_exceptions` a
    failed question yields its exception in its slot and the others finish.
    """
    limit = asyncio.Semaphore(concurrency or max(len(questions), 1))

    async def one(q):
        async with limit:
            return await run_iter_retgen(aengine, index, q, iterations, k, params, **kwargs)

    return await asyncio.gather(*(one(q) for q in questions), return_exceptions=return_exceptions)


# -- synthetic workload ---------------------------------------------------------------------
PAPER_STATS = dict(prompt_mean=500, prompt_max=2000, decode_mean=3000, decode_max=4000,
                   docs_min=1, docs_max=10)
_PROMPT_SIGMA = 0.6  # lognormal shape of the prompt length
_PROMPT_MIN = 100


def _words(rng: random.Random, n_chars: int, vocab: list[str]) -> str:
    """Pseudo-words joined by spaces, exactly `n_chars` characters."""
    out, size = [], 0
    while size < n_chars:
        out.append(rng.choice(vocab))
        size += len(out[-1]) + 1
    return " ".join(out)[:n_chars].rstrip() or vocab[0][:n_chars]


def synthetic_iter_retgen(num_queries: int, scale: float = 0.05, seed: int = 0,
                          num_docs: int | None = None) -> tuple[list[str], list[QueryPlan]]:
    """A corpus and `num_queries` `QueryPlan`s with the paper's Iter-RetGen statistics.

    Per query, in tokens of the byte-level tokenizer (one ASCII character each) before scaling:
    - documents retrieved k: uniform integer in [1, 10] (mean 5.5);
    - prompt length P (`prompt_budget`): lognormal with sigma 0.6 and mean 500, clipped to
      [100, 2000] (median 418, 99th percentile ~1650); then x scale, and at least the prompt
      with k four-character documents (so small scales raise the short prompts);
    - decode length (`max_tokens`, per generation): uniform integer in [2000, 4000]
      (mean 3000, max 4000), x scale, at least 1;
    - question: 8-24 characters of pseudo-words (not scaled).
    Documents (default 2 x num_queries, at least 32) are pseudo-words of 2000 x scale to
    2200 x scale characters, long enough that `fit_prompt` cuts the k retrieved ones to
    exactly P, whichever are retrieved. The engine needs max_model_len >= 6000 x scale + 1
    and an embedding limit >= 2200 x scale tokens (else build the index with truncate=True).
    """
    if num_queries < 1 or not 0 < scale <= 1:
        raise ValueError(f"num_queries={num_queries} must be >= 1 and scale={scale} in (0, 1]")
    rng = random.Random(seed)
    letters = "bcdfghjklmnprstvwz"
    vocab = sorted({"".join(rng.choice(letters) + rng.choice("aeiou")
                            for _ in range(rng.randint(1, 4))) for _ in range(400)})
    p_max = PAPER_STATS["prompt_max"]
    docs = [_words(rng, max(4, round(rng.uniform(p_max, 1.1 * p_max) * scale)), vocab)
            for _ in range(num_docs or max(32, 2 * num_queries))]
    mu = math.log(PAPER_STATS["prompt_mean"]) - _PROMPT_SIGMA**2 / 2
    plans = []
    for _ in range(num_queries):
        k = rng.randint(PAPER_STATS["docs_min"], PAPER_STATS["docs_max"])
        question = _words(rng, rng.randint(8, 24), vocab)
        prompt = min(max(rng.lognormvariate(mu, _PROMPT_SIGMA), _PROMPT_MIN), p_max)
        floor = 1 + len(build_prompt(["x" * 4] * k, question))  # BOS + the shortest prompt
        decode = rng.randint(PAPER_STATS["decode_mean"] * 2 - PAPER_STATS["decode_max"],
                             PAPER_STATS["decode_max"])
        plans.append(QueryPlan(question, k, max(1, round(decode * scale)),
                               max(floor, round(prompt * scale))))
    return docs, plans
