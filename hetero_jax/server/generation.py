"""One choice of a completion as a stream of pieces, with stop strings; many choices as one.

In: an `EngineClient`, a prompt and `SamplingParams` (with the request's stop strings, which
the engine checks). Out: `Piece`s, each the text a step added, its token ids and log-probs,
the last with the finish reason and the prompt's token count. Leaving the stream aborts the
rest of the request in the engine. `merged` interleaves several
choices' pieces as they come; closing it closes every choice (each aborts its request).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator

from hetero_jax.requests import SamplingParams


@dataclasses.dataclass
class Piece:
    text: str
    token_ids: list
    logprobs: list | None  # per token, as `RequestOutput.logprobs`
    finish_reason: str | None = None  # on the last piece
    prompt_tokens: int = 0  # on the last piece


async def choice_pieces(client, prompt, params: SamplingParams,
                        request_id) -> AsyncIterator[Piece]:
    """One generation as `Piece`s; raises what the client raises (RequestError, ...). Stop
    strings travel in `params`: the engine ends the request at one and never streams text
    that could begin one (`models.detokenize`)."""
    stream = client.generate(prompt, params, request_id=request_id)
    async with contextlib.aclosing(stream):
        async for d in stream:
            if d.finished:
                yield Piece(d.text, d.token_ids, d.logprobs, d.output.finish_reason,
                            d.prompt_tokens)
                return
            if d.text or d.token_ids:
                yield Piece(d.text, d.token_ids, d.logprobs)


async def merged(streams: list) -> AsyncIterator[tuple[int, Piece]]:
    """(index, piece) from several piece streams as they come; the first error raises."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for piece in only:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        async with contextlib.aclosing(stream):
            async for piece in stream:
                await queue.put((i, piece, None))
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    for task in tasks:
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or
                               queue.put_nowait((-1, None, t.exception())))
    try:
        live = len(tasks)
        while live:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                live -= 1
                continue
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
