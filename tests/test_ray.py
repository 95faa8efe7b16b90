"""The Ray path: two replicas as actors on a local Ray cluster (`ray.init(num_cpus=2)`) give
what one engine gives, through `run` and through the batch job's front. Skipped without
ray (the `ray` extra; CI installs only `test`); slow (the cluster and its actors start)."""
import numpy as np
import pytest

from hetero_jax import Engine, EngineConfig
from hetero_jax.offline.job import EngineFront
from hetero_jax.offline.replica_front import ReplicaFront
from tests.test_batch_job import by_id, mixed_rows, read_jsonl, run_rows, write_jsonl
from tests.test_replicas import CONFIG, assert_same, requests

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_replicas():
    from hetero_jax.serving.ray_replicas import RayReplicaSet

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rs = RayReplicaSet.from_preset("tiny", 2, config=EngineConfig(**CONFIG))
    yield rs
    rs.close()
    ray.shutdown()


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
    got, want = by_id(read_jsonl(tmp_path / "ray.jsonl")), by_id(read_jsonl(tmp_path / "one.jsonl"))
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        if "embedding" in w:
            np.testing.assert_allclose(g.pop("embedding"), w.pop("embedding"), rtol=1e-5,
                                       atol=1e-6)
        assert g == w, key


def test_too_many_replicas_for_the_cluster_name_the_value(ray_replicas):
    from hetero_jax.serving.ray_replicas import RayReplicaSet

    with pytest.raises(ValueError, match="replicas=3 needs one CPU each; the Ray cluster has 2"):
        RayReplicaSet.from_preset("tiny", 3, config=EngineConfig(**CONFIG))
