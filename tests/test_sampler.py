"""The on-device sampler: hand-computed cases and invariants."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax import Engine, EngineConfig, SamplingParams
from hetero_jax.runner.sampler import SamplingKnobs, needs, sample, top_k
from hetero_jax.sched.request import GenKnobs


def knobs(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0, presence=0.0, frequency=0.0,
          repetition=1.0, kv_len=0, prompt_len=0):
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return SamplingKnobs(full(temperature, jnp.float32), full(top_k, jnp.int32),
                         full(top_p, jnp.float32), full(seed, jnp.uint32), jnp.arange(n) + step,
                         full(presence, jnp.float32), full(frequency, jnp.float32),
                         full(repetition, jnp.float32), full(kv_len, jnp.int32),
                         full(prompt_len, jnp.int32))


LOGITS = jnp.log(jnp.array([[0.1, 0.6, 0.05, 0.25]], jnp.float32))


def draws(n, **kw):
    packed = sample(jnp.repeat(LOGITS, n, 0), knobs(n, **kw), num_logprobs=2,
                    table=jnp.zeros(1, jnp.int32), page_indices=jnp.zeros((n, 1), jnp.int32),
                    page_size=1)
    return np.asarray(packed[:, 0]).astype(int), np.asarray(packed)


def test_greedy_and_logprobs_hand_computed():
    ids, packed = draws(3, temperature=0.0)
    assert ids.tolist() == [1, 1, 1]
    np.testing.assert_allclose(packed[0, 1], np.log(0.6), rtol=1e-6)
    assert packed[0, 2:4].tolist() == [1, 3]  # top-2 ids
    np.testing.assert_allclose(packed[0, 4:6], np.log([0.6, 0.25]), rtol=1e-6)


def test_top_k_one_and_tiny_top_p_are_greedy():
    # as many draws as test_temperature_one_follows_the_distribution: one shape to compile
    assert set(draws(8000, top_k=1)[0]) == {1}
    assert set(draws(8000, top_p=0.01)[0]) == {1}


def test_top_p_keeps_the_nucleus():
    """top_p=0.8 keeps {1, 3} (0.6 + 0.25 >= 0.8), renormalised to 0.706 / 0.294."""
    ids = draws(4000, top_p=0.8)[0]
    assert set(ids) == {1, 3}
    assert abs((ids == 1).mean() - 0.6 / 0.85) < 0.03


def test_temperature_one_follows_the_distribution():
    ids = draws(8000)[0]
    np.testing.assert_allclose(np.bincount(ids, minlength=4) / 8000, [0.1, 0.6, 0.05, 0.25], atol=0.02)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    engine = Engine.from_preset("tiny", config=EngineConfig(  # test_vllm_habits.SMALL's steps
        token_budget=64, max_model_len=256, token_buckets=(16, 64), page_buckets=(16,)))
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=123)
    alone = engine.generate(["hello"], sp, use_tqdm=False)[0].token_ids
    batch = engine.generate(["other prompt", "hello", "x"], [SamplingParams(max_tokens=5), sp, sp],
                            use_tqdm=False)
    assert batch[1].token_ids == alone
    assert engine.generate(["hello"], SamplingParams(max_tokens=12, seed=124),
                           use_tqdm=False)[0].token_ids != alone


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens=0"), (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"), (dict(top_k=-1), "top_k=-1")])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("s,v,k", [(1, 128_256, 5), (3, 20_000, 20), (2, 8_193, 1),
                                   (100, 20_000, 5)])  # the last: 1,000 rows, at the bound
def test_top_k_in_two_rounds_is_lax_top_k(s, v, k):
    """Ties (values drawn from a few levels) and -inf included: the same values and ids,
    the lower id first among equals."""
    rng = np.random.default_rng(v)
    x = rng.integers(0, 7, (s, v)).astype(np.float32)
    x[:, rng.integers(0, v, 50)] = -np.inf
    got, want = top_k(jnp.asarray(x), k), jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_needs_reads_the_sampled_rows_knobs():
    greedy = GenKnobs(0.0, 0, 1.0, 0, None)
    assert needs([greedy, greedy]) == (False, False, False) and not any(needs([]))
    assert needs([greedy, GenKnobs(0.5, 0, 1.0, 0, None)]) == (False, True, False)
    assert needs([GenKnobs(0.0, 0, 1.0, 0, None, repetition=1.1)]) == (True, False, False)
    assert needs([GenKnobs(0.0, 0, 1.0, 0, None, presence=0.1)]) == (True, False, False)
    assert needs([greedy, GenKnobs(0.0, 0, 1.0, 0, 3)]) == (False, False, True)
    assert needs([GenKnobs(0.0, 0, 1.0, 0, 0)]) == (False, False, False)  # logprobs=0: none


def test_a_row_without_penalty_or_temperature_is_the_same_either_way():
    """The step's greedy sampler and the re-sampler (penalties, temperatures, top log-probs on)
    give a greedy, unpenalized row the same token and log-prob, beside rows that use them; the
    top log-probs are the model's, there only when asked."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 300)).astype(np.float32))
    k = knobs(4, temperature=0.0, kv_len=5, prompt_len=3)
    k = k.replace(temperature=jnp.array([0, 1.0, 0, 0.7], jnp.float32),
                  repetition=jnp.array([1, 1, 1.3, 1], jnp.float32))
    table, pages = jnp.asarray(rng.integers(0, 300, 64), jnp.int32), jnp.zeros((4, 4), jnp.int32)
    both = np.asarray(sample(logits, k, 3, table, pages, 16))
    greedy = np.asarray(sample(logits, k, 3, table, pages, 16, penalized=False,
                               filtered=False, ranked=False))
    np.testing.assert_array_equal(both[0, :2], greedy[0, :2])  # token and its log-prob
    assert not greedy[:, 2:].any()  # no top log-probs unless ranked
    top = np.asarray(sample(logits, k, 3, table, pages, 16, penalized=False, filtered=False))
    np.testing.assert_array_equal(top[:, :2], greedy[:, :2])
    np.testing.assert_array_equal(top[:, 2:], both[:, 2:])  # the model's, whatever is drawn
    order = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(top[:, 2:5], order)
