"""CPU the server's app spends per streamed completion, with no engine and no sockets.

    python scripts/serve_app_cpu.py [--requests 300] [--tokens 16]

A fake `EngineClient` yields `--tokens` one-token deltas at once; the FastAPI app
(`server.app.build_app`) is called as uvicorn would call it (an ASGI scope, `receive`,
`send`), on uvloop, one request after another. Prints the process CPU seconds per request:
routing, body validation, the stream of pieces, one JSON chunk per delta and the ASGI sends,
without the engine's steps, HTTP parsing or socket writes. Machine load moves wall time, much
less CPU time, so this is the number to compare with the engine's CPU per request.
"""
import argparse
import asyncio
import json
import time

import uvloop

from hetero_jax.outputs import GenerateDelta, RequestOutput
from hetero_jax.server.app import ServerConfig, build_app
from hetero_jax.serving.client import FrontStats, GenerateStream, StepTimes


class Bytes:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return "x" * len(ids)


class Instant:
    """An EngineClient whose generations are `tokens` deltas, ready at once."""

    tokenizer, max_model_len = Bytes(), 512
    stats = FrontStats(None, {}, {}, StepTimes())

    def __init__(self, tokens: int, step_s: float = 0.0):
        self.tokens, self.step_s = tokens, step_s  # deltas `step_s` apart (0: one loop turn)

    def generate(self, prompt, params=None, request_id=None) -> GenerateStream:
        async def deltas():
            for i in range(self.tokens - 1):
                await asyncio.sleep(self.step_s)  # one step each: no two deltas joined
                yield GenerateDelta(request_id, [i], "x", None, prompt_tokens=len(prompt))
            out = RequestOutput(0, prompt, list(range(self.tokens)), "x" * self.tokens,
                                "length", None, {})
            yield GenerateDelta(request_id, [0], "x", None, True, out, len(prompt))
        return GenerateStream(deltas())


async def one(app, body: bytes) -> int:
    """One streamed completion through the app -> the body messages it sent."""
    scope = dict(type="http", asgi={"version": "3.0"}, http_version="1.1", method="POST",
                 scheme="http", path="/v1/completions", raw_path=b"/v1/completions",
                 query_string=b"", root_path="", client=("127.0.0.1", 1),
                 server=("127.0.0.1", 2), headers=[(b"content-type", b"application/json"),
                                                   (b"content-length", b"%d" % len(body))])
    done, read, sent = asyncio.Event(), [False], [0]

    async def receive():
        if not read[0]:
            read[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            sent[0] += 1
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return sent[0]


async def main(args) -> None:
    app = build_app(Instant(args.tokens), ServerConfig(model="tiny"))
    body = json.dumps(dict(model="tiny", prompt=list(range(1, 33)), max_tokens=args.tokens,
                           temperature=0, ignore_eos=True, stream=True,
                           return_token_ids=True)).encode()
    for _ in range(20):
        await one(app, body)
    start = time.process_time()
    for _ in range(args.requests):
        chunks = await one(app, body)
    cpu = (time.process_time() - start) / args.requests
    print(f"{chunks} body messages per request; app CPU per streamed request "
          f"{cpu * 1e3:.3f} ms ({args.requests} requests)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=16)
    uvloop.run(main(ap.parse_args()))
