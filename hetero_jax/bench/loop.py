"""Closed-loop clients for `hetero-jax bench`: the workloads, the loop, one row of numbers.

In: an `EngineClient` (`serving.client`: `await generate(prompt, params)` -> RequestOutput,
`await embed(x, params)` -> EmbeddingOutput), a list of requests (or Iter-RetGen query plans) and a number of
clients. Out: one `Record` per request (or question) with its submit, first-token and finish
times, and `summarize` turns records plus engine counters into one table row. `output_records`
makes the same Records from the outputs of a batch `Engine.run`/`generate` (timed from each
request's arrival), so `hetero-jax generate` and `scripts/bench_hol.py` summarize alike.

The loop is the simulator's closed loop (`hetero_jax.sim`): the requests of a run are a fixed,
seeded, shuffled list with exact per-type counts; each of `clients` coroutines takes the next
request from that shared list as soon as its previous one has finished, until none is left.
Throughput is requests over the wall time from the first submit to the last finish.

Every engine is met through its `EngineClient` (`serving.front.Front`): `AsyncEngine`,
`AsyncReplicas`, or for a `DedicatedEngine`, whose only serving call is a batch `run()`,
`AsyncDedicated` (per worker one `run()` at a time; requests that arrive while a worker's
batch runs wait and the next batch takes all of them). Inside a batch each worker is an
ordinary continuously batching `Engine`; what it cannot do is admit a request into a batch
that is already running.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from hetero_jax.outputs import RequestOutput
from hetero_jax.rag.iter_retgen import run_iter_retgen
from hetero_jax.requests import EmbedRequest
from hetero_jax.sched import EMBED, GENERATE as GEN
from hetero_jax.sim.report import percentile

QUESTION = "question"


@dataclasses.dataclass
class Record:
    kind: str  # EMBED | GEN | QUESTION
    submit: float  # perf_counter when the client submitted it
    done: float
    first_token: float | None = None  # generation: when its first token was sampled
    input_tokens: int = 0
    output_tokens: int = 0
    embeds: int = 0  # requests it made (one, or an Iter-RetGen question's several)
    gens: int = 0


async def _one(front, request) -> Record:
    t0 = time.perf_counter()
    if isinstance(request, EmbedRequest):
        await front.embed(request.input, request.params)
        return Record(EMBED, t0, time.perf_counter(), input_tokens=len(request.input), embeds=1)
    out = await front.generate(request.prompt, request.params)
    return Record(GEN, t0, time.perf_counter(), out.metrics["first_token_time"],
                  len(out.prompt_token_ids), len(out.token_ids), gens=1)


def output_records(outs: list) -> list:
    """Records of a batch run's `RequestOutput`s and `EmbeddingOutput`s, from their arrival."""
    records = []
    for o in outs:
        m = o.metrics
        if isinstance(o, RequestOutput):
            records.append(Record(GEN, m["arrival_time"], m["finish_time"],
                                  m["first_token_time"], len(o.prompt_token_ids),
                                  len(o.token_ids), gens=1))
        else:
            records.append(Record(EMBED, m["arrival_time"], m["finish_time"],
                                  input_tokens=len(o.prompt_token_ids), embeds=1))
    return records


async def _question(front, index, plan, iterations: int) -> Record:
    t0 = time.perf_counter()
    res = await run_iter_retgen(front, index, plan, iterations)
    its = res.iterations
    return Record(QUESTION, t0, time.perf_counter(), None, sum(it.prompt_tokens for it in its),
                  sum(len(it.token_ids) for it in its), embeds=iterations, gens=iterations)


async def closed_loop(front, items: list, clients: int, on_done=None, index=None,
                      iterations: int = 2) -> list:
    """Run `items` (requests, or query plans when `index` is given) with `clients` closed-loop
    clients; returns their Records in item order. `on_done(record)` runs as each finishes."""
    todo = iter(enumerate(items))
    records = [None] * len(items)

    async def client():
        for i, item in todo:  # the shared iterator hands each item to one client
            if index is None:
                records[i] = await _one(front, item)
            else:
                records[i] = await _question(front, index, item, iterations)
            if on_done:
                on_done(records[i])

    await asyncio.gather(*(client() for _ in range(min(clients, len(items)))))
    return records


def counters(engine) -> dict:
    """Cumulative step counters of each worker of an engine (`worker_stats`: one for an
    Engine, two for a DedicatedEngine, one per replica)."""
    keys = ("steps", "scheduled_tokens", "compiles", "compile_s", "cache_query_tokens",
            "cache_hit_tokens")
    return {name: {k: getattr(s, k) for k in keys} for name, s in engine.worker_stats.items()}


def counters_delta(before: dict, after: dict) -> dict:
    """Totals over workers of what `after` adds to `before`; `compile_stall_s` is the longest
    worker's compile time (an Engine's compile stalls every client of a closed loop)."""
    deltas = [{k: v - before.get(name, {}).get(k, 0) for k, v in c.items()}
              for name, c in after.items()]
    out = {k: sum(d[k] for d in deltas) for k in deltas[0]}
    out["compile_stall_s"] = max(d["compile_s"] for d in deltas)
    return out


def summarize(records: list, delta: dict, token_budget: int) -> dict:
    """One row: per-type counts and rates, latency percentiles (all, and per type), TTFT,
    budget fill, steps, compiles.

    Rates are over the serving time: the wall time from the first submit to the last finish
    less `delta["compile_stall_s"]` (compiling a new step shape stops the engine, and with it
    every closed-loop client; compiles are counted and timed apart). Latencies are as measured.
    """
    start = min(r.submit for r in records)
    raw_wall = max(r.done for r in records) - start
    wall = raw_wall - delta.get("compile_stall_s", 0.0)
    lat = [r.done - r.submit for r in records]
    by_kind = {k: [r for r in records if r.kind == k] for k in (EMBED, GEN)}
    n_embed = sum(r.embeds for r in records)
    n_gen = sum(r.gens for r in records)
    ttft = [r.first_token - r.submit for r in records if r.first_token is not None]
    steps = delta["steps"]
    embed_tokens = sum(r.input_tokens for r in by_kind[EMBED])
    gen_tokens = sum(r.output_tokens for r in records)
    row = dict(
        requests=n_embed + n_gen, embed_tokens=embed_tokens, gen_tokens=gen_tokens,
        wall_s=raw_wall, serving_s=wall, requests_per_s=(n_embed + n_gen) / wall,
        embed_requests_per_s=n_embed / wall, gen_requests_per_s=n_gen / wall,
        embed_tokens_per_s=embed_tokens / wall, gen_tokens_per_s=gen_tokens / wall,
        p50_latency_s=percentile(lat, 50), p99_latency_s=percentile(lat, 99),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        budget_fill=delta["scheduled_tokens"] / max(steps * token_budget, 1),
        steps=steps, compiles=delta["compiles"], compile_s=delta["compile_stall_s"],
        cache_hit_rate=delta["cache_hit_tokens"] / delta["cache_query_tokens"]
        if delta.get("cache_query_tokens") else None)  # None: nothing looked up (no cache)
    for kind, rs in by_kind.items():
        for q in (50, 99):
            row[f"{kind}_p{q}_latency_s"] = percentile([r.done - r.submit for r in rs], q)
    questions = [r for r in records if r.kind == QUESTION]
    if questions:
        row.update(questions=len(questions), questions_per_s=len(questions) / wall)
    return row
