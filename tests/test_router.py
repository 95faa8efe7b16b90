"""The replica router's rule on the host (no jax): least tokens, prefix affinity, the load
bound, the LRU of digests, dead replicas."""
import pytest

from hetero_jax.sched.hashing import chain_seed, page_hashes
from hetero_jax.sched.router import Router, RouterConfig

SEED = chain_seed("router test")
PS = 4


def digests(tokens):
    return page_hashes(tokens, PS, SEED)


def affinity(n=3, **kw):
    return Router(n, RouterConfig(policy="prefix-affinity", **kw))


def test_least_tokens_picks_the_least_load_and_the_lowest_index_on_ties():
    router = Router(3)
    assert router.route(digests(range(8)), [5, 2, 9]) == 1
    assert router.route([], [4, 4, 4]) == 0
    assert router.route([], [4, 3, 3]) == 1
    assert router.route([], [0, 9, 9], eligible=[1, 2]) == 1
    assert router.stats.least_tokens == 4 and router.stats.affinity == 0
    assert router.cached_pages(1, digests(range(8))) == 0, "least-tokens keeps no ledger"


def test_prefix_affinity_follows_the_longest_cached_prefix():
    router = affinity()
    shared = list(range(12))  # 3 pages
    assert router.route(digests(shared + [50, 51, 52, 53]), [0, 0, 0]) == 0  # nothing cached
    assert router.route(digests([90] * 8), [10, 0, 0]) == 1  # another prefix: by load
    # replica 0 holds 4 pages of the first chain; a request sharing 3 of them goes there,
    # though replica 2 has less load
    assert router.cached_pages(0, digests(shared + [7, 7, 7, 7])) == 3
    assert router.route(digests(shared + [7, 7, 7, 7]), [100, 50, 0]) == 0
    # the longest prefix wins over a shorter one held by a less loaded replica
    router.route(digests(shared[:4] + [8] * 4), [0, 0, 0], eligible=[2])
    assert router.cached_pages(2, digests(shared)) == 1
    assert router.route(digests(shared), [30, 20, 0]) == 0
    assert router.stats.affinity == 2 and router.stats.affinity_pages == 3 + 3
    assert router.stats.least_tokens == 3


def test_an_overloaded_replica_loses_its_affinity():
    router = affinity(load_ratio=2.0, load_slack=10)
    tokens = list(range(8))
    assert router.route(digests(tokens), [0, 0, 0]) == 0
    # bound: load > 2 * least + 10; least = 5 -> 20 is the most replica 0 may hold
    assert router.route(digests(tokens), [20, 5, 7]) == 0
    assert router.route(digests(tokens), [21, 5, 7]) == 1
    assert router.stats.overloaded == 1
    # the request's pages are now on replica 1 too: the longest prefix ties, load breaks it
    assert router.cached_pages(1, digests(tokens)) == 2
    assert router.route(digests(tokens), [21, 9, 7]) == 1


def test_ties_in_prefix_length_go_to_the_less_loaded_replica():
    router = affinity()
    tokens = list(range(4))
    router.route(digests(tokens), [0, 0, 0], eligible=[0])
    router.route(digests(tokens), [0, 0, 0], eligible=[2])
    assert router.route(digests(tokens + [1] * 4), [8, 0, 3]) == 2


def test_the_lru_keeps_a_chains_first_pages_longest():
    router = affinity(n=1, cache_pages=4)
    a, b = digests(range(12)), digests(range(100, 108))
    router.route(a, [0])  # oldest first: a2 a1 a0
    router.route(b, [0])  # a2 a1 a0 b1 b0 -> a2 goes
    assert router.cached_pages(0, a) == 2 and router.cached_pages(0, b) == 2
    router.route(a[:1], [0])  # a1 b1 b0 a0
    router.route(digests(range(200, 204)), [0])  # a1 goes: a0 stays, with a1 gone
    assert router.cached_pages(0, a) == 1 and router.cached_pages(0, b) == 2
    router.route(digests(range(300, 304)), [0])  # b1 goes before b0
    assert router.cached_pages(0, a) == 1 and router.cached_pages(0, b) == 1


def test_a_forgotten_replica_holds_nothing_and_dead_ones_take_nothing():
    router = affinity(n=2)
    tokens = digests(range(8))
    router.route(tokens, [0, 0])
    router.forget(0)
    assert router.cached_pages(0, tokens) == 0
    assert router.route(tokens, [0, 5], eligible=[1]) == 1
    with pytest.raises(ValueError, match="every replica is down"):
        router.route(tokens, [0, 0], eligible=[])


@pytest.mark.parametrize("kw, match", [
    (dict(policy="random"), "router='random' must be one of least-tokens, prefix-affinity"),
    (dict(cache_pages=0), "cache_pages=0"), (dict(load_ratio=0.5), "load_ratio=0.5"),
    (dict(load_slack=-1), "load_slack=-1"), (dict(load_ratio=float("nan")), "load_ratio=nan")])
def test_bad_router_config_names_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)
