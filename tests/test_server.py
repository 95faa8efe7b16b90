"""The OpenAI-compatible server, driven by the official `openai` package over loopback.

One tiny-preset engine serves the whole module (uvicorn on 127.0.0.1, a random port, in a
thread). Results over the wire equal the engine's own: greedy tokens equal `Engine.generate`'s
and embeddings equal `Engine.embed`'s within 1e-6. Bad requests get OpenAI-shaped errors with
their statuses, and a client that disconnects mid-stream frees its pages.
"""
import asyncio
import base64
import json
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from hetero_jax import Engine, EngineConfig, PoolingParams, SamplingParams
from hetero_jax.bench.online import ClientSender, HttpSender, run_trace
from hetero_jax.outputs import EmbeddingOutput, EngineStats, RequestError
from hetero_jax.server.app import ServerConfig, build_app
from hetero_jax.server.chat import DEFAULT_TEMPLATE, ChatTemplate, read_template
from hetero_jax.server.cli import UVICORN, ServerThread
from hetero_jax.serving.async_engine import AsyncEngine
from hetero_jax.serving.client import FrontStats, GenerateStream, StepTimes

KEY = "sk-test"
CFG = EngineConfig(max_model_len=512, token_budget=32, chunk_size=32, max_num_seqs=4,
                   max_chunk_seqs=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0)
LIMIT = 1 << 16  # the body size limit of the module's server


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=CFG)


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(AsyncEngine(engine), ServerConfig(model="tiny", api_key=KEY,
                                                      max_body_bytes=LIMIT))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def idle(engine, timeout: float = 30.0) -> None:
    """Wait until the engine holds no request (the server's last ones were freed)."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.scheduler.requests, f"{len(engine.scheduler.requests)} requests left"


def test_completions_greedy_tokens_equal_the_engine(engine, oai):
    for prompts in (["hello there", "abc"], [[1, 2, 3, 4], [7, 8]]):
        got = oai.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True})
        idle(engine)
        want = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [c.token_ids for c in got.choices] == [w.token_ids for w in want]
        assert [c.text for c in got.choices] == [w.text for w in want]
        assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
        assert got.usage.completion_tokens == 12 and got.choices[0].finish_reason == "length"


def test_completions_stream_n_seed_and_logprobs(engine, oai):
    kw = dict(model="tiny", prompt="abc", max_tokens=5, temperature=1.0, seed=7, n=2,
              logprobs=2)
    plain = oai.completions.create(**kw, extra_body={"return_token_ids": True})
    chunks = list(oai.completions.create(**kw, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"return_token_ids": True}))
    ids = {0: [], 1: []}
    for ch in chunks[:-1]:
        for c in ch.choices:
            ids[c.index] += c.token_ids
            assert len(c.logprobs.token_logprobs) == len(c.token_ids)
    assert [ids[0], ids[1]] == [c.token_ids for c in plain.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    idle(engine)
    want = [engine.generate(["abc"], SamplingParams(max_tokens=5, temperature=1.0, seed=s),
                            use_tqdm=False)[0].token_ids for s in (7, 8)]
    assert [c.token_ids for c in plain.choices] == want  # choice j samples with seed + j
    assert all(len(c.logprobs.top_logprobs[0]) <= 2 for c in plain.choices)


def test_chat_plain_and_streamed_agree_with_the_engine(engine, oai):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                        temperature=0, extra_body={"return_token_ids": True})
    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage == plain.usage
    idle(engine)
    prompt = ChatTemplate(DEFAULT_TEMPLATE).render(messages)
    (want,) = engine.generate([prompt], GREEDY, use_tqdm=False)
    assert plain.choices[0].token_ids == want.token_ids
    assert plain.choices[0].message.content == want.text


def test_stop_strings_cut_the_text(engine, oai):
    (full,) = engine.generate(["stop here"], SamplingParams(max_tokens=24, temperature=0),
                              use_tqdm=False)
    assert len(full.text) >= 2, "the tiny model's greedy text decodes to too little to cut"
    stop = full.text[1]
    got = oai.completions.create(model="tiny", prompt="stop here", max_tokens=24,
                                 temperature=0, stop=[stop])
    assert got.choices[0].text == full.text[:full.text.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    idle(engine)


def test_streamed_stop_strings_cut_the_text_as_the_whole_body(engine, oai):
    (full,) = engine.generate(["stop here"], SamplingParams(max_tokens=24, temperature=0),
                              use_tqdm=False)
    stop = full.text[1:3]
    chunks = list(oai.completions.create(model="tiny", prompt="stop here", max_tokens=24,
                                         temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.text[:full.text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    idle(engine)


def test_penalties_reach_the_engine(engine, oai):
    knobs = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.5)
    (want,) = engine.generate(["again and again"], SamplingParams(
        max_tokens=12, temperature=0, **knobs), use_tqdm=False)
    got = oai.completions.create(model="tiny", prompt="again and again", max_tokens=12,
                                 temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                                 extra_body=dict(repetition_penalty=1.5))
    assert got.choices[0].text == want.text
    idle(engine)


def test_embeddings_float_and_base64_equal_the_engine(engine, oai):
    inputs = ["one document", "another, longer document"]
    got = oai.embeddings.create(model="tiny", input=inputs)
    b64 = oai.embeddings.create(model="tiny", input=inputs, encoding_format="base64")
    ids = oai.embeddings.create(model="tiny", input=[[9, 10, 11], [5, 6]])
    last = oai.embeddings.create(model="tiny", input=[9, 10, 11],
                                 extra_body={"pooling": "last", "normalize": False})
    idle(engine)
    want = engine.embed(inputs, use_tqdm=False)
    want_ids = engine.embed([[9, 10, 11], [5, 6]], use_tqdm=False)
    want_last = engine.embed([[9, 10, 11]], PoolingParams("last", normalize=False),
                             use_tqdm=False)
    np.testing.assert_allclose([d.embedding for d in got.data], want, rtol=0, atol=1e-6)
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in b64.data]
    np.testing.assert_allclose(decoded, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose([d.embedding for d in ids.data], want_ids, rtol=0, atol=1e-6)
    np.testing.assert_allclose(last.data[0].embedding, want_last[0], rtol=0, atol=1e-6)
    assert got.usage.prompt_tokens == sum(len(engine.tokenizer.encode(x)) for x in inputs)
    assert ids.usage.prompt_tokens == 5


def test_models_health_and_metrics(server, oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ('hetero_jax_requests_waiting{type="embed"}', "hetero_jax_tokens_per_second",
                 "hetero_jax_prefix_cache_hit_rate", 'hetero_jax_step_seconds_bucket{le="+Inf"}',
                 "hetero_jax_compiles_total", 'route="/v1/completions",status="200"'):
        assert name in text, name


C, CH, E = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (route, body, status, param)
    (C, dict(model="gpt-4", prompt="x"), 404, "model"),
    (C, dict(model="tiny", prompt=""), 400, "prompt"),
    (C, dict(model="tiny", prompt=[]), 400, "prompt"),
    (C, dict(model="tiny", prompt=5), 400, "prompt"),
    (C, dict(model="tiny", prompt=[1.5]), 400, "prompt"),
    (C, dict(model="tiny", prompt=["a", 3]), 400, "prompt"),
    (C, dict(model="tiny", prompt=[600]), 400, "prompt"),
    (C, dict(model="tiny", prompt=[1] * 600), 400, "prompt"),
    (C, dict(model="tiny"), 400, "prompt"),
    (C, dict(prompt="x"), 400, "model"),
    (C, dict(model="tiny", prompt="x", max_tokens="8"), 400, "max_tokens"),
    (C, dict(model="tiny", prompt="x", max_tokens=0), 400, "max_tokens"),
    (C, dict(model="tiny", prompt="x", max_tokens=1.5), 400, "max_tokens"),
    (C, dict(model="tiny", prompt="x", temperature=-1), 400, "temperature"),
    (C, dict(model="tiny", prompt="x", temperature="hot"), 400, "temperature"),
    (C, dict(model="tiny", prompt="x", top_p=0), 400, "top_p"),
    (C, dict(model="tiny", prompt="x", n=0), 400, "n"),
    (C, dict(model="tiny", prompt="x", logprobs=21), 400, "logprobs"),
    (C, dict(model="tiny", prompt="x", logprobs=10), 400, "prompt"),  # > max_logprobs=5
    (C, dict(model="tiny", prompt="x", stop=5), 400, "stop"),
    (C, dict(model="tiny", prompt="x", seed=-1), 400, "seed"),
    (C, dict(model="tiny", prompt="x", presence_penalty=2.5), 400, "presence_penalty"),
    (C, dict(model="tiny", prompt="x", repetition_penalty=0), 400, "repetition_penalty"),
    (C, dict(model="tiny", prompt="x", echo=True), 400, "echo"),
    (C, dict(model="tiny", prompt="x", best_of=3), 400, "best_of"),
    (C, dict(model="tiny", prompt="x", stream="yes"), 400, "stream"),
    (C, dict(model="tiny", prompt="x", frobnicate=1), 400, "frobnicate"),
    (CH, dict(model="tiny", messages=[]), 400, "messages"),
    (CH, dict(model="tiny", messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    (CH, dict(model="tiny", messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (CH, dict(model="tiny", messages=MSG, top_logprobs=2), 400, "top_logprobs"),
    (CH, dict(model="nope", messages=MSG), 404, "model"),
    (E, dict(model="tiny", input=""), 400, "input"),
    (E, dict(model="tiny", input=[]), 400, "input"),
    (E, dict(model="tiny", input="x", encoding_format="hex"), 400, "encoding_format"),
    (E, dict(model="tiny", input="x", pooling="max"), 400, "pooling"),
    (E, dict(model="tiny", input=[[1] * 600]), 400, "input"),
    (E, dict(model="tiny", input="x", dimensions=3), 400, "dimensions"),
    (E, dict(model="tiny", input="x", adapter="nope"), 400, "input"),
]


def check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("route, body, status, param", BAD,
                         ids=[f"{i}-{r.rsplit('/', 1)[1]}" for i, (r, *_) in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, route, body, status, param):
    r = httpx.post(server.url + route, json=body, headers={"Authorization": f"Bearer {KEY}"})
    check_error(r, status, param)


@pytest.mark.parametrize("headers, content, status", [
    ({}, json.dumps(dict(model="tiny", prompt="x")), 401),
    ({"Authorization": "Bearer sk-wrong"}, json.dumps(dict(model="tiny", prompt="x")), 401),
    ({"Authorization": f"Basic {KEY}"}, json.dumps(dict(model="tiny", prompt="x")), 401),
    ({"Authorization": f"Bearer {KEY}"}, "{not json", 400),
    ({"Authorization": f"Bearer {KEY}"}, "[1, 2]", 400),
    ({"Authorization": f"Bearer {KEY}"}, json.dumps(dict(model="tiny", prompt="x" * LIMIT)),
     413)])
def test_keys_bodies_and_sizes(server, headers, content, status):
    r = httpx.post(server.url + C, content=content, headers=headers)
    check_error(r, status, None)


def test_the_openai_package_raises_its_typed_errors(server, oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="prompt 0 is empty"):
        oai.completions.create(model="tiny", prompt="")
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-no", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    check_error(httpx.get(server.url + "/v1/nothing-here"), 404, None)


def test_a_disconnect_mid_stream_aborts_and_frees_pages(engine, server):
    free = engine.scheduler.pages.num_free
    counters = server.app.state.server.counters
    before, tokens = counters.disconnects, engine.stats.generated_tokens
    body = dict(model="tiny", prompt="a long one", max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.url + C, json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is running
    idle(engine)
    assert engine.scheduler.pages.num_free == free, "the aborted request's pages are back"
    assert engine.stats.generated_tokens - tokens < 400, "the request ran to its end"
    assert counters.disconnects == before + 1



def test_a_plain_request_whose_client_leaves_is_aborted(engine, server):
    """Not streamed: the handler waits on the connection's disconnect message, so a client
    that gives up (here its read timeout) aborts the request and frees its pages."""
    free = engine.scheduler.pages.num_free
    counters = server.app.state.server.counters
    before, tokens = counters.disconnects, engine.stats.generated_tokens
    body = dict(model="tiny", prompt="a long one", max_tokens=480, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=0.5))
    idle(engine)
    assert engine.scheduler.pages.num_free == free, "the aborted request's pages are back"
    assert engine.stats.generated_tokens - tokens < 480, "the request ran to its end"
    assert counters.disconnects == before + 1


def test_the_server_keeps_idle_connections_longer_than_clients_do():
    """A client reusing a connection the server closes that instant gets a reset
    (httpx.ReadError): the server's keep-alive outlasts httpx's (and the openai package's)."""
    assert UVICORN["timeout_keep_alive"] > httpx.Limits().keepalive_expiry

class FullQueue:
    """An EngineClient whose queue is full: the server must refuse before calling it."""

    tokenizer, max_model_len = None, 64

    @property
    def stats(self) -> FrontStats:
        return FrontStats(EngineStats(), {"generate": 3, "embed": 1}, {}, StepTimes())

    def generate(self, prompt, params=None, request_id=None) -> GenerateStream:
        raise AssertionError("a full queue must not take a request")

    async def embed(self, x, params=None, request_id=None) -> EmbeddingOutput:
        raise AssertionError("a full queue must not take a request")

    def abort(self, request_id) -> None:
        pass

    async def close(self) -> None:
        pass


def test_a_full_queue_answers_503_with_retry_after():
    with ServerThread(build_app(FullQueue(), ServerConfig("tiny", max_queued=4))) as srv:
        for route, body in [(C, dict(model="tiny", prompt="x")),
                            (E, dict(model="tiny", input="x"))]:
            r = httpx.post(srv.url + route, json=body)
            check_error(r, 503, None)
            assert r.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt="x")



def test_the_chat_template_comes_from_the_model_and_runs_sandboxed(tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chat = ChatTemplate(read_template(str(tmp_path)), eos_token="</s>")
    assert chat.render(MSG) == "[user] hi</s>"
    assert read_template(None) == DEFAULT_TEMPLATE
    hostile = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError, match="chat template refused"):
        hostile.render(MSG)


def test_serve_help_imports_no_jax():
    code = ("import sys\nfrom hetero_jax.cli import main\ntry:\n    main(['serve', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'jax' not in sys.modules, 'jax was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--api-key" in done.stdout and "--max-queued" in done.stdout


def test_the_online_bench_sends_over_http_and_in_process_alike(engine, server):
    trace = [(0.0, "embed", [1, 2, 3]), (0.0, "generate", [4, 5]), (0.01, "generate", [6])]

    async def run(sender):
        await sender.open()
        try:
            return await run_trace(trace, sender)
        finally:
            await sender.close()

    http = asyncio.run(run(HttpSender(server.url, KEY, 5)))
    idle(engine)
    local = asyncio.run(run(ClientSender(AsyncEngine(engine), 5)))
    for records in (http, local):
        assert [(r.kind, r.tokens, r.error) for r in records] == [
            ("embed", 0, None), ("generate", 5, None), ("generate", 5, None)]
        assert all(r.first is not None and r.start < r.first <= r.end for r in records[1:])
