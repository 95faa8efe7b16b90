"""The server's streamed answers as bytes: the chunk encoder and the SSE messages (no engine).

`Render.event` writes a chunk without log-probs straight into a per-request template; it must
give the bytes of `sse_event(Render.chunk(...))`, the dicts-and-json path, on any text, ids,
index and finish reason (random cases). The app's stream, driven as uvicorn drives it (ASGI
scope, receive, send) over a fake `EngineClient`, must carry exactly the events of that
reference path, the last event, the usage chunk and `[DONE]` in one last body message.
"""
import asyncio
import json
import random
import time
import types

import pytest

from hetero_jax.outputs import GenerateDelta, RequestFailed, RequestOutput
from hetero_jax.server.app import ServerConfig, build_app
from hetero_jax.server.generation import Piece
from hetero_jax.server.render import Render, sse_event
from hetero_jax.serving.client import FrontStats, GenerateStream, StepTimes

ALPHABET = "ab \"\\/\n\t\x00\x1fé€😀"


def request(chat: bool, n: int, token_ids: bool, usage: bool = False):
    options = types.SimpleNamespace(include_usage=usage)
    return types.SimpleNamespace(n=n, return_token_ids=token_ids, stream_options=options)


def random_piece(rng: random.Random, last: bool) -> Piece:
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
    ids = [rng.randint(0, 300_000) for _ in range(rng.randint(0, 3))]
    reason = rng.choice(["length", "stop", "abort"]) if last else None
    return Piece(text, ids, None, reason, rng.randint(1, 50) if last else 0)


@pytest.mark.parametrize("seed", range(8))
def test_a_chunk_written_straight_equals_the_json_of_its_dicts(seed, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)  # both renders' `created`
    rng = random.Random(seed)
    chat, n, token_ids = rng.random() < 0.5, rng.randint(1, 3), rng.random() < 0.5
    kind = "chat.completion" if chat else "text_completion"
    args = (None, rng.choice(["tiny", "a \"model\" é"]), request(chat, n, token_ids), kind,
            f"cmpl-{seed}", n)
    fast, slow = Render(*args), Render(*args)
    for step in range(12):
        index, piece = rng.randrange(n), random_piece(rng, step >= 9)
        assert fast.event(index, piece) == sse_event(slow.chunk(index, piece)), f"{step=}"
    assert vars(fast) == vars(slow)  # the same counts, offsets and roles sent


class Scripted:
    """An EngineClient whose generation yields `deltas` one loop turn apart, then `error`."""

    tokenizer, max_model_len = None, 512
    stats = FrontStats(None, {}, {}, StepTimes())

    def __init__(self, deltas: list, error: Exception | None = None):
        self.deltas, self.error = deltas, error

    def generate(self, prompt, params=None, request_id=None) -> GenerateStream:
        async def steps():
            for delta in self.deltas:
                await asyncio.sleep(0)
                yield delta
            if self.error is not None:
                raise self.error
        return GenerateStream(steps())


def script(texts: list, prompt_len: int = 3) -> list:
    """One delta per text, the last finished ("length")."""
    deltas = [GenerateDelta(None, [i], t, None) for i, t in enumerate(texts[:-1])]
    out = RequestOutput(0, [1] * prompt_len, list(range(len(texts))), "".join(texts),
                        "length", None, {})
    return deltas + [GenerateDelta(None, [len(texts) - 1], texts[-1], None, True, out,
                                   prompt_len)]


async def messages(client, body: dict) -> list:
    """The ASGI messages the app sends for one POST /v1/completions."""
    raw, sent, done = json.dumps(body).encode(), [], asyncio.Event()
    scope = dict(type="http", asgi={"version": "3.0", "spec_version": "2.3"},
                 http_version="1.1", method="POST", scheme="http", path="/v1/completions",
                 raw_path=b"/v1/completions", query_string=b"", root_path="",
                 client=("127.0.0.1", 1), server=("127.0.0.1", 2),
                 headers=[(b"content-type", b"application/json")])
    queue = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if queue:
            return queue.pop()
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await build_app(client, ServerConfig(model="tiny"))(scope, receive, send)
    return sent


def reference_events(deltas: list, first: bytes, error: Exception | None = None) -> list:
    """The events the dicts-and-json path gives for `deltas` (`Render.chunk` per piece), with
    the request id and time of the app's `first` event."""
    head = json.loads(first[6:])
    render = Render(None, "tiny", request(False, 1, True, usage=True), "text_completion",
                    head["id"], 1)
    render.created = head["created"]
    events = [sse_event(render.chunk(0, Piece(d.text, d.token_ids, d.logprobs,
                                              d.output.finish_reason if d.finished else None,
                                              d.prompt_tokens)))
              for d in deltas]
    if error is not None:
        return events
    return events + [sse_event(render.usage_chunk()), b"data: [DONE]\n\n"]


@pytest.mark.parametrize("error", [None, RequestFailed("x", "the engine failed it")])
def test_a_stream_sends_the_reference_events_and_its_end_in_one_message(error):
    texts = ["a", "", "b\"c", "é", "d"]
    deltas = script(texts)[:-1] if error else script(texts)
    body = dict(model="tiny", prompt=[1, 2, 3], max_tokens=5, stream=True,
                return_token_ids=True, stream_options={"include_usage": True})
    sent = asyncio.run(messages(Scripted(deltas, error), body))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    events = [e + b"\n\n" for m in bodies for e in m["body"].split(b"\n\n")[:-1]]
    want = reference_events(deltas, events[0], error)
    if error is None:
        assert len(bodies) == len(texts), "the last event, usage and [DONE] in one message"
        assert events == want
    else:
        assert events[:-1] == want
        assert json.loads(events[-1][6:])["error"]["message"].endswith("the engine failed it")
