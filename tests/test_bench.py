"""`hetero-jax bench`: a quick run of every scheduler, its JSON and plot, bad flags, HF export;
`hetero-jax generate` and its summary."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hetero_jax import EmbedRequest, Engine, EngineConfig, SamplingParams
from hetero_jax.bench.cli import (Contender, median_run, serve_all, share_compiled_steps,
                                workload_items)
from hetero_jax.bench.config import SCHEDULERS, parse_config
from hetero_jax.bench.workloads import SharedPrefixWorkload
from hetero_jax.cli import main
from hetero_jax.bench.hf_baseline import export_preset
from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import load_hf_model

REQUIRED = {"scheduler", "ratio", "requests_per_s", "embed_requests_per_s", "gen_requests_per_s",
            "p99_latency_s"}
# --quick at 9:1 and 1:9: (embeddings, generations) per run, round(n * e / (e + g)) embeddings of
# 8 requests, raised at 9:1 to 20 so that the run holds --min-gens 2 generations
QUICK_COUNTS = {"9:1": (18, 2), "1:9": (1, 7)}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The CLI in a fresh process (its own jax config and compile cache): tiny preset, --quick."""
    tmp = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "hetero_jax.cli", "bench", "--preset", "tiny", "--quick",
           "--ratios", "9:1,1:9", "--json", str(tmp / "bench.json"), "--plot",
           str(tmp / "bench.png"), "--compile-cache", str(tmp / "xla"), "--no-progress",
           "--baseline", "hf"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc.stdout


def test_quick_run_writes_every_row_and_a_plot(quick_run):
    tmp, stdout = quick_run
    data = json.loads((tmp / "bench.json").read_text())
    results, cfg = data["results"], data["config"]
    assert sorted((r["scheduler"], r["ratio"]) for r in results) == sorted(
        (s, q) for s in list(SCHEDULERS) + ["hf"] for q in QUICK_COUNTS)
    assert "ibs / transformers at 9:1" in stdout
    for r in results:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert_every_request_did_all_its_work(r, cfg)
        assert r["vs_ibs"] > 0
        if r["scheduler"] != "hf":
            assert_scheduled_tokens_are_the_work(r, cfg)
    ibs = {r["ratio"]: r["requests_per_s"] for r in results if r["scheduler"] == "ibs"}
    assert all(r["vs_ibs"] == pytest.approx(r["requests_per_s"] / ibs[r["ratio"]])
               for r in results)
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for s in SCHEDULERS:
        assert s in stdout
    assert "req/s" in stdout and "x ibs" in stdout


def assert_every_request_did_all_its_work(r: dict, cfg: dict) -> None:
    """Counts and rates agree with the workload: every generation produced all its
    --output-len tokens and every embedding read all its --embed-len tokens."""
    n_embed, n_gen = QUICK_COUNTS[r["ratio"]]
    where = f"{r['scheduler']} {r['ratio']}"
    assert r["requests"] == n_embed + n_gen, where
    assert (r["embed_tokens"], r["gen_tokens"]) == (n_embed * cfg["embed_len"],
                                                    n_gen * cfg["output_len"]), where
    t = r["serving_s"]
    assert 0 < t <= r["wall_s"], where
    got = [r[k] * t for k in ("requests_per_s", "embed_requests_per_s", "gen_requests_per_s",
                              "embed_tokens_per_s", "gen_tokens_per_s")]
    assert got == pytest.approx([n_embed + n_gen, n_embed, n_gen, r["embed_tokens"],
                                 r["gen_tokens"]]), where
    assert 0 < r["p50_latency_s"] <= r["p99_latency_s"] <= r["wall_s"], where


def assert_scheduled_tokens_are_the_work(r: dict, cfg: dict) -> None:
    """The engine scheduled each input token once and one decode token per generated token
    after the first (sampled at the end of the prompt): nothing dropped, nothing recomputed;
    a generation's first token came before its end."""
    n_embed, n_gen = QUICK_COUNTS[r["ratio"]]
    work = n_embed * cfg["embed_len"] + n_gen * (cfg["prompt_len"] + cfg["output_len"] - 1)
    scheduled = r["budget_fill"] * r["steps"] * cfg["token_budget"]
    where = f"{r['scheduler']} {r['ratio']}"
    assert scheduled == pytest.approx(work), f"{where}: {scheduled=}, {work=}"
    assert r["steps"] >= -(-work // cfg["token_budget"]), where
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["generate_p99_latency_s"], where


@pytest.mark.parametrize("flags, message", [
    (["--clients", "0"], "argument --clients: 0 is outside [1, 1024]"),
    (["--requests", "-3"], "argument --requests: -3 is outside [1, 100000]"),
    (["--repeats", "0"], "argument --repeats: 0 is outside [1, 20]"),
    (["--ratios", "9-1"], "bad ratio '9-1': expected EMBED:GEN"),
    (["--ratios", "0:0"], "bad ratio '0:0'"),
    (["--schedulers", "ibs,vllm"], "unknown scheduler 'vllm'"),
    (["--iterations", "11"], "argument --iterations: 11 is outside [1, 10]"),
    (["--scale", "2"], "argument --scale: 2.0 is outside (0, 1]"),
    (["--baseline", "vllm"], "invalid choice: 'vllm'"),
    (["--preset", "tiny", "--output-len", "4000"], "need 4128 positions; the model has "
     "max_position_embeddings=2048"),
    (["--chunk-size", "512"], "argument --chunk-size: chunk_size=512 exceeds token_budget=256"),
    (["--model", "/no/such/dir"], "'/no/such/dir' is not a directory"),
    (["--prefix-caching", "maybe"], "bad value 'maybe': 'maybe' is not on or off"),
    (["--workload", "shared-prefix", "--prefix-len", "4000"], "need 4288 positions"),
    (["--schedulers", "ibs,ibs-cost"], "--schedulers ibs-cost and --cost-model go together"),
    (["--cost-model", "roofline:h200"], "--schedulers ibs-cost and --cost-model go together"),
    (["--schedulers", "ibs-cost", "--cost-model", "/no/such.json"],
     "argument --cost-model: '/no/such.json' is not a file"),
])
def test_bad_flags_fail_with_the_value_and_the_limit(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_hf_export_round_trips(tmp_path):
    """The exported directory loads back to the same weights and the same greedy tokens, in
    hetero-jax and in transformers."""
    export_preset("tiny", 3, str(tmp_path))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))
    cfg = EngineConfig(token_budget=16, chunk_size=16, max_num_seqs=8, max_chunk_seqs=1,
                       max_model_len=64)  # two step shapes: little to compile
    preset = Engine.from_preset("tiny", seed=3, config=cfg)
    loaded = Engine.from_pretrained(str(tmp_path), config=cfg)
    assert loaded.model_cfg == preset.model_cfg
    _, params = load_hf_model(str(tmp_path))
    want_params = llama.init_params(preset.model_cfg, 3)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_array_equal(got, want)
    prompts = [[256, 72, 105], [256] + list(range(30, 60))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in preset.generate(prompts, greedy, use_tqdm=False)]
    assert [o.token_ids for o in loaded.generate(prompts, greedy, use_tqdm=False)] == want
    pytest.importorskip("torch")
    from hetero_jax.bench.hf_baseline import generate_batch, load_model

    model = load_model(str(tmp_path))
    assert [generate_batch(model, [p], 12)[0] for p in prompts] == want


def test_iter_retgen_workload_runs_the_pipeline(tmp_path, capsys):
    out = tmp_path / "irg.json"
    assert main(["bench", "--preset", "tiny", "--quick", "--workload", "iter-retgen",
                 "--schedulers", "ibs", "--requests", "3", "--scale", "0.02",
                 "--instruction-len", "48", "--compile-cache", "none", "--no-progress",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["ratio"] == "iter-retgen" and row["questions"] == 3
    assert row["cache_hit_rate"] > 0.2, "the shared instruction is computed once"
    assert row["gen_tokens_per_s"] > 0 and row["steps"] > 0 and 0 < row["budget_fill"] <= 1
    assert "questions/s" in capsys.readouterr().out


def test_the_cost_aware_ibs_contender_serves_every_request(tmp_path):
    out = tmp_path / "cost.json"
    assert main(["bench", "--preset", "tiny", "--quick", "--ratios", "5:5", "--schedulers",
                 "ibs-cost", "--cost-model", "calibration/small-cpu.json",
                 "--compile-cache", "none", "--no-progress", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["scheduler"] == "ibs-cost" and row["requests"] == 8


def test_shared_prefix_runs_with_the_cache_on_and_off_side_by_side(tmp_path):
    out = tmp_path / "sp.json"
    assert main(["bench", "--preset", "tiny", "--quick", "--workload", "shared-prefix",
                 "--groups", "2", "--prompts-per-group", "4", "--prefix-len", "48",
                 "--suffix-len", "4", "--output-len", "4", "--ratios", "1:1",
                 "--schedulers", "ibs", "--prefix-caching", "on,off", "--control",
                 "--compile-cache", "none", "--no-progress", "--json", str(out)]) == 0
    rows = {(r["scheduler"], r["ratio"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(s, r) for s in ("ibs", "ibs/no-cache") for r in ("1:1", "1:1 unshared")}
    assert rows["ibs", "1:1"]["cache_hit_rate"] > 0.5, "a group's prefix is computed once"
    assert rows["ibs", "1:1"]["vs_no_cache"] is not None
    assert rows["ibs", "1:1 unshared"]["cache_hit_rate"] == 0
    assert rows["ibs/no-cache", "1:1"]["cache_hit_rate"] is None, "nothing looked up"


def test_shared_prefix_workload_shares_within_groups_only():
    wl = SharedPrefixWorkload(groups=3, per_group=4, prefix_len=10, suffix_len=3, output_len=2)
    reqs = wl.requests((1, 1), vocab=256)
    prefixes = {}
    for r in reqs:
        tokens = r.input if isinstance(r, EmbedRequest) else r.prompt
        assert len(tokens) == 13
        prefixes.setdefault(tuple(tokens[:10]), []).append(type(r).__name__)
    assert sorted(len(v) for v in prefixes.values()) == [4, 4, 4]
    assert all(sorted(v) == ["EmbedRequest"] * 2 + ["GenerateRequest"] * 2
               for v in prefixes.values())
    control = wl.requests((1, 1), vocab=256, shared=False)
    assert len({tuple((r.input if isinstance(r, EmbedRequest) else r.prompt)[:10])
                for r in control}) == 12


def test_repeats_rotate_the_order_and_keep_the_median_run():
    calls = []

    class Fake:
        dedicated = True  # no in-process runner: no compile seconds to leave out of the bar

        def __init__(self, name):
            self.name = name

        def serve(self, items, clients, on_done, index, iterations):
            calls.append(self.name)
            return dict(requests_per_s=float(len(calls)), scheduler=self.name)

    cfg = parse_config(["--preset", "tiny", "--clients", "1", "--iterations", "1",
                        "--no-progress"])
    rows = serve_all([Fake("a"), Fake("b"), Fake("c")], [("5:5", [])], cfg, None, "t", 3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {r["scheduler"]: r["requests_per_s_runs"] for r in rows} == {
        "a": [1.0, 6.0, 8.0], "b": [2.0, 4.0, 9.0], "c": [3.0, 5.0, 7.0]}
    assert {r["scheduler"]: r["requests_per_s"] for r in rows} == {"a": 6.0, "b": 4.0, "c": 5.0}
    assert all(r["ratio"] == "5:5" for r in rows)
    assert median_run([dict(requests_per_s=2.0), dict(requests_per_s=1.0)]) == dict(
        requests_per_s=1.0, requests_per_s_runs=[2.0, 1.0], requests_per_cpu_s_runs=[None, None],
        requests_per_s_ci=(1.0, 2.0))


def test_bench_config_resolves_the_defaults_that_depend_on_other_flags():
    cfg = parse_config(["--preset", "tiny", "--clients", "5", "--output-len", "100"])
    assert (cfg.warmup, cfg.min_gens, cfg.max_model_len) == (5, 5, 256)  # 128 + 100 -> 256
    assert cfg.ratios == ((9, 1), (5, 5), (1, 9)) and cfg.run_size((9, 1)) == 50
    quick = parse_config(["--preset", "tiny", "--quick", "--clients", "3"])
    assert (quick.clients, quick.requests, quick.output_len, quick.warmup) == (3, 8, 16, 0)
    assert parse_config(["--quick"]).preset == "tiny", "README: --quick runs on tiny"
    assert parse_config(["--quick", "--preset", "small"]).preset == "small"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clients = 1


def test_generate_prints_and_writes_its_summary(tmp_path, capsys):
    path = tmp_path / "gen.json"
    assert main(["generate", "--preset", "tiny", "--num-prompts", "3", "--max-tokens", "5",
                 "--token-budget", "64", "--chunk-size", "64", "--max-num-seqs", "4",
                 "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert (r["requests"], r["gen_tokens"], r["embed_tokens"]) == (3, 15, 0)
    assert r["gen_tokens_per_s"] * r["serving_s"] == pytest.approx(15)
    assert 0 < r["ttft_p50_s"] <= r["p50_latency_s"] <= r["p99_latency_s"] <= r["wall_s"]
    assert r["steps"] > 0 and r["preemptions"] == 0
    assert "3 requests, 15 tokens in" in capsys.readouterr().out


def test_every_run_starts_from_an_empty_prefix_cache():
    """A repeat of the same items finds only what its own run cached (a group's prefix), not
    the whole prompts that the warm-up or an earlier repeat left in the cache."""
    cfg = parse_config(["--preset", "tiny", "--workload", "shared-prefix", "--groups", "2",
                        "--prompts-per-group", "3", "--prefix-len", "48", "--suffix-len", "16",
                        "--output-len", "2", "--ratios", "0:1", "--clients", "1",
                        "--compile-cache", "none", "--no-progress"])
    contender = Contender("ibs", cfg, cfg.engine_config())
    ((_, items),), _ = workload_items(cfg)
    rates = [contender.serve(items, clients=1)["cache_hit_rate"] for _ in range(2)]
    # one client, 64-token prompts, 3 pages looked up each (the last page holds the token to
    # compute): a group's first prompt hits nothing, its next two the 3-page prefix; a warm
    # cache would hit all 6
    assert rates == [pytest.approx(4 / 6)] * 2


def test_engines_that_differ_only_in_scheduling_share_their_compiled_steps():
    base = EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
                        token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,))
    configs = [base, dataclasses.replace(base, batching="feather-bandit", scheduler="ibs"),
               dataclasses.replace(base, cascade_rows=0)]
    engines = [Engine.from_preset("tiny", config=c) for c in configs]
    alone = Engine.from_preset("tiny", config=configs[1])
    share_compiled_steps(engines)
    fcfs, bandit, plain = (e.runner.executable for e in engines)
    assert bandit is fcfs and plain is not fcfs, "cascade off changes the steps' inputs"
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[256, 3, 4, 5 + i] for i in range(3)]
    assert [o.token_ids for o in engines[1].generate(prompts, params)] == [
        o.token_ids for o in alone.generate(prompts, params)]
