"""The bench's outputs: a fixed-width table and a PNG plot (matplotlib, Agg backend).

In: result rows (dicts from `loop.summarize`, plus `scheduler`, `ratio`, `vs_ibs`).
Out: the table's columns (`COLUMNS`, printed by `sim.report.format_table`) and the notes under
it; the plot written to a path.
"""
from __future__ import annotations

# (header, row key, format)
COLUMNS = [
    ("scheduler", "scheduler", "{}"), ("ratio", "ratio", "{}"),
    ("req/s", "requests_per_s", "{:.2f}"), ("emb req/s", "embed_requests_per_s", "{:.2f}"),
    ("gen req/s", "gen_requests_per_s", "{:.2f}"), ("emb tok/s", "embed_tokens_per_s", "{:.0f}"),
    ("gen tok/s", "gen_tokens_per_s", "{:.0f}"), ("p50 s", "p50_latency_s", "{:.1f}"),
    ("p99 s", "p99_latency_s", "{:.1f}"), ("TTFT p50 s", "ttft_p50_s", "{:.2f}"),
    ("fill", "budget_fill", "{:.0%}"), ("steps", "steps", "{}"), ("compiles", "compiles", "{}"),
    ("compile s", "compile_s", "{:.1f}"), ("hit", "cache_hit_rate", "{:.0%}"),
    ("req/CPU-s", "requests_per_cpu_s", "{:.2f}"), ("x ibs", "vs_ibs", "{:.2f}"),
    ("x ibs 95% CI", "vs_ibs_ci", "{0[0]:.3f}-{0[1]:.3f}"), ("noise", "noise", "{}"),
    ("x no cache", "vs_no_cache", "{:.2f}"),
    ("x fcfs", "vs_fcfs", "{:.2f}"),
]


NOTES = """\
req/s, tok/s: per second of serving time, the wall time from the first submit to the last
  finish less the seconds spent compiling new step shapes ("compile s"; a compile stops the
  engine and every closed-loop client with it). gen tok/s counts generated tokens.
req/CPU-s: requests per CPU-second of the bench's process (every thread; dedicated's worker
  processes are not counted).
x ibs 95% CI (with --repeats >= 2): the bootstrap interval of mean req/s over ibs's mean (A/A:
  over the first contender's), resampling rounds (the contenders run interleaved, one run
  each per round); noise: "inside" when the interval holds 1, so the repeats cannot tell the
  two apart.
p50/p99: latency from submit to finish, all requests; TTFT: generation requests.
fill: scheduled tokens / (steps x token budget), both workers together for dedicated.
hit: prompt tokens found in the prefix cache / tokens looked up; "x no cache": requests/s over
  the same scheduler's run with prefix caching off ("<scheduler>/no-cache").
<scheduler>+<batching>: a batch-forming policy (fcfs, lpm, feather, feather-bandit, or
  feather[arm] with one fixed arm); "x fcfs": requests/s over <scheduler>+fcfs; "/plain":
  cascade attention off (every decode sequence reads all its pages).
dedicated: two single-core engine processes, one for embeddings and one for generation;
  each serves one batch at a time, so a request that arrives while its worker's batch runs
  waits for the next batch. Its compile s is the longer of the two workers' (subtracting it
  favours dedicated).
hf: transformers on PyTorch CPU, the same clients over static batches: each round runs every
  pending request (embeddings, then generations); new requests wait for the next round."""


def plot_results(rows: list, path: str, title: str = "") -> None:
    """Two panels: requests/s by scheduler for each ratio (grouped bars, the embed and gen
    parts stacked), and p99 latency the same way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = list(dict.fromkeys(r["ratio"] for r in rows))
    scheds = list(dict.fromkeys(r["scheduler"] for r in rows))
    by = {(r["scheduler"], r["ratio"]): r for r in rows}
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / len(scheds)
    colors = plt.get_cmap("tab10").colors
    for j, s in enumerate(scheds):
        xs = [i + (j - (len(scheds) - 1) / 2) * width for i in range(len(ratios))]
        get = lambda k: [(by.get((s, q)) or {}).get(k) or 0.0 for q in ratios]  # noqa: E731
        emb, gen = get("embed_requests_per_s"), get("gen_requests_per_s")
        ax_tp.bar(xs, emb, width, color=colors[j % 10], label=s, edgecolor="black", lw=0.4)
        ax_tp.bar(xs, gen, width, bottom=emb, color=colors[j % 10], alpha=0.55, hatch="//",
                  edgecolor="black", lw=0.4)
        for x, e, g in zip(xs, emb, gen):
            if e + g:
                ax_tp.text(x, e + g, f"{e + g:.2f}", ha="center", va="bottom", fontsize=7)
        ax_lat.bar(xs, get("p99_latency_s"), width, color=colors[j % 10], label=s,
                   edgecolor="black", lw=0.4)
    for ax, label in ((ax_tp, "requests/s (solid: embed, hatched: generate)"),
                      (ax_lat, "p99 latency (s), lower is better")):
        ax.set_xticks(range(len(ratios)), ratios)
        ax.set_xlabel("embed:gen ratio" if ratios[0] != "iter-retgen" else "workload")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax_tp.set_title("throughput, higher is better")
    ax_lat.set_title("tail latency")
    ax_tp.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
