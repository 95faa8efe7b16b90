"""The online benchmark's pieces: the trace, open-loop sending, and the summary numbers."""
import asyncio
import math

import pytest

from hetero_jax.bench.online import build_parser, make_trace, run_trace
from hetero_jax.bench.online_report import Record, summarize

SLO = dict(ttft_s=0.1, tpot_s=0.01, e2e_s=0.5)


def trace_args(**kw):
    return build_parser().parse_args(["--url", "http://x"] + [
        a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))])


def test_trace_is_seeded_mixed_and_open_loop():
    args = trace_args(requests=200, rate=50, embed_frac=0.25, embed_len=8, prompt_len=5)
    trace = make_trace(args, 3)
    assert trace == make_trace(args, 3) and trace != make_trace(args, 4)
    kinds = [k for _, k, _ in trace]
    assert 30 <= kinds.count("embed") <= 70
    assert all(len(ids) == (8 if k == "embed" else 5) for _, k, ids in trace)
    gaps = [b[0] - a[0] for a, b in zip(trace, trace[1:])]
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.005  # Poisson at 50/s: mean gap 20 ms
    fixed = make_trace(trace_args(requests=5, rate=10, arrival="fixed"), 0)
    assert [round(t, 6) for t, _, _ in fixed] == [0, 0.1, 0.2, 0.3, 0.4]
    burst = make_trace(trace_args(requests=5), 0)
    assert build_parser().parse_args(["--url", "u"]).rate == math.inf
    assert all(t == 0 for t, _, _ in burst)


def test_run_trace_sends_at_arrival_without_waiting_for_answers():
    """No answer comes until all three requests are sent: if a send waited for an earlier
    answer the run would never finish (the 10 s is a guard against hanging, not a bound)."""
    class Held:
        def __init__(self):
            self.sent, self.all_sent = [], asyncio.Event()

        async def embed(self, ids):
            return await self.generate(ids)

        async def generate(self, ids):
            self.sent.append(ids)
            if len(self.sent) == 3:
                self.all_sent.set()
            await self.all_sent.wait()
            return ids

    async def run():
        sender = Held()  # the Event binds to this loop
        trace = [(0.0, "embed", [1]), (0.01, "generate", [2]), (0.02, "embed", [3])]
        return await asyncio.wait_for(run_trace(trace, sender), 10)

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_summary_numbers_by_hand():
    records = [Record("embed", 0.0, 0.2), Record("embed", 1.0, 1.8),  # the second misses e2e
               Record("generate", 0.0, 0.5, first=0.05, tokens=11),  # TPOT 45 ms: misses
               Record("generate", 0.5, 0.6, first=0.55, tokens=6),  # TTFT 50 ms, TPOT 10 ms
               Record("generate", 1.0, 2.0, error="500 boom")]
    row = summarize(records, SLO)
    assert row["wall_s"] == 2.0 and row["errors"] == 1 and row["first_error"] == "500 boom"
    assert row["requests_per_s"] == 2.0 and row["tokens_per_s"] == 8.5
    assert row["goodput"] == 1.0  # the first embed and the second generation
    assert row["embed_e2e_p50_ms"] == pytest.approx(500.0)
    assert row["ttft_p50_ms"] == pytest.approx(50.0)
    assert row["tpot_p50_ms"] == pytest.approx(27.5)
    assert row["generate_n"] == 2 and row["embed_n"] == 2


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rate", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--schedulers", "ibs,nope"])
    assert trace_args(rate="inf").rate == math.inf
