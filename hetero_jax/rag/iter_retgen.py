"""Iterative retrieval (Iter-RetGen, Shao et al. 2023) on the heterogeneous engine.

In: a `Front`, which is the `serving.client.EngineClient` every caller uses (an `AsyncEngine`,
`AsyncReplicas`, or `AsyncDedicated`), a `VectorIndex` and questions (strings or
`QueryPlan`s). Out: per question, an `IterRetGenResult`.

`run_iter_retgen` is one question's program, a coroutine on the event loop:
embed(question) -> [search -> generate(prompt(docs, question)) -> embed(question + generation)]
x iterations (the last embed is skipped: nothing would search with it). Embeds and generates go
through the front, whose one stepper thread batches them with every other coroutine's requests
in heterogeneous steps; the search runs on the loop (one small device call). A bad question
raises in its own coroutine before any request is made; `iter_retgen_many` runs many
questions and returns each one's result or exception in its slot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from hetero_jax.rag.index import VectorIndex, check_text
from hetero_jax.requests import PoolingParams, SamplingParams
from hetero_jax.serving.client import EngineClient as Front


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
    instruction: str = ""  # shared by every query and prompt (a prefix the cache keeps)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


def _plan_defaults(question, k, params, prompt_budget, instruction) -> tuple:
    """(text, k, params, prompt_budget, instruction), taking a QueryPlan's values where none
    were given."""
    if not isinstance(question, QueryPlan):
        return (question, 3 if k is None else k,
                params or SamplingParams(max_tokens=32, temperature=0.0), prompt_budget,
                instruction or "")
    return (question.question, question.k if k is None else k,
            params or question.sampling_params(),
            question.prompt_budget if prompt_budget is None else prompt_budget,
            question.instruction if instruction is None else instruction)


def _check_question(front: Front, index: VectorIndex, text, iterations, k: int,
                    params: SamplingParams, prompt_budget: int | None, prompt_fn) -> int:
    """Raise ValueError for a pipeline that cannot run; returns its prompt limit in tokens."""
    check_text(text, "question")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 1")
    index.check_k(k)
    if front.tokenizer is None:
        raise ValueError("the generation model has no tokenizer; Iter-RetGen builds text prompts")
    max_len = front.max_model_len
    budget = max_len - params.max_tokens
    if budget < 1:
        raise ValueError(f"max_tokens={params.max_tokens} leaves no room for a prompt under "
                         f"max_model_len={max_len}")
    budget = budget if prompt_budget is None else min(budget, prompt_budget)
    bare = len(front.tokenizer.encode(prompt_fn([""] * k, text)))
    if bare > budget:
        raise ValueError(f"question {text[:40]!r} makes a prompt of {bare} tokens without "
                         f"documents, more than the prompt limit of {budget} tokens "
                         f"(max_model_len={max_len} - max_tokens={params.max_tokens}, "
                         f"prompt_budget={prompt_budget})")
    return budget


async def run_iter_retgen(front: Front, index: VectorIndex, question: str | QueryPlan,
                          iterations: int = 2, k: int | None = None,
                          params: SamplingParams | None = None, *,
                          pooling: PoolingParams | None = None, prompt_budget: int | None = None,
                          prompt_fn: Callable = build_prompt,
                          instruction: str | None = None) -> IterRetGenResult:
    """Iter-RetGen for one question: retrieve k -> generate -> embed(question + generation).

    `question` may be a `QueryPlan`, whose k, decode length and prompt budget are then the
    defaults. `params` defaults to greedy decoding of 32 tokens, `k` to 3 and `pooling` to the
    model's default; queries after the first are embedded with `truncate=True`. The prompt
    (documents cut evenly to fit) is at most `prompt_budget` and max_model_len - max_tokens
    tokens. `instruction` (default: the plan's, else none) starts every query embedded and
    every prompt: the same prefix for every question, which the prefix cache computes once.
    Raises ValueError (in this coroutine only) for an empty or too-long question, a
    bad `iterations` or a `k` outside [1, index size], before any request is made.
    """
    text, k, params, prompt_budget, instruction = _plan_defaults(question, k, params,
                                                                 prompt_budget, instruction)
    if instruction:
        prompt_fn = _with_instruction(prompt_fn, instruction)
    pooling = pooling or PoolingParams()
    budget = _check_question(front, index, text, iterations, k, params, prompt_budget, prompt_fn)
    start = time.perf_counter()
    try:
        query = (await front.embed(instruction + text, pooling)).embedding  # [d]
    except ValueError as e:
        raise ValueError(f"question {text[:40]!r}: {e}") from e
    first_embed_s = time.perf_counter() - start
    records = []
    for it in range(iterations):
        t0 = time.perf_counter()
        scores, rows = index.search(query, k)
        docs = [index.docs[r] or "" for r in rows]
        prompt, n_prompt = fit_prompt(docs, text, front.tokenizer, budget, prompt_fn)
        t1 = time.perf_counter()
        out = await front.generate(prompt, params)
        t2 = t3 = time.perf_counter()
        if it + 1 < iterations:
            next_query = instruction + (f"{text}\n{out.text}" if out.text and out.text.strip()
                                        else text)
            query = (await front.embed(next_query, dataclasses.replace(
                pooling, truncate=True))).embedding
            t3 = time.perf_counter()
        records.append(IterationResult(
            rows=[int(r) for r in rows], doc_ids=[index.ids[r] for r in rows],
            scores=[float(s) for s in scores], prompt_tokens=n_prompt, generation=out.text,
            token_ids=out.token_ids, retrieve_s=t1 - t0, generate_s=t2 - t1,
            embed_s=t3 - t2))
    return IterRetGenResult(text, records, first_embed_s, time.perf_counter() - start)


def _with_instruction(prompt_fn: Callable, instruction: str) -> Callable:
    return lambda docs, question: instruction + prompt_fn(docs, question)


async def iter_retgen_many(front: Front, index: VectorIndex, questions: Sequence,
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
            return await run_iter_retgen(front, index, q, iterations, k, params, **kwargs)

    return await asyncio.gather(*(one(q) for q in questions), return_exceptions=return_exceptions)
