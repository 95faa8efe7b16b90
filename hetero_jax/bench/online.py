"""`hetero-jax bench-serve`: open-loop arrivals of a mixed embed + generate trace.

    hetero-jax bench-serve --url http://127.0.0.1:8000 [--rate 20] [--requests 200] ...
    hetero-jax bench-serve --preset tiny --schedulers ibs,fcfs [--in-process] ...

In: a seeded trace (`make_trace`): each request an embedding of `--embed-len` token ids or a
generation of `--prompt-len` ids and `--output-len` tokens (greedy, `ignore_eos`), mixed at
`--embed-frac`, arriving open-loop (`--arrival poisson` or `fixed` at `--rate` requests/s, or
all at once with `--rate inf`): a request is sent at its arrival time whether or not earlier
ones have finished, as vLLM's serving benchmark and the Orthrus paper measure. Out: per run a
row of `online_report.summarize` (TTFT, TPOT, end-to-end p50/p99 per type, requests/s,
tokens/s, goodput at `--slo-*`), printed as a table, and with `--json` / `--plot` a file each.

Where the requests go: `--url` is a running server (`hetero-jax serve`); or, with `--preset`
or `--model`, the bench starts one server process per `--schedulers` entry on a free loopback
port (its engine flags are `serve`'s, passed through), warms it up and stops it after its run.
`--in-process` also runs the trace on an `AsyncEngine` in this process, built from the same
engine flags (with `--url` too: give the flags that server was started with), through the same `EngineClient` calls the server makes: the overhead of HTTP is the
difference. Generations are streamed (SSE over HTTP). `--rounds R` repeats the trace on one
server and reads the server's RSS after each round (a flat column: no memory held per request).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time

from hetero_jax.bench.online_report import COLUMNS, Record, plot_cdfs, summarize
from hetero_jax.sim.options import DefaultsHelpFormatter, int_range, name_list, output_file, \
    real_range, write_json
from hetero_jax.sim.report import format_table

SERVE_FLAGS = ("--preset", "--model", "--token-budget", "--chunk-size", "--max-num-seqs",
               "--max-model-len", "--batching", "--replicas", "--dtype")


def _rate(text: str) -> float:
    """Requests/s: a positive number, or inf (every request at once)."""
    return math.inf if text == "inf" else real_range(0, open_lo=True)(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetero-jax bench-serve", formatter_class=DefaultsHelpFormatter,
        description="Open-loop benchmark of the OpenAI server over HTTP (see the module doc).")
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--api-key", default=None, help="the server's key, if it needs one")
    p.add_argument("--server-pid", type=int_range(1, 2**31 - 1), default=None,
                   help="read this process's RSS after each round (with --url)")
    for flag in SERVE_FLAGS:
        p.add_argument(flag, default=None, help=f"passed to each started server's {flag}")
    p.add_argument("--schedulers", type=name_list(("ibs", "fcfs", "homogeneous"), "scheduler"),
                   default=["ibs"], help="start one server per scheduler (comma-separated)")
    p.add_argument("--in-process", action="store_true", help="also run the trace on an "
                   "AsyncEngine in this process (the first scheduler)")
    p.add_argument("--requests", type=int_range(1, 1_000_000), default=200,
                   help="requests per run")
    p.add_argument("--rate", type=_rate, default=math.inf,
                   help="requests/s (inf: all at once)")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="exponential gaps (poisson) or equal ones (fixed) at --rate")
    p.add_argument("--embed-frac", type=real_range(0, 1), default=0.5,
                   help="share of embedding requests")
    p.add_argument("--embed-len", type=int_range(1, 100_000), default=64,
                   help="tokens per embedding input")
    p.add_argument("--prompt-len", type=int_range(1, 100_000), default=32,
                   help="tokens per generation prompt")
    p.add_argument("--output-len", type=int_range(1, 100_000), default=16,
                   help="tokens generated per prompt")
    p.add_argument("--no-stream", action="store_true", help="ask for whole completions over "
                   "HTTP (TTFT is then the end-to-end latency)")
    p.add_argument("--rounds", type=int_range(1, 1000), default=1,
                   help="repeat the trace on each server; RSS is read after each")
    p.add_argument("--slo-ttft-ms", type=real_range(0), default=1000.0,
                   help="goodput: a generation's time to first token at most this")
    p.add_argument("--slo-tpot-ms", type=real_range(0), default=200.0,
                   help="goodput: and its time per later token at most this")
    p.add_argument("--slo-embed-ms", type=real_range(0), default=1000.0,
                   help="goodput: an embedding's end-to-end latency at most this")
    p.add_argument("--seed", type=int_range(0, 2**32 - 1), default=0,
                   help="the trace (kinds, token ids, arrival gaps)")
    p.add_argument("--json", type=output_file, default=None, metavar="PATH",
                   help="write the rows here")
    p.add_argument("--plot", type=output_file, default=None, metavar="PATH",
                   help="write latency CDFs here (PNG)")
    return p


def make_trace(args, seed: int) -> list:
    """[(arrival s, kind, token ids)], sorted by arrival."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for _ in range(args.requests):
        kind = "embed" if rng.random() < args.embed_frac else "generate"
        n = args.embed_len if kind == "embed" else args.prompt_len
        trace.append((t, kind, [rng.randint(1, 255) for _ in range(n)]))
        if math.isfinite(args.rate):
            t += rng.expovariate(args.rate) if args.arrival == "poisson" else 1 / args.rate
    return trace


async def run_trace(trace: list, sender) -> list:
    """Send each request at its arrival time; -> its Record, in trace order."""
    start = time.perf_counter()
    tasks = []
    for arrival, kind, ids in trace:
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        call = sender.embed if kind == "embed" else sender.generate
        tasks.append(asyncio.ensure_future(call(ids)))
    return await asyncio.gather(*tasks)


class HttpSender:
    """Requests over HTTP to one server (aiohttp, as vLLM's serving benchmark uses: on this
    host it spends half httpx's CPU on a streamed request, 4.6 against 9.7 ms for 16 tokens,
    CPU the server's steps would otherwise share; a connection per request in flight, a new
    session per `open`, so no round reuses a connection the server has since closed). A
    request that fails, in HTTP or in the stream, is a Record with its error."""

    def __init__(self, url: str, key: str | None, output_len: int, stream: bool = True):
        self.url, self.key = url, key
        self.output_len, self.model, self.stream = output_len, None, stream

    async def open(self) -> None:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.http = aiohttp.ClientSession(
            base_url=self.url, headers=headers, timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=5))
        async with self.http.get("/v1/models") as r:
            self.model = (await r.json())["data"][0]["id"]

    async def embed(self, ids: list) -> Record:
        return await _caught(self._embed(ids), "embed")

    async def generate(self, ids: list) -> Record:
        return await _caught(self._generate(ids), "generate")

    async def _embed(self, ids: list) -> Record:
        t0 = time.perf_counter()
        async with self.http.post("/v1/embeddings",
                                  json={"model": self.model, "input": ids}) as r:
            body = await r.read()
        error = None if r.status == 200 else f"{r.status} {body[:200]!r}"
        return Record("embed", t0, time.perf_counter(), error=error)

    async def _generate(self, ids: list) -> Record:
        body = {"model": self.model, "prompt": ids, "max_tokens": self.output_len,
                "temperature": 0, "ignore_eos": True, "stream": self.stream,
                "return_token_ids": True}
        rec = Record("generate", time.perf_counter(), 0.0)
        async with self.http.post("/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"{r.status} {(await r.read())[:200]!r}"
            elif not self.stream:
                choices = (await r.json())["choices"]
                rec.first = time.perf_counter()
                rec.tokens = sum(len(c["token_ids"]) for c in choices)
            else:
                await _read_stream(r.content, rec)
        rec.end = time.perf_counter()
        return rec

    async def close(self) -> None:
        await self.http.close()


async def _read_stream(lines, rec: Record) -> None:
    """Server-sent events of a streamed completion -> `rec`'s tokens, first-token time and
    the error a chunk reports."""
    async for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            rec.error = chunk["error"]["message"]
            return
        n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
        if n and rec.first is None:
            rec.first = time.perf_counter()
        rec.tokens += n


async def _caught(call, kind: str) -> Record:
    """`call`'s Record, or one with the transport error that stopped it."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        return await call
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Record(kind, t0, time.perf_counter(), error=f"{type(e).__name__}: {e}")


class ClientSender:
    """The same requests through an EngineClient in this process (no HTTP)."""

    def __init__(self, client, output_len: int):
        from hetero_jax.requests import SamplingParams

        self.client = client
        self.params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    async def open(self) -> None:
        pass

    async def embed(self, ids: list) -> Record:
        t0 = time.perf_counter()
        await self.client.embed(ids)
        return Record("embed", t0, time.perf_counter())

    async def generate(self, ids: list) -> Record:
        rec = Record("generate", time.perf_counter(), 0.0)
        async for d in self.client.generate(ids, self.params):
            if d.token_ids and rec.first is None:
                rec.first = time.perf_counter()
            rec.tokens += len(d.token_ids)
        rec.end = time.perf_counter()
        return rec

    async def close(self) -> None:
        pass


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return kb / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list, timeout_s: float = 900.0) -> tuple:
    """A `hetero-jax serve` process on a free loopback port, warmed up -> (process, url)."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hetero_jax.cli", "serve", *argv,
                             "--port", str(port)], env=dict(os.environ))
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


async def bench(sender, args, name: str, pid: int) -> list:
    """Warm-up, then `--rounds` runs of the trace -> [(row, records)]."""
    await sender.open()
    await run_trace(make_trace(argparse.Namespace(**dict(vars(args), requests=4)),
                               args.seed + 99), sender)
    await sender.close()
    slo = slo_of(args)
    out = []
    for i in range(args.rounds):
        await sender.open()
        records = await run_trace(make_trace(args, args.seed + i), sender)
        await sender.close()
        run = name if args.rounds == 1 else f"{name} #{i + 1}"
        out.append((dict(summarize(records, slo), run=run, server_rss_mb=rss_mb(pid)),
                    records))
    return out


def slo_of(args) -> dict:
    """The latency bounds of goodput, in seconds, from the `--slo-*` flags."""
    return dict(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3,
                e2e_s=args.slo_embed_ms / 1e3)


def serve_argv(args, scheduler: str) -> list:
    """`hetero-jax serve` arguments of the engine flags given (SERVE_FLAGS) and `scheduler`."""
    argv = ["--scheduler", scheduler]
    for flag in SERVE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, value]
    return argv


def _runs(args) -> list:
    """[(row, records)] of every run the flags ask for."""
    out = []
    if args.url:
        out += asyncio.run(bench(HttpSender(args.url, args.api_key, args.output_len,
                                            not args.no_stream), args, "http",
                                 args.server_pid or -1))
    for scheduler in args.schedulers if not args.url else []:
        proc, url = start_server(serve_argv(args, scheduler))
        try:
            out += asyncio.run(bench(HttpSender(url, None, args.output_len, not args.no_stream),
                                     args, f"http {scheduler}", proc.pid))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.in_process:
        from hetero_jax.server.cli import build_client
        from hetero_jax.server.cli import build_parser as serve_parser

        client = build_client(serve_parser().parse_args(serve_argv(args, args.schedulers[0])))
        out += asyncio.run(bench(ClientSender(client, args.output_len), args,
                                 f"in-process {args.schedulers[0]}", os.getpid()))
    return out


def online_main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.url and not (args.preset or args.model):
        parser.error("give --url of a running server, or --preset/--model to start one")
    if args.in_process and not (args.preset or args.model):
        parser.error("--in-process builds an engine: give --preset or --model")
    runs = _runs(args)
    rows = [row for row, _ in runs]
    print(format_table(rows, COLUMNS))
    for row in rows:
        if row["first_error"]:
            print(f"{row['run']}: first error: {row['first_error']}")
    if args.json:
        write_json(args.json, dict(args={k: v for k, v in vars(args).items()
                                         if isinstance(v, (str, int, float, list, type(None)))},
                                   rows=rows), indent=1)
    if args.plot:
        plot_cdfs({row["run"]: records for row, records in runs}, args.plot)
    return 0
