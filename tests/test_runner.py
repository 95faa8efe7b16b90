"""The runner's host side: a scheduled step packed onto the token axis, and the step's one
device->host array read back through `PackedLayout`."""

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax import EngineConfig
from hetero_jax.runner.batch import pack_batch
from hetero_jax.runner.packed import PackedLayout
from hetero_jax.sched import (DECODE, EMBED, PREFILL, EmbedKnobs, GenKnobs, Request,
                              RunnerOutput, SampledToken, Scheduler, SchedulerConfig)
from hetero_jax.sched.shapes import step_key


def test_packed_layout_hand_computed():
    layout = PackedLayout(num_seqs=2, num_logprobs=1, num_chunk_seqs=1, dim=3)
    rows = layout.sample_rows(jnp.array([5, 7]), jnp.array([-0.5, -1.5]),
                              jnp.array([[5], [2]]), jnp.array([[-0.5], [-0.25]]))
    packed = np.asarray(layout.pack(rows, jnp.array([[1.0, 2.0, 3.0]])))
    assert packed.tolist() == [5, -0.5, 5, -0.5, 7, -1.5, 2, -0.25, 1, 2, 3]
    assert layout.size == len(packed)
    got_rows, vectors = layout.unpack(packed)
    assert layout.sampled_token(got_rows[1]) == SampledToken(7, -1.5, (2,), (-0.25,))
    assert layout.sampled_token(got_rows[1], 0) == SampledToken(7, -1.5), "none asked, none read"
    assert vectors.tolist() == [[1.0, 2.0, 3.0]]
    wide = PackedLayout(num_seqs=1, num_logprobs=3, num_chunk_seqs=0, dim=3)
    row = [4.0, -0.1, 4.0, 9.0, 1.0, -0.1, -2.0, -3.0]  # K = 3: ids 4, 9, 1 and their log-probs
    assert wide.sampled_token(row, 2) == SampledToken(4, -0.1, (4, 9), (-0.1, -2.0))


def test_step_lies_embeddings_then_prefills_then_decodes_on_the_token_axis():
    """The pooler reads the first rows of a step and the sampler one row per sequence: the
    scheduler's order must put embedding chunks first, then prefill chunks, then decodes."""
    cfg = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, page_size=4,
                       max_model_len=64).resolve(64, 4)
    sched = Scheduler(SchedulerConfig(token_budget=64, chunk_size=16, max_num_seqs=8,
                                      page_size=4, num_pages=cfg.num_pages, max_model_len=64))
    knobs = GenKnobs(temperature=0.5, top_k=3, top_p=0.9, seed=11, logprobs=None)
    decoding = Request(0, [1, 2, 3, 4], 3, knobs=knobs)
    sched.add(decoding)
    out = sched.schedule()
    sched.update(out, RunnerOutput({0: SampledToken(9, 0.0)}))
    embed = Request(1, list(range(100, 120)), kind=EMBED, knobs=EmbedKnobs(2, True, 0))
    prefill = Request(2, list(range(30, 40)), 2, knobs=knobs)
    sched.add(embed)
    sched.add(prefill)
    out = sched.schedule()
    assert [(it.request_id, it.kind) for it in out.items] == [(1, EMBED), (2, PREFILL),
                                                             (0, DECODE)]
    key, batch = pack_batch(out.items, cfg)
    assert key == (32, 8, 4, 8, 8), "(T, S, Sc, pages, the chunk group's pages)"
    assert batch.tokens[:27].tolist() == list(range(100, 116)) + list(range(30, 40)) + [9]
    assert batch.positions[:27].tolist() == list(range(16)) + list(range(10)) + [4]
    slot, dummy = embed.pool_slot, cfg.max_num_seqs
    assert batch.pool.token_slot.tolist() == [slot] * 16 + [dummy] * (key[0] - 16)
    assert batch.pool.item_slot.tolist() == [slot] + [dummy] * 3
    assert (batch.pool.kind[0], batch.pool.normalize[0], batch.pool.item_last_row[0]) == (
        2, True, 15)
    assert batch.sample_rows[:3].tolist() == [15, 25, 26]
    assert batch.knobs.temperature[:3].tolist() == [0.0, 0.5, 0.5]
    assert batch.knobs.step[:3].tolist() == [0, 0, 1], "the decode samples its second token"
    assert batch.meta.cu_q_lens.tolist() == [0, 16, 26, 27] + [27] * 5
    assert batch.meta.kv_lens[:3].tolist() == [16, 10, 5]
    ps = cfg.page_size
    for i, req in enumerate([embed, prefill, decoding]):  # the pages the step reads
        used = -(-int(batch.meta.kv_lens[i]) // ps)
        assert batch.meta.page_indices[i, :used].tolist() == req.pages[:used]
    assert batch.slots[26] == decoding.pages[4 // ps] * ps + 4 % ps, "the decode's K/V slot"


def test_cpu_runner_keeps_the_mlp_feature_major_and_other_backends_row_major():
    """On a CPU the runner stores the MLP transposed (faster few-row matmuls there); on a GPU
    it keeps the loaders' layout; either way the same greedy tokens come out (the model test
    checks the numbers against transformers)."""
    from hetero_jax import Engine, SamplingParams
    from hetero_jax.models import llama
    from hetero_jax.models.layers import is_feature_major, is_unrolled

    cfg = EngineConfig(max_model_len=64)
    engine, row = (Engine.from_preset("tiny", seed=1, config=cfg) for _ in range(2))
    assert is_feature_major(engine.runner.params) and is_unrolled(engine.runner.params)
    assert not row.runner.executable.held(), "nothing compiled yet: the layout may change"
    row.runner.params = row.runner.layout_params(llama.init_params(row.model_cfg, 1), "gpu")
    assert not is_feature_major(row.runner.params) and is_unrolled(row.runner.params)
    sp = SamplingParams(max_tokens=8, temperature=0)
    feature, rows = (e.generate(["feature major"], sp, use_tqdm=False)[0].token_ids
                     for e in (engine, row))
    assert feature == rows


def test_blocked_decode_keys_give_the_same_tokens_as_one_gather():
    """Prompts long enough that decode steps read their keys in blocks (rows x bucket >= the
    runner's threshold) generate the same greedy tokens as an engine whose decode groups
    gather their whole bucket at once."""
    from hetero_jax import Engine, SamplingParams
    from hetero_jax.runner.decoder import decode_block_pages

    sp = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["x" * (140 + 9 * i) for i in range(4)]
    cfg = EngineConfig(max_model_len=1024)
    blocked, gathered = (Engine.from_preset("tiny", seed=2, config=cfg) for _ in range(2))
    gathered.runner.backend = "other"  # decode_block_pages: one gather off the CPU
    tokens = [[o.token_ids for o in e.generate(prompts, sp, use_tqdm=False)]
              for e in (blocked, gathered)]
    assert tokens[0] == tokens[1]
    runner = blocked.runner
    assert any(decode_block_pages(runner.impl, runner.backend, 16, key)
               for key, _ in runner.executable.held()), "no variant read blocks"


def _reference_pack(items: list, cfg, key: tuple) -> dict:
    """The step's arrays item by item, in plain Python (what `pack_batch` computes with
    whole-array numpy)."""
    t, s, _, p, _ = key
    ps, out = cfg.page_size, dict(tokens=[0] * t, positions=[0] * t, slots=[0] * t,
                                  adapter_ids=[0] * t, kv_lens=[0] * s, sample_rows=[0] * s,
                                  page_indices=[[0] * p for _ in range(s)])
    row, cu = 0, [0]
    for i, it in enumerate(items):
        for j in range(it.num_tokens):
            pos = it.start + j
            out["tokens"][row], out["positions"][row] = it.token_ids[j], pos
            out["slots"][row] = it.pages[pos // ps] * ps + pos % ps
            out["adapter_ids"][row] = it.knobs.adapter_id if it.kind == EMBED else 0
            row += 1
        cu.append(row)
        out["kv_lens"][i], out["sample_rows"][i] = it.start + it.num_tokens, row - 1
        out["page_indices"][i][:min(len(it.pages), p)] = it.pages[:p]
    out["cu_q_lens"] = cu + [row] * (s - len(items))
    return out


def test_pack_batch_equals_packing_item_by_item_on_random_steps():
    """Random steps (embedding and prefill chunks at page-aligned and unaligned starts,
    decodes at random lengths, spare pages, several bucket sizes) pack as the plain per-item
    loop does; knobs go to their rows, embedding rows and padding keep the neutral ones."""
    from hetero_jax.sched.output import ScheduledItem

    rng = np.random.default_rng(0)
    for trial in range(60):
        cfg = EngineConfig(token_budget=256, chunk_size=64, max_num_seqs=32,
                           page_size=int(rng.choice([4, 16])), max_model_len=512
                           ).resolve(512, 4)
        items, pool = [], rng.permutation(np.arange(1, cfg.num_pages)).tolist()
        kinds = ([EMBED] * rng.integers(0, 3) + [PREFILL] * rng.integers(0, 3)
                 + [DECODE] * rng.integers(1 if trial % 2 else 0, 24))
        for rid, kind in enumerate(kinds or [DECODE]):
            start = int(rng.integers(1, 300)) if kind == DECODE else int(rng.integers(0, 200))
            n = 1 if kind == DECODE else int(rng.integers(1, 64 // len(kinds) + 2))
            pages = [pool.pop() for _ in range(-(-(start + n) // cfg.page_size)
                                                + int(rng.integers(0, 2)))]
            knobs = (EmbedKnobs(int(rng.integers(0, 3)), bool(rng.integers(0, 2)),
                                int(rng.integers(0, 3))) if kind == EMBED else
                     GenKnobs(float(rng.random()), int(rng.integers(0, 50)), float(rng.random()),
                              int(rng.integers(0, 2**32)), None, presence=float(rng.random())))
            items.append(ScheduledItem(
                rid, kind, start, n, True, tuple(rng.integers(0, 1000, n).tolist()),
                tuple(pages), knobs, num_output_tokens=0 if kind == EMBED else rid,
                pool_slot=rid if kind == EMBED else None))
        key, batch = pack_batch(items, cfg)
        assert key == step_key(items, cfg.buckets(), cfg.page_size), "the arrays' key is the rule's"
        want = _reference_pack(items, cfg, key)
        for name in ("tokens", "positions", "slots", "adapter_ids", "sample_rows"):
            assert getattr(batch, name).tolist() == want[name], (trial, name)
        for name in ("kv_lens", "page_indices", "cu_q_lens"):
            assert getattr(batch.meta, name).tolist() == want[name], (trial, name)
        assert batch.prev_rows.tolist() == [-1] * key[0], "nothing linked to a step before"
        for i, it in enumerate(items + [None] * (key[1] - len(items))):
            gen = it is not None and it.kind != EMBED
            assert batch.knobs.temperature[i] == (np.float32(it.knobs.temperature) if gen else 0)
            assert batch.knobs.seed[i] == (it.knobs.seed if gen else 0)
            assert batch.knobs.top_p[i] == (np.float32(it.knobs.top_p) if gen else 1)
            assert batch.knobs.step[i] == (it.num_output_tokens if gen else 0)
            assert batch.knobs.prompt_len[i] == (
                it.start + it.num_tokens - it.num_output_tokens if gen else 0)


def test_link_tokens_points_each_placeholder_at_the_row_that_samples_it():
    """Overlapped steps: a decode whose token the step before is still sampling carries the
    placeholder id; `link_tokens` names that step's row for it (the device reads it there),
    and a placeholder no row samples is a bug, asserted."""
    from hetero_jax.runner.batch import link_tokens
    from hetero_jax.sched.advance import PLACEHOLDER
    from hetero_jax.sched.output import ScheduledItem

    cfg = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, page_size=4,
                       max_model_len=64).resolve(64, 4)
    knobs = GenKnobs(0.0, 0, 1.0, 0, None)
    items = [ScheduledItem(5, PREFILL, 0, 3, True, (1, 2, 3), (1,), knobs),
             ScheduledItem(7, DECODE, 6, 1, True, (PLACEHOLDER,), (2, 3), knobs),
             ScheduledItem(9, DECODE, 2, 1, True, (4,), (4,), knobs),
             ScheduledItem(8, DECODE, 9, 1, True, (PLACEHOLDER,), (5, 6, 7), knobs)]
    _, batch = pack_batch(items, cfg)
    linked = link_tokens(batch, items, {8: 0, 7: 3, 11: 1}, PLACEHOLDER)
    assert linked.prev_rows[:6].tolist() == [-1, -1, -1, 3, -1, 0]
    assert linked.tokens.tolist() == batch.tokens.tolist(), "the ids stay: the device swaps"
    with pytest.raises(KeyError):
        link_tokens(batch, items, {8: 0}, PLACEHOLDER)
    odd = [items[0]._replace(token_ids=(1, PLACEHOLDER, 3))]
    with pytest.raises(AssertionError, match="placeholder token is left"):
        link_tokens(pack_batch(odd, cfg)[1], odd, {}, PLACEHOLDER)


def test_an_item_that_cannot_be_packed_is_named():
    """Packing checks what the whole-array writes would silently misread: an item with fewer
    token ids than tokens, or a position past its pages (it would read the next item's)."""
    from hetero_jax.sched.output import ScheduledItem

    cfg = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, page_size=4,
                       max_model_len=64).resolve(64, 4)
    knobs = GenKnobs(0.0, 0, 1.0, 0, None)
    good = ScheduledItem(3, DECODE, 5, 1, True, (7,), (1, 2), knobs)
    short = ScheduledItem(4, PREFILL, 0, 3, True, (1, 2), (3,), knobs)
    with pytest.raises(ValueError, match="hold 3 token ids for 4 tokens"):
        pack_batch([short, good], cfg)
    past = ScheduledItem(5, DECODE, 9, 1, True, (7,), (4, 5), knobs)
    with pytest.raises(ValueError, match="request 5: position 9 lies past its 2 pages of 4"):
        pack_batch([good, past], cfg)


def test_a_pallas_step_carries_its_tiles_as_data_under_its_plain_key():
    """On the Pallas kernel a mixed step's decodes that share pages are planned (the config's
    `cascade_settings`), packed as a `TileList` over the step's sequences, and the key is
    the step's plain one; without a plan the list is empty."""
    from hetero_jax.runner.batch import is_cascade, uses_cascade
    from hetero_jax.sched.output import ScheduledItem

    cfg = EngineConfig(token_budget=64, chunk_size=16, max_num_seqs=8, page_size=4,
                       max_model_len=64, attention_impl="pallas",
                       cascade_min_pages=1).resolve(64, 4)
    knobs = GenKnobs(0.0, 0, 1.0, 0, None)
    items = [ScheduledItem(5, PREFILL, 0, 3, True, (1, 2, 3), (1,), knobs)] + [
        ScheduledItem(7 + i, DECODE, 9 + i, 1, True, (4,), (2, 3, 10 + i), knobs)
        for i in range(3)]
    plan = cfg.cascade_settings().plan(items, cfg.page_size)
    assert plan == ([([1, 2, 3], 2)], [0, 2, 2, 2])
    key, batch = pack_batch(items, cfg, plan)
    assert key == step_key(items, cfg.buckets(), cfg.page_size) and not is_cascade(key)
    tiles = batch.meta.cascade
    assert tiles.tile_rows.tolist() == [1, 2, 3, -1, -1, -1, -1, -1]
    assert tiles.tile_starts.tolist() == [0, 3, 3, 3, 3] and tiles.tile_lead[0] == 1
    assert tiles.tile_lens.tolist() == [8, 0, 0, 0]
    assert tiles.skip_pages[:4].tolist() == [0, 2, 2, 2]
    assert batch.meta.page_indices[1, :3].tolist() == [2, 3, 10], "the whole table stays"
    assert uses_cascade(batch) and not uses_cascade(pack_batch(items, cfg)[1])
