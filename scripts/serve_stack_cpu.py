"""What the HTTP stack costs a streamed completion, with the engine taken out: CPU and wall.

    python scripts/serve_stack_cpu.py [--requests 300] [--tokens 16] [--step-ms 0]

A child process serves the real app (`server.app.build_app`, uvicorn with `serve`'s settings)
over `serve_app_cpu.Instant`, a fake `EngineClient` whose deltas come `--step-ms` apart (0: at
once) and cost no CPU; this process sends it one streamed completion after another with the
benchmark's client (`bench.online.HttpSender`: aiohttp, the SSE parse of `serve_overhead.py`).
Prints per request the median wall time and the CPU seconds of the client (this process) and
of the server (the child), all of which a streamed request over loopback pays on top of what
it costs in process. With `--step-ms 0` the wall time is the stack's whole serial cost: every
hop, write, wake-up and parse of every chunk, one after another.
"""
import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from hetero_jax.bench.online import HttpSender  # noqa: E402
from serve_overhead import cpu_s  # noqa: E402


def serve(port: int, tokens: int, step_ms: float) -> None:
    """The child: uvicorn on `port` over the fake engine."""
    import uvicorn

    from hetero_jax.server.app import ServerConfig, build_app
    from hetero_jax.server.cli import UVICORN
    from serve_app_cpu import Instant

    app = build_app(Instant(tokens, step_ms / 1e3), ServerConfig(model="tiny"))
    uvicorn.run(app, host="127.0.0.1", port=port, **UVICORN)


async def measure(url: str, pid: int, args) -> list:
    """-> ([wall s per request], (client, server) CPU s of them all), after a warm-up."""
    sender = HttpSender(url, None, args.tokens, stream=True)
    await sender.open()
    ids = list(range(1, 33))
    for _ in range(20):
        await sender.generate(ids)
    rows = []
    server, client = cpu_s(pid), time.process_time()
    walls = []
    for _ in range(args.requests):
        rec = await sender.generate(ids)
        walls.append(rec.end - rec.start)
        assert rec.error is None and rec.tokens == args.tokens, f"{rec=}"
    cpu = (time.process_time() - client, cpu_s(pid) - server)
    await sender.close()
    return walls, cpu


def main(args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port),
                              "--tokens", str(args.tokens), "--step-ms", str(args.step_ms)])
    try:
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            time.sleep(0.2)
        walls, cpu = asyncio.run(measure(f"http://127.0.0.1:{port}", child.pid, args))
    finally:
        child.terminate()
        child.wait()
    q = statistics.quantiles(walls, n=4)
    print(f"{args.tokens} tokens, step {args.step_ms} ms, {args.requests} requests: wall "
          f"median {q[1] * 1e3:.3f} ms (quartiles {q[0] * 1e3:.3f} .. {q[2] * 1e3:.3f}); CPU "
          f"per request: client {cpu[0] / len(walls) * 1e3:.3f} ms, server "
          f"{cpu[1] / len(walls) * 1e3:.3f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve is not None:
        serve(a.serve, a.tokens, a.step_ms)
    else:
        main(a)
