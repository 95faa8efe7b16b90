"""The simulator behind the router: prefix affinity keeps a group's requests on the replica
that holds their prefix (hand-computed hit rates), the load bound gives it up, and the
`--router` flags are argparse errors when they cannot apply. No jax."""
import pytest

from hetero_jax.sched import SchedulerConfig
from hetero_jax.sched.router import RouterConfig
from hetero_jax.sim.cli import sim_main
from hetero_jax.sched.costmodel import load_cost_model
from hetero_jax.sim.simulate import SimConfig, simulate
from hetero_jax.sim.workload import LengthDist, WorkloadConfig

SCHED = SchedulerConfig(policy="ibs", token_budget=128, chunk_size=32, max_num_seqs=32,
                        max_chunk_seqs=4, num_pages=4096, max_model_len=1024,
                        prefix_caching=True)
# 2 groups x 4 generations in group order, all at time 0: 64 shared + 16 own tokens each
WORKLOAD = WorkloadConfig(name="shared-prefix", groups=2, prompts_per_group=4, prefix_len=64,
                          suffix_len=16, embed_frac=0.0, gen_output=LengthDist((4,)),
                          arrival="closed", clients=8, order="gen-first")


def run(router: RouterConfig | None):
    return simulate(SimConfig(SCHED, WORKLOAD, replicas=2, router=router),
                    load_cost_model("roofline:h200"))


def test_prefix_affinity_computes_each_prefix_once_and_least_tokens_once_per_replica():
    """A lookup covers (80 - 1) // 16 = 4 pages, the whole prefix. Least tokens alternates
    the replicas, so each computes each group's prefix and hits it once: 2 x 2 x 4 of 32
    pages. Affinity keeps a group on one replica: 2 x 3 x 4 of 32."""
    least = run(None)
    affinity = run(RouterConfig("prefix-affinity"))
    assert least.cache_hit_tokens == 16 * 16 and least.cache_hit_rate == 0.5
    assert affinity.cache_hit_tokens == 24 * 16 and affinity.cache_hit_rate == 0.75
    assert affinity.routing == dict(least_tokens=2, affinity=6, overloaded=0,
                                    affinity_pages=6 * 4)
    assert least.routing["least_tokens"] == 8 and least.routing["affinity"] == 0
    assert affinity.scheduled_tokens < least.scheduled_tokens
    assert run(RouterConfig("least-tokens")).to_dict() == least.to_dict()


def test_the_load_bound_gives_affinity_up():
    """ratio 1, slack 0: a replica with more load than the least loses its affinity, so the
    groups spread as under least tokens (and their pages with them)."""
    bounded = run(RouterConfig("prefix-affinity", load_ratio=1.0, load_slack=0))
    assert bounded.cache_hit_rate == 0.5 and bounded.routing["overloaded"] >= 2


def test_the_cli_runs_both_routers_side_by_side(capsys):
    results = sim_main(["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group",
                        "8", "--prefix-len", "256", "--replicas", "4", "--rate", "400",
                        "--gen-output", "16", "--router", "least-tokens,prefix-affinity"])
    assert list(results) == ["ibs @least-tokens", "ibs @prefix-affinity"]
    least, affinity = results.values()
    assert affinity.cache_hit_rate > least.cache_hit_rate
    assert "ibs @prefix-affinity" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--router", "random"], "argument --router: bad value 'random'"),
    (["--router", "least-tokens,least-tokens"], "comes twice"),
    (["--router", "prefix-affinity"], "argument --router: routes between replicas; it needs "
     "--replicas >= 2 (got 1)"),
    (["--replicas", "2", "--load-ratio", "3"], "argument --load-ratio: bounds the "
     "prefix-affinity router; it needs --router prefix-affinity"),
    (["--replicas", "2", "--router", "least-tokens", "--load-slack", "5"],
     "argument --load-slack: bounds the prefix-affinity router"),
    (["--replicas", "2", "--router", "prefix-affinity", "--load-ratio", "0.5"],
     "argument --load-ratio: 0.5 is outside [1, inf)")])
def test_bad_router_flags_are_argparse_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
