"""The engine with a step-cost model (the cost-aware IBS) serves what it serves without one."""
import dataclasses

import numpy as np
import pytest

from hetero_jax import (EmbeddingOutput, EmbedRequest, Engine, EngineConfig, GenerateRequest,
                        PoolingParams, SamplingParams)

CFG = EngineConfig(token_budget=32, chunk_size=16, max_num_seqs=8, page_size=8,
                   max_model_len=128, scheduler="ibs", token_buckets=(32,), page_buckets=(16,),
                   seq_buckets=(8,), cascade_rows=0)


class AlwaysSplit:
    """A step cost that grows as the square of the sequences: two parts always cost less."""

    def step_time(self, shape) -> float:
        return 1.0 + shape.seqs ** 2


def requests():
    rng = np.random.default_rng(0)
    gens = [GenerateRequest(rng.integers(3, 200, n).tolist(),
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                           logprobs=2)) for n in (5, 23)]
    embeds = [EmbedRequest(rng.integers(3, 200, n).tolist(), PoolingParams("mean"))
              for n in (40, 7, 19)]
    return [gens[0], embeds[0], gens[1], embeds[1], embeds[2]]


def test_the_cost_aware_ibs_changes_steps_not_outputs():
    plain = Engine.from_preset("tiny", config=CFG)
    want = plain.run(requests(), use_tqdm=False)
    engine = Engine.from_preset("tiny", config=dataclasses.replace(CFG, cost_model=AlwaysSplit()))
    got = engine.run(requests(), use_tqdm=False)
    assert engine.scheduler.policy.splits > 0 and engine.stats.steps > plain.stats.steps
    for g, w in zip(got, want):
        if isinstance(w, EmbeddingOutput):
            np.testing.assert_allclose(g.embedding, w.embedding, rtol=1e-5, atol=1e-6)
        else:
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose([lp["logprob"] for lp in g.logprobs],
                                       [lp["logprob"] for lp in w.logprobs], atol=1e-5)


def test_cost_model_settings_are_checked():
    """A cost model sizes the default budget under any scheduler; only the IBS selects by it."""
    fcfs = EngineConfig(scheduler="fcfs", cost_model=AlwaysSplit()).resolve(128, 64)
    assert (fcfs.token_budget, fcfs.chunk_size) == (512, 128)  # its budget: the cap, 512
    assert fcfs.scheduler_config().step_cost is None
    assert EngineConfig(chunk_size=300, cost_model=None).resolve(2048, 64).token_budget == 300
    with pytest.raises(ValueError, match="max_chunk_seqs=3 exceeds max_num_seqs=2"):
        EngineConfig(max_num_seqs=2, max_chunk_seqs=3)  # checked before the budget is known
    with pytest.raises(ValueError, match="must be 'auto', None, a cost model JSON path"):
        EngineConfig(scheduler="ibs", cost_model=3)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        Engine.from_preset("tiny", config=EngineConfig(scheduler="ibs", cost_model="roofline:tpu",
                                                       max_model_len=64))


def test_the_budget_comes_from_the_cost_model_the_engine_knows():
    """The shipped CPU fit for the small preset's shapes in float32 and the roofline of any
    model on an A100-40GB or H200 are known; the budget is their ridge budget (at most 512,
    which keeps a GPU's default variants within 24), 256 where none is known."""
    from hetero_jax.models.presets import preset_config
    from hetero_jax.runner import gpu_lowering
    from hetero_jax.sched.costmodel import (LinearCostModel, RooflineCostModel, engine_budget,
                                            known_cost_model)

    small, tiny = preset_config("small"), preset_config("tiny")
    fit = known_cost_model(small, "cpu", "cpu", 4)
    assert isinstance(fit, LinearCostModel) and engine_budget(fit) == 256
    assert known_cost_model(small, "cpu", "cpu", 2) is None is known_cost_model(tiny, "cpu",
                                                                                 "cpu", 4)
    h200 = known_cost_model(small, "gpu", "NVIDIA H200", 2)
    assert isinstance(h200, RooflineCostModel) and engine_budget(h200) == 512
    assert known_cost_model(small, "gpu", "NVIDIA A100-SXM4-40GB", 2).hardware.name == "a100-40gb"
    assert known_cost_model(small, "gpu", "NVIDIA L4", 2) is None and engine_budget(None) == 256
    wide = gpu_lowering.gpu_config(small, EngineConfig(cost_model=h200))
    assert (wide.token_budget, wide.chunk_size, len(wide.variants())) == (512, 128, 20)
    engine = Engine.from_preset("tiny", config=dataclasses.replace(
        CFG, token_budget=None, chunk_size=None, token_buckets=None, cost_model=AlwaysSplit()))
    assert engine.config.token_budget == 512 and engine.scheduler.cfg.step_cost is not None
