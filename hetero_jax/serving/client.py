"""The one contract every caller of an engine meets: `EngineClient` (imports no jax).

The OpenAI server, the retrieval pipeline (`rag`), the bench and the batch job call an engine
only through it. `generate(prompt, params, request_id=None)` returns a `GenerateStream`:
`async for delta in stream` yields a `GenerateDelta` for every step that gave the request
tokens (those that queued while the caller was busy come joined into one), the last one
`finished` and carrying the whole `RequestOutput`; `await stream` (or the coroutine
`stream.output()`) is the short form that returns that output. Nothing is submitted until the
stream is first iterated or awaited; a bad request raises `RequestError` there, one the engine
fails while running raises `RequestFailed`, and leaving the stream early (closing it, or
cancelling its task) aborts the request and frees its pages. `embed` returns an
`EmbeddingOutput` (vector and its token ids). `abort(request_id)` ends a request by the
caller's id. `stats` is a `FrontStats`: the engine's counters plus the queue by kind and a
histogram of step times.

One implementation, `front.Front`, over a core per kind of engine: `AsyncEngine` (one engine
in this process, streaming per step), `AsyncReplicas` (replicas in processes, streaming
per step, or Ray actors) and `AsyncDedicated` (dedicated mode's two workers); a stream over
Ray actors or dedicated mode has one delta, the finished one, since they learn of a request
when it ends.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import AsyncIterator, Protocol

from hetero_jax.outputs import (EmbeddingOutput, EngineStats, GenerateDelta, RequestError,
                                RequestOutput)
from hetero_jax.requests import PoolingParams, SamplingParams

# upper bounds (seconds) of the step-time histogram's buckets; the last bucket is +Inf
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class GenerateStream:
    """One generation's per-step deltas (`async for`), or its final output (`await`)."""

    def __init__(self, deltas: AsyncIterator[GenerateDelta]):
        self._deltas = deltas  # an async generator; nothing runs before its first step

    def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        return self._deltas

    async def aclose(self) -> None:
        """Leave the stream: an unfinished request is aborted."""
        await self._deltas.aclose()

    def __await__(self):
        return self.output().__await__()

    async def output(self) -> RequestOutput:
        """Run the stream to its end -> the whole output (a coroutine, for `create_task`)."""
        last = None
        async for last in self._deltas:
            pass
        assert last is not None and last.finished, f"a stream ended without output: {last=}"
        return last.output


def admitted(call, field: str, request_id, in_flight):
    """`call()` (a front's check-and-submit) -> its result; a caller's id already in flight,
    or a TypeError / ValueError of the checks -> RequestError naming `field` ("params" for
    a TypeError)."""
    if request_id is not None and request_id in in_flight:
        raise RequestError(0, "request_id", f"request_id={request_id!r} is in flight")
    try:
        return call()
    except TypeError as e:
        raise RequestError(0, "params", str(e)) from e
    except ValueError as e:
        raise RequestError(0, field, str(e)) from e


@dataclasses.dataclass
class StepTimes:
    """A cumulative-ready histogram of step seconds over `STEP_BUCKETS` (+Inf last)."""

    counts: list = dataclasses.field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self.total_s += seconds

    @classmethod
    def merged(cls, parts) -> "StepTimes":
        """One histogram of several (the replicas')."""
        out = cls()
        for part in parts:
            out.counts = [a + b for a, b in zip(out.counts, part.counts)]
            out.total_s += part.total_s
        return out


@dataclasses.dataclass
class FrontStats:
    """What a front reports for monitoring (`/metrics`)."""

    engine: EngineStats  # the engine's counters (summed over replicas)
    waiting: dict  # kind ("generate", "embed") -> requests queued, not yet admitted
    running: dict  # kind -> requests admitted and not finished
    steps: StepTimes  # the steps this front drove (empty where the steps run elsewhere)


class EngineClient(Protocol):
    """What every caller of an engine uses; see the module docstring."""

    tokenizer: object  # encode(text) -> ids, decode(ids) -> text; None: the model has none
    max_model_len: int

    def generate(self, prompt, params: SamplingParams | None = None,
                 request_id=None) -> GenerateStream: ...

    async def embed(self, x, params: PoolingParams | None = None,
                    request_id=None) -> EmbeddingOutput: ...

    def abort(self, request_id) -> None: ...

    @property
    def stats(self) -> FrontStats: ...

    async def close(self) -> None: ...
