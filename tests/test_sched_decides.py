"""The scheduler decides every step (no jax): it plans a decode-only step's cascade tiles into
`SchedulerOutput.cascade`, the runner's key comes from the one step-shape rule
(`sched/shapes.py`), its pool is read through `cache_stats()` and cleared through
`reset_prefix_cache()`, `EngineConfig.scheduler_config()` carries every shared knob, and the
engine's modules import no simulator."""
import dataclasses
import subprocess
import sys

import pytest

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.sched import DECODE, PREFILL, GenKnobs, ScheduledItem, SchedulerConfig
from hetero_jax.sched.shapes import Buckets, pad_to_bucket, step_key
from hetero_jax.sched.tiles import CascadeSettings, plan_tiles
from tests.sched_fakes import drive
from tests.test_prefix_pool import PS, cached_gen, caching_scheduler, step

CASCADE = CascadeSettings(rows=4, min_saved_pages=1, max_num_seqs=8)


def shared_prompt_requests(n: int, shared: int = 13) -> list:
    """n generation requests whose prompts share `shared` tokens (3 full pages of 4)."""
    prefix = list(range(1, shared + 1))
    return [cached_gen(i, prefix + [100 + i, 50 + i], max_tokens=6) for i in range(n)]


def test_a_decode_only_step_carries_the_plan_of_its_items():
    sched = caching_scheduler(max_num_seqs=8, cascade=CASCADE)
    reqs = shared_prompt_requests(4)
    for req in reqs:
        sched.add(req)
    planned = 0
    while sched.has_work():
        out, _ = step(sched)
        items = out.items
        if len(items) >= 2 and all(it.kind == DECODE for it in items):
            want = plan_tiles([it.pages for it in items], [it.start + 1 for it in items], PS,
                              *CASCADE.tiles(len(items)), CASCADE.min_saved_pages)
            assert out.cascade == want, "the plan is the planner's on exactly these items"
            planned += out.cascade is not None
        else:
            assert out.cascade is None, f"a step with {[it.kind for it in items]} has a plan"
    assert planned >= 3, f"{planned=}: four decodes sharing 3 pages should run as cascade"


def test_a_step_with_a_penalized_row_is_not_planned():
    """The penalties read each row's whole page table, so such a step runs plain attention."""
    plain = GenKnobs(temperature=0.0, top_k=0, top_p=1.0, seed=0, logprobs=None)
    penalized = dataclasses.replace(plain, frequency=0.5)
    items = [ScheduledItem(request_id=i, kind=DECODE, start=47, num_tokens=1, ends=True,
                           token_ids=(7,), pages=(1, 2, 3, 4 + i), knobs=plain)
             for i in range(4)]
    assert CASCADE.plan(items, PS) is not None, "four decodes sharing 3 pages are planned"
    items[2] = items[2]._replace(knobs=penalized)
    assert CASCADE.plan(items, PS) is None


def test_no_cascade_settings_no_plan_and_the_same_steps():
    """Planning changes only the plan: the items of every step are those without it."""
    def trace(cascade):
        sched = caching_scheduler(max_num_seqs=8, cascade=cascade)
        return drive(sched, {0: shared_prompt_requests(4)})
    with_plan, without = trace(CASCADE), trace(None)
    assert all(out.cascade is None for _, out, _ in without)
    assert any(out.cascade is not None for _, out, _ in with_plan)
    assert [out.items for _, out, _ in with_plan] == [out.items for _, out, _ in without]


def test_cache_stats_and_reset_go_through_the_scheduler():
    sched = caching_scheduler()
    free0 = sched.cache_stats().free_pages
    owner = cached_gen(0, list(range(1, 19)), max_tokens=5)
    sched.add(owner)
    step(sched)
    held = sched.cache_stats()
    assert held.free_pages == free0 - len(owner.pages) and held.queries == 1
    drive(sched, {})
    sched.add(cached_gen(1, list(range(1, 19))))
    step(sched)
    hit = sched.cache_stats()
    assert (hit.queries, hit.query_pages, hit.hit_pages) == (2, 8, 4)
    assert hit.cached_pages >= 4
    sched.reset_prefix_cache()
    assert sched.cache_stats().cached_pages == 0
    drive(sched, {})
    sched.add(cached_gen(2, list(range(1, 19))))
    step(sched)
    assert sched.cache_stats().hit_pages == 4, "after a reset the prompt is not found"
    drive(sched, {})
    assert sched.cache_stats().free_pages == free0, "every page back"


def item(kind, start, num_tokens, pages):
    return ScheduledItem(0, kind, start, num_tokens, True, pages=tuple(range(1, pages + 1)))


def test_the_step_shape_rule_by_hand():
    b = Buckets(tokens=(16, 32, 64), seqs=(4, 8), pages=(2, 8), chunk_seqs=(0, 2))
    assert b.step(17, 3, 1) == (32, 4, 2)
    assert b.step(5, 5, 0) == (16, 8, 0)
    # two chunks fitting 2 pages beside a decode at 5 pages: the chunk group keeps 2
    items = [item(PREFILL, 0, 8, 2), item(PREFILL, 0, 4, 1), item(DECODE, 70, 1, 5)]
    assert step_key(items, b, 16) == (16, 4, 2, 8, 2)
    plan = ([([0, 1, 2], 4)], [4, 4, 4])
    decodes = [item(DECODE, 100, 1, 7)] * 3
    assert step_key(decodes, b, 16, plan) == (16, 4, 0, 8, 8), "(7 - 4) pages rest, 4 shared"
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        pad_to_bucket(9, b.seqs)


def test_cascade_tiles_follow_the_configs_own_sequence_buckets():
    assert CascadeSettings(rows=8, max_num_seqs=32).tiles(9) == (2, 8)  # S = 16
    custom = EngineConfig(max_num_seqs=12, seq_buckets=(4, 12), cascade_rows=8).resolve(512, 64)
    assert custom.cascade_settings().tiles(5) == (1, 8) == custom.cascade_tiles(12)
    assert custom.cascade_settings().tiles(3) == (1, 4)


def test_scheduler_config_carries_every_shared_knob():
    cfg = EngineConfig(token_budget=128, chunk_size=32, max_num_seqs=16, max_chunk_seqs=2,
                       page_size=8, scheduler="ibs", batching="lpm", prefix_caching=False,
                       cascade_rows=4, cascade_min_pages=3, dtype="float32",
                       cost_model="roofline:h200").resolve(1024, 64)
    model = dataclasses.make_dataclass("M", ["num_layers", "hidden_size", "intermediate_size",
                                             "num_heads", "num_kv_heads", "head_dim",
                                             "vocab_size"])(2, 64, 128, 4, 2, 16, 300)
    sched = cfg.scheduler_config(model, encoder_max_seqs=3)
    shared = {f.name for f in dataclasses.fields(SchedulerConfig)} & {
        f.name for f in dataclasses.fields(EngineConfig)}
    assert shared >= {"token_budget", "chunk_size", "max_num_seqs", "max_chunk_seqs",
                      "page_size", "num_pages", "max_model_len", "prefix_caching", "batching",
                      "feather"}
    assert all(getattr(sched, name) == getattr(cfg, name) for name in shared)
    assert (sched.policy, sched.encoder_max_seqs) == ("ibs", 3)
    assert sched.cascade == CascadeSettings(4, 3, 16, cfg.seq_buckets)
    assert sched.step_cost.cascade == sched.cascade and sched.step_cost.model.model.num_layers == 2
    plain = dataclasses.replace(cfg, cascade_rows=0, cost_model=None).scheduler_config()
    assert plain.cascade is None and plain.step_cost is None


def test_a_missing_config_is_the_default_one():
    assert config_or_default(None) == EngineConfig()
    mine = EngineConfig(token_budget=64)
    assert config_or_default(mine) is mine


def test_the_engine_imports_no_simulator():
    code = ("import sys, hetero_jax.serving.engine, hetero_jax.config; "
            "sim = [m for m in sys.modules if m.startswith('hetero_jax.sim')]; "
            "assert not sim, sim")
    subprocess.run([sys.executable, "-c", code], check=True)



def test_bench_plan_times_planning_on_steps_it_plans():
    from tests.script_loader import load_script
    (row,) = load_script("bench_plan").main(["--seqs", "16", "--steps", "20"])
    assert row["planned"] == 20 and row["plan_us"] > 0 and row["schedule_update_us"] > 0
