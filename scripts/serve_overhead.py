"""What HTTP costs: one trace, alternately over loopback to running servers and in process.

    python scripts/serve_overhead.py --url http://127.0.0.1:8000 [--url URL2 ...] \
        [--server-pid PID ...] --preset tiny --pairs 5 \
        [bench-serve trace flags: --requests 200 --rate inf --embed-frac 0.5 ...]
    python scripts/serve_overhead.py --url http://127.0.0.1:8000 [--url URL2 ...] \
        --preset tiny --paired --runs 5 --requests 200

`--paired` measures the latency HTTP adds with nothing else running: each request of the
trace is sent alone, over each server's HTTP and in process one after the other (which goes
first rotates), and it prints per type and server the median and quartiles of the
per-request differences of end-to-end latency and TTFT; with `--runs K`, K such runs (seeds
seed .. seed + K - 1) and the median of their medians. Pairing request by request keeps the
machine's load, which moves from second to second, out of the difference.

The servers must run the same engine flags (`hetero-jax serve --preset tiny ...`, with or
without `--engine-process`); this process builds the same engine behind an `AsyncEngine`.
Each round runs the same seeded trace over HTTP on each server in turn
(`bench.online.HttpSender`, streamed) and then through the in-process `EngineClient`
(`ClientSender`), so the machine's background load falls on all alike. Prints each round's
requests/s and p50 latencies and, per server, the medians of the ratios: requests/s HTTP / in
process, and the added p50 end-to-end latency (ms) per type. Since other work on the machine
moves wall times a lot, each round also counts CPU seconds: with `--server-pid` (one per
`--url`), the server's (its child processes included) and this process's (the HTTP client's)
for HTTP rounds, this process's (engine and caller) for in-process rounds; their ratio is the
cost of HTTP that load does not move.
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
    """CPU seconds (user + system) of process `pid` and its live children (None: this
    process alone), so a server whose engine steps in a child of its own counts it too."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            total += sum(cpu_s(int(child)) for child in f.read().split())
    return total


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


def servers(args) -> list:
    """[(url, pid or None)] of the servers to compare with the in-process front."""
    pids = list(args.server_pid or []) + [None] * len(args.url)
    return list(zip(args.url, pids))


async def pairs(args, argv: list) -> list:
    """Rounds of the same seeded trace on each server and in process, in turn -> per round
    [(server rows...), in-process row]."""
    http = [(HttpSender(url, None, args.output_len, stream=True), pid)
            for url, pid in servers(args)]
    local = ClientSender(build_client(serve_parser().parse_args(argv)), args.output_len)
    warm, slo = make_trace(argparse.Namespace(**dict(vars(args), requests=8)), 99), slo_of(args)
    for sender, _ in http + [(local, None)]:
        await one_round(sender, warm, slo)
    out = []
    for i in range(args.pairs):
        trace = make_trace(args, args.seed + i)
        rows = [await one_round(sender, trace, slo, pid) for sender, pid in http]
        out.append((rows, await one_round(local, trace, slo)))
        for (url, _), h in zip(servers(args), rows):
            p = out[-1][1]
            print(f"pair {i} {url}: CPU s http {h['cpu_s']:.2f} (server "
                  f"{h['server_cpu_s']:.2f}) in-process {p['cpu_s']:.2f}; req/s http "
                  f"{h['requests_per_s']:.2f} in-process {p['requests_per_s']:.2f}; gen p50 ms "
                  f"{h['generate_e2e_p50_ms']:.1f} / {p['generate_e2e_p50_ms']:.1f}; embed p50 "
                  f"ms {h['embed_e2e_p50_ms']:.1f} / {p['embed_e2e_p50_ms']:.1f}; errors "
                  f"{h['errors']} / {p['errors']}", flush=True)
    return out


async def paired(args, argv: list) -> list:
    """`--runs` runs; in each, every request alone over each server's HTTP and in process,
    the order rotating -> per run {kind: [((http Record per server), local Record)]}."""
    http = [HttpSender(url, None, args.output_len, stream=True) for url, _ in servers(args)]
    local = ClientSender(build_client(serve_parser().parse_args(argv)), args.output_len)
    senders = http + [local]
    for sender in http:
        await sender.open()
    runs = []
    for run in range(args.runs):
        out: dict = {"generate": [], "embed": []}
        for i, (_, kind, ids) in enumerate(make_trace(args, args.seed + run)):
            records = {}
            for sender in senders[i % len(senders):] + senders[:i % len(senders)]:
                records[sender] = await (sender.embed if kind == "embed" else
                                         sender.generate)(ids)
            out[kind].append((tuple(records[h] for h in http), records[local]))
        runs.append(out)
        report_paired(out, [url for url, _ in servers(args)], f"run {run}: ")
    for sender in http:
        await sender.close()
    return runs


def quartiles(xs: list) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"median {q[1] * 1e3:.2f} ms (quartiles {q[0] * 1e3:.2f} .. {q[2] * 1e3:.2f})"


def added(pairs_: list, j: int) -> dict:
    """Per-request differences, server `j` - in process -> {"e2e": [s], "ttft": [s]}."""
    out = {"e2e": [(h[j].end - h[j].start) - (p.end - p.start) for h, p in pairs_]}
    if pairs_ and pairs_[0][1].first is not None:
        out["ttft"] = [h[j].ttft - p.ttft for h, p in pairs_]
    return out


def report_paired(out: dict, urls: list, head: str = "") -> None:
    for kind, pairs_ in out.items():
        pairs_ = pairs_[2:]  # the first of each kind warms both paths up
        if len(pairs_) < 2:
            continue
        for j, url in enumerate(urls):
            errors = sum(h[j].error is not None for h, _ in pairs_)
            diffs = added(pairs_, j)
            ttft = f"; added TTFT {quartiles(diffs['ttft'])}" if "ttft" in diffs else ""
            print(f"{head}{kind} {url}: {len(pairs_)} pairs, {errors} HTTP errors; added "
                  f"end-to-end {quartiles(diffs['e2e'])}{ttft}; in-process end-to-end "
                  f"{quartiles([p.end - p.start for _, p in pairs_])}", flush=True)


def summary_paired(runs: list, urls: list) -> None:
    """The median over runs of each run's median added latency, per server and kind."""
    for kind in ("generate", "embed"):
        for j, url in enumerate(urls):
            meds = [statistics.median(added(r[kind][2:], j)["e2e"]) * 1e3 for r in runs
                    if len(r[kind]) > 3]
            if meds:
                print(f"{kind} {url}: median over {len(meds)} runs of the added end-to-end "
                      f"p50: {statistics.median(meds):.2f} ms (runs: "
                      f"{', '.join(f'{m:.1f}' for m in meds)})")


def main(argv) -> None:
    ap = argparse.ArgumentParser(parents=[build_parser()], add_help=False,
                                 conflict_handler="resolve")
    ap.add_argument("--url", action="append", required=True,
                    help="a running server (repeat to compare several)")
    ap.add_argument("--server-pid", action="append", type=int, default=None,
                    help="each server's pid, in --url order (CPU seconds, children included)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1, help="--paired: runs, seeds seed + k")
    ap.add_argument("--paired", action="store_true",
                    help="each request alone over HTTP and in process (see the docstring)")
    args = ap.parse_args(argv)
    urls = [url for url, _ in servers(args)]
    if args.paired:
        summary_paired(asyncio.run(paired(args, serve_argv(args, args.schedulers[0]))), urls)
        return
    out = asyncio.run(pairs(args, serve_argv(args, args.schedulers[0])))
    for j, (url, pid) in enumerate(servers(args)):
        ratio = statistics.median(h[j]["requests_per_s"] / p["requests_per_s"] for h, p in out)
        print(f"{url}: median requests/s ratio http / in-process over {len(out)} pairs: "
              f"{ratio:.3f}")
        if pid:
            for key in ("cpu_s", "server_cpu_s"):
                cpu = statistics.median(p["cpu_s"] / h[j][key] for h, p in out)
                print(f"{url}: median CPU-seconds ratio in-process / http ({key}): {cpu:.3f}")
        for kind in ("generate", "embed"):
            key = f"{kind}_e2e_p50_ms"
            diff = statistics.median(h[j][key] - p[key] for h, p in out if h[j][key] and p[key])
            print(f"{url}: median added p50 latency, {kind}: {diff:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
