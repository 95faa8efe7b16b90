"""A server-sent event stream as bare ASGI messages, and the watch on a client's disconnect.

In: an async iterator of `(body bytes, more to come)` (`app._events`), on the request's task.
Out: `http.response.start`, then one `http.response.body` per item, the last with
`more_body=False`, so uvicorn writes a stream's last event, `data: [DONE]` and the chunked
terminator in one socket write (one wake-up of the client), where starlette's
`StreamingResponse` sends an empty closing body of its own. While it streams, a `Watch` (one
task waiting on the connection's next ASGI message, which after the body can only be its
disconnect) cancels the request's task if the client leaves: the iterator is closed where it
waits, so its requests are aborted, and the cancel ends there. No anyio task group per
request, as `StreamingResponse` makes under uvicorn's ASGI spec 2.3.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.responses import Response


class Watch:
    """Cancels the task that made it if the client behind `receive` disconnects before
    `close()`. The body has been read, so the next message `receive` gives is the disconnect
    (or, once the response is whole, uvicorn's end of the request: close the watch before
    sending the last message). One waiting task, no polling."""

    def __init__(self, receive):
        self.task, self.open, self.fired = asyncio.current_task(), True, False
        self.gone = asyncio.ensure_future(_disconnect(receive))
        self.gone.add_done_callback(self._fire)

    def _fire(self, gone) -> None:
        if self.open and not gone.cancelled():
            self.fired = True
            self.task.cancel("the client disconnected")

    def close(self) -> None:
        self.open = False
        self.gone.cancel()


async def _disconnect(receive) -> None:
    """Return when the client behind `receive` (its body read) disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


class SseResponse(Response):
    """`text/event-stream` from `events`, `(bytes, more)` pairs; see the module docstring."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[tuple[bytes, bool]]):
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers(None)

    async def __call__(self, scope, receive, send) -> None:
        watch = Watch(receive)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            async for body, more in self.events:
                if not more:
                    watch.close()  # what `receive` says after this is no disconnect
                await send({"type": "http.response.body", "body": body, "more_body": more})
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            asyncio.current_task().uncancel()  # the client left: this request ends here
        finally:
            watch.close()
            await self.events.aclose()
