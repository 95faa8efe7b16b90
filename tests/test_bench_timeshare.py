"""`bench.timeshare`: contenders served at once, one engine stepping at a time, in turns that
drain, each timed on its own clock; served so, the engines give the outputs they give alone."""
import asyncio
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from hetero_jax import Engine, EngineConfig, SamplingParams
from hetero_jax.bench.loop import Record
from hetero_jax.bench.timeshare import TimeShare, on_own_clock
from hetero_jax.cli import main
from hetero_jax.serving.async_engine import AsyncEngine


class Clock:
    """A clock that moves only when a fake step runs (one unit a step)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@dataclasses.dataclass
class Stats:
    compiles: int = 0
    compile_s: float = 0.0


class FakeEngine:
    """`steps` steps of work, each one unit of the clock; logs (name, drain) per step and
    fails if another engine is mid-step. Its stats read a compile cache it may share, as
    `Engine.count_compiles` does; its step number `compile_at` compiles one variant."""

    busy = threading.Lock()

    def __init__(self, name, steps, clock, log, before_first=None, cache=None, compile_at=None):
        self.name, self.left, self.clock, self.log = name, steps, clock, log
        self.before_first, self.compile_at = before_first, compile_at
        self.stats, self.cache = Stats(), cache or Stats()

    def count_compiles(self):
        self.stats = dataclasses.replace(self.cache)

    def has_work(self):
        return self.left > 0

    def step(self, drain=False):
        assert self.busy.acquire(blocking=False), "two engines stepped at once"
        try:
            if self.before_first:
                self.before_first, wait = None, self.before_first
                wait()
            self.log.append((self.name, drain))
            if len([n for n, _ in self.log if n == self.name]) == self.compile_at:
                self.cache.compiles += 1
                self.cache.compile_s += 1.5
            self.count_compiles()  # as `Engine.record_step` does at the end of a step
            self.clock.now += 1
            self.left -= 1
        finally:
            self.busy.release()


def test_turns_pass_on_after_the_step_that_crosses_the_slice_and_that_step_drains():
    """Turns of 3 units, steps of 1; what a step compiles counts for its own engine only."""
    clock, log = Clock(), []
    share = TimeShare(3, clock=clock, cpu=clock)
    a_in_turn = threading.Event()

    def until_b_waits():  # a's first step: b asks for a turn while a holds one
        a_in_turn.set()
        deadline = time.monotonic() + 30
        while "b" not in share.waiting and time.monotonic() < deadline:
            time.sleep(0.001)

    cache = Stats()  # one executable cache: b compiles a variant, a's stats see it too
    a = FakeEngine("a", 10, clock, log, before_first=until_b_waits, cache=cache)
    b = FakeEngine("b", 7, clock, log, cache=cache, compile_at=2)
    threads = [threading.Thread(target=lambda e=e: [share.step(e.name, e)
                                                    for _ in iter(e.has_work, False)])
               for e in (a, b)]
    threads[0].start()
    a_in_turn.wait(30)
    threads[1].start()
    for t in threads:
        t.join(timeout=60)
    # a's first turn: its 4th step is the first to begin 3 units into the turn; it drains,
    # and b, waiting, steps next
    assert log[:5] == [("a", False)] * 3 + [("a", True), ("b", False)]
    for name, engine_steps in (("a", 10), ("b", 7)):
        turns = share.turns[name]
        assert [end - start for start, end in turns[:-1]] == [4] * (len(turns) - 1)
        assert share.own_time(name, clock.now) == engine_steps == share.cpu_s[name]
        drained = [d for n, d in log if n == name]
        # every turn but the last (which ends when the engine has no work) ends draining
        assert drained.count(True) == len(turns) - 1
    assert sum(end - start for t in share.turns.values() for start, end in t) == 17 == clock.now
    assert (share.compiled["a"], share.compiled["b"]) == ((0, 0.0), (1, 1.5))


def test_own_clock_leaves_the_other_turns_out():
    clock, log = Clock(), []
    share = TimeShare(2, clock=clock, cpu=clock)
    share.turns["a"] = [(0.0, 2.0), (5.0, 7.0)]  # b held 2..5
    records = [Record("gen", 1.0, 6.0, 3.0), Record("embed", 4.0, 9.0)]
    assert [share.own_time("a", t) for t in (0.0, 1.0, 3.0, 5.0, 6.0, 10.0)] == [
        0, 1, 2, 2, 3, 4]
    assert on_own_clock(share, "a", records) == [Record("gen", 1.0, 3.0, 2.0),
                                                 Record("embed", 2.0, 4.0)]
    clock.now = 10.0
    a = FakeEngine("a", 1, clock, log)
    share.step("a", a)  # a turn of one step at 10..11, ended idle
    assert share.turns["a"][-1] == (10.0, 11.0) and share.own_time("a", 20.0) == 5


def test_engines_sharing_turns_give_the_outputs_they_give_alone():
    """Two engines (fcfs and ibs), every turn one step (so each hands over after every step,
    drained), serve generations and embeddings at once: the same tokens and embeddings as
    each engine alone; both took many turns."""
    config = EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
                          token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,))
    engines = {s: Engine.from_preset("tiny", config=dataclasses.replace(config, scheduler=s))
               for s in ("fcfs", "ibs")}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (5, 40, 17, 70)]
    texts = [rng.integers(3, 250, size=n).tolist() for n in (9, 50, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    alone = {s: ([o.token_ids for o in e.generate(prompts, params)],
                 list(e.embed(texts))) for s, e in engines.items()}
    share = TimeShare(1e-9)

    async def serve(name, engine):
        front = AsyncEngine(share.engine(name, engine))
        try:
            gens = [front.generate(p, params) for p in prompts]
            embs = [front.embed(t) for t in texts]
            outs = await asyncio.gather(*gens, *embs)
        finally:
            await front.close()
        return ([o.token_ids for o in outs[:len(prompts)]],
                [o.embedding for o in outs[len(prompts):]])

    async def together():
        return await asyncio.gather(*(serve(s, e) for s, e in engines.items()))

    shared = dict(zip(engines, asyncio.run(together())))
    for s in engines:
        assert shared[s][0] == alone[s][0]
        np.testing.assert_allclose(np.array(shared[s][1]), np.array(alone[s][1]), atol=1e-6)
        assert len(share.turns[s]) >= 5


def test_a_sliced_aa_run_times_both_on_their_own_clocks(tmp_path, capsys):
    path = tmp_path / "aa.json"
    assert main(["bench", "--quick", "--schedulers", "ibs", "--aa", "--ratios", "5:5",
                 "--repeats", "2", "--slice-s", "0.05", "--no-progress",
                 "--compile-cache", "none", "--json", str(path)]) == 0
    assert "in turns of 0.05 s" in capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    a, a2 = rows
    assert (a["scheduler"], a2["scheduler"]) == ("ibs", "ibs'")
    for r in rows:
        assert r["requests"] == 8 and len(r["requests_per_s_runs"]) == 2
        assert 0 < r["serving_s"] and r["p99_latency_s"] <= r["wall_s"]
    assert a2["rounds_within_3pct"] is not None


@pytest.mark.parametrize("flags, message", [
    (["--slice-s", "0"], "argument --slice-s: 0.0 is outside (0, 60]"),
    (["--slice-s", "0.5", "--schedulers", "ibs,dedicated"],
     "--slice-s 0.5 with the dedicated contender cannot share turns"),
])
def test_bad_slice_flags_fail_naming_the_value(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--preset", "tiny", *flags])
    assert message in capsys.readouterr().err
