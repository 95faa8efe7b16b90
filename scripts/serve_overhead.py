"""What HTTP costs: one trace, alternately over loopback to a running server and in process.

    python scripts/serve_overhead.py --url http://127.0.0.1:8000 --preset tiny --pairs 5 \
        [bench-serve trace flags: --requests 200 --rate inf --embed-frac 0.5 ...]
    python scripts/serve_overhead.py --url http://127.0.0.1:8000 --preset tiny --paired \
        --requests 200

`--paired` measures the latency HTTP adds with nothing else running: each request of the
trace is sent alone, over HTTP and in process one after the other (which goes first
alternates), and it prints per type the median and quartiles of the per-request differences
of end-to-end latency and TTFT. Pairing request by request keeps the machine's load, which
moves from second to second, out of the difference.

The server must run the same engine flags (`hetero-jax serve --preset tiny ...`); this process
builds the same engine behind an `AsyncEngine`. Each pair runs the same seeded trace over
HTTP (`bench.online.HttpSender`, streamed) and then through the in-process `EngineClient`
(`ClientSender`), so the machine's background load falls on both alike. Prints each pair's
requests/s and p50 latencies and the medians of the ratios: requests/s HTTP / in process,
and the added p50 end-to-end latency (ms) per type. Since other work on the machine moves wall
times a lot, each round also counts CPU seconds: with `--server-pid`, the server process's
and this process's (the HTTP client's) for HTTP rounds, this process's (engine and caller) for
in-process rounds; their ratio is the cost of HTTP that load does not move.
"""
import argparse
import asyncio
import os
import statistics
import sys

from hetero_jax.bench.online import ClientSender, HttpSender, build_parser, make_trace, \
    run_trace, serve_argv, slo_of
from hetero_jax.bench.online_report import summarize
from hetero_jax.server.cli import build_client
from hetero_jax.server.cli import build_parser as serve_parser


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of process `pid` (None: this one)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(sender, trace, slo: dict, server_pid=None) -> dict:
    await sender.open()
    before = cpu_s(None), cpu_s(server_pid) if server_pid else 0.0
    try:
        row = summarize(await run_trace(trace, sender), slo)
    finally:
        await sender.close()
    after = cpu_s(None), cpu_s(server_pid) if server_pid else 0.0
    return dict(row, cpu_s=after[0] - before[0] + after[1] - before[1],
                server_cpu_s=after[1] - before[1])


async def pairs(args, argv: list) -> list:
    http = HttpSender(args.url, None, args.output_len, stream=True)
    local = ClientSender(build_client(serve_parser().parse_args(argv)), args.output_len)
    warm, slo = make_trace(argparse.Namespace(**dict(vars(args), requests=8)), 99), slo_of(args)
    await one_round(http, warm, slo)
    await one_round(local, warm, slo)
    out = []
    for i in range(args.pairs):
        trace = make_trace(args, args.seed + i)
        out.append((await one_round(http, trace, slo, args.server_pid),
                    await one_round(local, trace, slo)))
        h, p = out[-1]
        print(f"pair {i}: CPU s http {h['cpu_s']:.2f} (server {h['server_cpu_s']:.2f}) "
              f"in-process {p['cpu_s']:.2f}; req/s http {h['requests_per_s']:.2f} in-process "
              f"{p['requests_per_s']:.2f}; gen p50 ms {h['generate_e2e_p50_ms']:.1f} / "
              f"{p['generate_e2e_p50_ms']:.1f}; embed p50 ms {h['embed_e2e_p50_ms']:.1f} / "
              f"{p['embed_e2e_p50_ms']:.1f}; errors {h['errors']} / {p['errors']}", flush=True)
    return out


async def server_steps(http) -> tuple:
    """(step seconds, steps) the server has run, from its /metrics."""
    text = (await http.http.get("/metrics")).text
    value = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    return float(value["hetero_jax_step_seconds_sum"]), float(value["hetero_jax_step_seconds_count"])


async def paired(args, argv: list) -> dict:
    """Each request alone over HTTP and in process -> {kind: [(http Record, local Record)]};
    prints the mean step time on both sides (the server's steps slowed by its HTTP work)."""
    http = HttpSender(args.url, None, args.output_len, stream=True)
    local = ClientSender(build_client(serve_parser().parse_args(argv)), args.output_len)
    await http.open()
    before = await server_steps(http)
    out: dict = {"generate": [], "embed": []}
    for i, (_, kind, ids) in enumerate(make_trace(args, args.seed)):
        records = {}
        for sender in (http, local) if i % 2 else (local, http):
            records[sender] = await (sender.embed if kind == "embed" else sender.generate)(ids)
        out[kind].append((records[http], records[local]))
    after, steps = await server_steps(http), local.client.stats.steps
    await http.close()
    print(f"mean step ms: server {(after[0] - before[0]) / (after[1] - before[1]) * 1e3:.2f} "
          f"over {after[1] - before[1]:.0f}, in process "
          f"{steps.total_s / sum(steps.counts) * 1e3:.2f} over {sum(steps.counts)}")
    return out


def quartiles(xs: list) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"median {q[1] * 1e3:.2f} ms (quartiles {q[0] * 1e3:.2f} .. {q[2] * 1e3:.2f})"


def report_paired(out: dict) -> None:
    for kind, pairs_ in out.items():
        pairs_ = pairs_[2:]  # the first of each kind warms both paths up
        if len(pairs_) < 2:
            continue
        errors = sum(h.error is not None for h, _ in pairs_)
        print(f"{kind}: {len(pairs_)} pairs, {errors} HTTP errors; added end-to-end "
              f"{quartiles([(h.end - h.start) - (p.end - p.start) for h, p in pairs_])}; "
              f"added TTFT {quartiles([h.ttft - p.ttft for h, p in pairs_])}; in-process "
              f"end-to-end {quartiles([p.end - p.start for _, p in pairs_])}")


def main(argv) -> None:
    ap = argparse.ArgumentParser(parents=[build_parser()], add_help=False)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--paired", action="store_true",
                    help="each request alone over HTTP and in process (see the docstring)")
    args = ap.parse_args(argv)
    if args.paired:
        report_paired(asyncio.run(paired(args, serve_argv(args, args.schedulers[0]))))
        return
    out = asyncio.run(pairs(args, serve_argv(args, args.schedulers[0])))
    ratio = statistics.median(h["requests_per_s"] / p["requests_per_s"] for h, p in out)
    print(f"median requests/s ratio http / in-process: {ratio:.3f}")
    if args.server_pid:
        for key in ("cpu_s", "server_cpu_s"):
            cpu = statistics.median(p["cpu_s"] / h[key] for h, p in out)
            print(f"median CPU-seconds ratio in-process / http ({key}): {cpu:.3f}")
    for kind in ("generate", "embed"):
        key = f"{kind}_e2e_p50_ms"
        added = statistics.median(h[key] - p[key] for h, p in out if h[key] and p[key])
        print(f"median added p50 latency, {kind}: {added:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
