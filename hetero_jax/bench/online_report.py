"""The online benchmark's numbers: per-type latencies, throughput, goodput; a table and a plot.

In: `Record`s of one run (kind, send time, first-token time, finish time, tokens, error) and
the latency bounds of goodput. Out: one result row per run (`summarize`: per type TTFT, time
per output token and end-to-end p50/p99, requests/s, tokens/s, goodput), printed with
`sim.report.format_table`, and a PNG of the end-to-end latency CDFs. Plain Python (matplotlib
for the plot only); imports no jax.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sim.report import percentile

KINDS = ("embed", "generate")


@dataclasses.dataclass
class Record:
    kind: str  # "embed" | "generate"
    start: float  # perf_counter when it was sent
    end: float  # when its answer was whole
    first: float | None = None  # generate: when its first token came
    tokens: int = 0  # generate: tokens received
    error: str | None = None  # status and message of a failed request

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.end) - self.start

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None below two tokens)."""
        if self.tokens < 2 or self.first is None:
            return None
        return (self.end - self.first) / (self.tokens - 1)


def _ms(xs: list, q: float) -> float | None:
    p = percentile([x for x in xs if x is not None], q)
    return None if p is None else 1e3 * p


def _good(r: Record, slo: dict) -> bool:
    if r.error is not None:
        return False
    if r.kind == "embed":
        return r.end - r.start <= slo["e2e_s"]
    return r.ttft <= slo["ttft_s"] and (r.tpot is None or r.tpot <= slo["tpot_s"])


def summarize(records: list, slo: dict) -> dict:
    """One row: wall time, requests/s, tokens/s, goodput (requests/s that met `slo`:
    e2e_s for embeddings, ttft_s and tpot_s for generations), and per kind the count,
    errors and latency percentiles in ms."""
    wall = max(r.end for r in records) - min(r.start for r in records)
    ok = [r for r in records if r.error is None]
    row = dict(requests=len(records), errors=len(records) - len(ok), wall_s=wall,
               requests_per_s=len(ok) / wall, tokens_per_s=sum(r.tokens for r in ok) / wall,
               goodput=sum(_good(r, slo) for r in records) / wall)
    for kind in KINDS:
        mine = [r for r in ok if r.kind == kind]
        row[f"{kind}_n"] = len(mine)
        for q in (50, 99):
            row[f"{kind}_e2e_p{q}_ms"] = _ms([r.end - r.start for r in mine], q)
            if kind == "generate":
                row[f"ttft_p{q}_ms"] = _ms([r.ttft for r in mine], q)
                row[f"tpot_p{q}_ms"] = _ms([r.tpot for r in mine], q)
    first_error = next((r.error for r in records if r.error is not None), None)
    return dict(row, first_error=first_error)


COLUMNS = [
    ("run", "run", "{}"), ("req", "requests", "{}"), ("err", "errors", "{}"),
    ("req/s", "requests_per_s", "{:.2f}"), ("tok/s", "tokens_per_s", "{:.0f}"),
    ("goodput", "goodput", "{:.2f}"), ("emb p50 ms", "embed_e2e_p50_ms", "{:.1f}"),
    ("emb p99 ms", "embed_e2e_p99_ms", "{:.1f}"), ("TTFT p50 ms", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 ms", "ttft_p99_ms", "{:.1f}"), ("TPOT p50 ms", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99 ms", "tpot_p99_ms", "{:.1f}"), ("gen p50 ms", "generate_e2e_p50_ms", "{:.1f}"),
    ("gen p99 ms", "generate_e2e_p99_ms", "{:.1f}"), ("RSS MB", "server_rss_mb", "{:.0f}"),
]


def plot_cdfs(runs: dict, path: str) -> None:
    """End-to-end latency CDF per kind, one line per run ({name: [Record]})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, KINDS):
        for name, records in runs.items():
            xs = sorted(1e3 * (r.end - r.start) for r in records
                        if r.kind == kind and r.error is None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xlabel(f"{kind} end-to-end latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
