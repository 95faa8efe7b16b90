"""The Ray paths on a local Ray cluster (`ray.init(num_cpus=2)`): two replicas as actors give
what one engine gives, through `run` and through the batch job's front, and the batch job as
a Ray Data pipeline (`RayDataFront`: map_batches over an actor pool of two engines) writes
the rows and the errors file of the local path, skipping the rows already written. Skipped
without ray (the `ray` extra; CI installs only `test`); slow (the cluster and its actors
start). The Ray Data tests come first: the replicas' fixture holds both CPUs until the
module ends."""
import numpy as np
import pytest

from hetero_jax import Engine, EngineConfig
from hetero_jax.offline import cli as batch_cli
from hetero_jax.offline.job import EngineFront
from hetero_jax.offline.replica_front import ReplicaFront
from tests.test_batch_job import by_id, mixed_rows, read_jsonl, run_rows, write_jsonl
from tests.test_replicas import CONFIG, assert_same, requests

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.data import DataContext

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().wait_for_min_actors_s = 120  # fail, not hang, if the
    yield  # replicas' actors hold the CPUs
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_replicas(cluster):
    from hetero_jax.serving.ray_replicas import RayReplicaSet

    rs = RayReplicaSet.from_preset("tiny", 2, config=EngineConfig(**CONFIG))
    yield rs
    rs.close()


def assert_same_rows(got: dict, want: dict) -> None:
    """Output rows by id: the same ids, tokens, texts and reasons; floats to 1e-5."""
    assert got.keys() == want.keys()
    for key, w in want.items():
        g, w = dict(got[key]), dict(w)
        np.testing.assert_allclose(g.pop("embedding", []), w.pop("embedding", []), rtol=1e-5,
                                   atol=1e-6)
        got_lp, want_lp = g.pop("logprobs", []), w.pop("logprobs", [])
        np.testing.assert_allclose([[t["logprob"]] + [p for _, p in t["top"]] for t in got_lp],
                                   [[t["logprob"]] + [p for _, p in t["top"]] for t in want_lp],
                                   atol=1e-5)
        assert [[i for i, _ in t["top"]] for t in got_lp] == \
            [[i for i, _ in t["top"]] for t in want_lp], key
        assert g == w, key


def test_the_ray_data_job_writes_the_rows_and_errors_of_the_local_path(cluster, tmp_path):
    from hetero_jax.offline.ray_data import RayDataFront
    from hetero_jax.serving.processes import ModelSource

    rows = mixed_rows(16) + ['{"id": "long", "prompt": "' + "x" * 300 + '"}', "not json",
                             '{"id": "lp", "prompt": "hi", "max_tokens": 4, "logprobs": 2}']
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    one = Engine.from_preset("tiny", config=EngineConfig(**CONFIG))
    run_rows(inp, tmp_path / "one.jsonl", EngineFront(one, max_in_flight=6))
    want = by_id(read_jsonl(tmp_path / "one.jsonl"))
    written = read_jsonl(tmp_path / "one.jsonl")[:5]  # a killed run's rows: not run again
    write_jsonl(tmp_path / "ray.jsonl", written)
    front = RayDataFront(ModelSource(preset="tiny"), one.model_cfg, 2, EngineConfig(**CONFIG),
                         max_in_flight=6)
    assert front.batch_size(12) == 3 and front.batch_size(3) == 2  # 2 engines, 3 rows each
    sizes, serve = [], front.serve  # each batch comes back as it finishes, on its own
    front.serve = lambda items: (sizes.append(len(batch)) or batch for batch in serve(items))
    tally = run_rows(inp, tmp_path / "ray.jsonl", front)
    assert sorted(sizes) == [2, 2, 3, 3, 3]  # 13 rows run (one refused) in 5 blocks of <= 3
    assert_same_rows(by_id(read_jsonl(tmp_path / "ray.jsonl")), want)
    assert (tally.skipped, tally.written, tally.bad_rows, tally.refused) == (5, 12, 1, 1)
    errors = {e["line"]: (e["stage"], e["error"]) for e in
              read_jsonl(tmp_path / "ray.jsonl.errors.jsonl")}
    assert errors == {e["line"]: (e["stage"], e["error"]) for e in
                      read_jsonl(tmp_path / "one.jsonl.errors.jsonl")}
    assert sorted(errors) == [17, 18] and (errors[17][0], errors[18][0]) == ("engine", "input")
    assert "the prompt has 301 tokens" in errors[17][1] and "not JSON" in errors[18][1]
    assert front.stats.steps > 0 and front.stats.generated_tokens > 0
    front.close()  # the cluster is the test's: left running
    assert ray.is_initialized()


def test_batch_ray_data_runs_the_job_on_the_cluster(cluster, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(6) + ['{"id": 0, "embed": "again"}'])
    out = str(tmp_path / "out.jsonl")
    assert batch_cli.batch_main([inp, "--output", out, "--ray-data", "--replicas", "2",
                                 "--no-progress", "--max-num-seqs", "4"]) == 0
    assert sorted(by_id(read_jsonl(out)), key=str) == sorted(
        [r["id"] for r in mixed_rows(6)], key=str)
    assert [e["line"] for e in read_jsonl(out + ".errors.jsonl")] == [7]  # a repeated id
    text = capsys.readouterr().out
    assert "on a Ray Data pipeline (map_batches over a pool of 2 engine actors, no GPU each)" \
        in text and "6 rows written, 0 already there" in text and "1 rows (1 bad rows" in text


def test_a_ray_actor_shards_its_engine_over_tensor_parallel_devices(cluster):
    """A TP=2 replica on a CPU cluster: its actor is shown two host devices (an engine at
    tensor_parallel=2 on one device refuses to build) and gives what TP=1 gives."""
    from hetero_jax.serving.ray_replicas import RayReplicaSet

    want = Engine.from_preset("tiny", config=EngineConfig(**CONFIG)).run(requests(), False)
    with RayReplicaSet.from_preset("tiny", 1,
                                   config=EngineConfig(**CONFIG, tensor_parallel=2)) as rs:
        assert_same(rs.run(requests()), want)
    assert ray.is_initialized()  # the cluster is the test's


def test_ray_replicas_give_what_one_engine_gives(ray_replicas):
    one = Engine.from_preset("tiny", config=EngineConfig(**CONFIG))
    want = one.run(requests(), False)
    got = ray_replicas.run(requests())
    assert [o.request_id for o in got] == list(range(len(want)))
    assert_same(got, want)
    assert all(s.steps > 0 for s in ray_replicas.replica_stats)
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens"):
        ray_replicas.run([requests()[1], requests()[0].__class__([1] * 300)])


def test_the_ray_batch_job_writes_the_rows_of_the_local_path(ray_replicas, tmp_path):
    one = Engine.from_preset("tiny", config=EngineConfig(**CONFIG))
    inp = write_jsonl(tmp_path / "in.jsonl", mixed_rows(18))
    run_rows(inp, tmp_path / "one.jsonl", EngineFront(one, max_in_flight=6))
    run_rows(inp, tmp_path / "ray.jsonl", ReplicaFront(ray_replicas, max_in_flight=6))
    assert_same_rows(by_id(read_jsonl(tmp_path / "ray.jsonl")),
                     by_id(read_jsonl(tmp_path / "one.jsonl")))


def test_too_many_replicas_for_the_cluster_name_the_value(ray_replicas):
    from hetero_jax.serving.ray_replicas import RayReplicaSet

    with pytest.raises(ValueError, match="replicas=3 needs 1 CPU each; the Ray cluster has 2"):
        RayReplicaSet.from_preset("tiny", 3, config=EngineConfig(**CONFIG))
