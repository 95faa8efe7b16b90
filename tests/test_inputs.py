"""Bad input fails fast with a clear error, and the engine stays usable."""
import json
import os
import shutil

import pytest

from hetero_jax import Engine, EngineConfig, PoolingParams, SamplingParams
from hetero_jax.models.formats.hf_llama import load_hf_model

CFG = EngineConfig(token_budget=64, max_model_len=128, token_buckets=(16, 64), page_buckets=(8,))


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=CFG)


@pytest.mark.parametrize("prompt,match", [
    ("", "prompt 1 is empty"), ([], "prompt 1 is empty"),
    ("x" * 200, r"prompt 1 has 201 tokens; max_model_len=128"),
    ([1, 99999], r"token id 99999 outside \[0, 512\)")])
def test_bad_prompt_raises_and_engine_stays_usable(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(["fine", prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.scheduler.has_work(), "a rejected batch left work behind"
    out = engine.generate(["fine"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_one_params_per_prompt_or_one_for_all(engine):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        engine.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="got 3 PoolingParams for 1 inputs"):
        engine.embed("a", [PoolingParams()] * 3, use_tqdm=False)


def test_too_many_logprobs(engine):
    with pytest.raises(ValueError, match="logprobs=9 exceeds max_logprobs=5"):
        engine.generate(["a"], SamplingParams(logprobs=9), use_tqdm=False)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'; available: mini, tiny, small"):
        Engine.from_preset("huge")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine.from_pretrained(str(tmp_path))


@pytest.fixture
def model_copy(hf_model, tmp_path):
    src, _ = hf_model("mistral")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architectures.*GPT2LMHeadModel"):
        load_hf_model(str(model_copy))


def test_missing_weight_file(model_copy):
    os.remove(model_copy / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_model(str(model_copy))


def test_truncated_weight_file_names_file_and_tensor(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .* is truncated"):
        load_hf_model(str(model_copy))


def test_shape_mismatch_names_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.\w+_proj.weight has shape"):
        load_hf_model(str(model_copy))


def test_sharded_checkpoint_loads_like_single(hf_model, tmp_path):
    import numpy as np
    _, model = hf_model("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _, sharded = load_hf_model(str(tmp_path))
    _, single = load_hf_model(hf_model("qwen2")[0])
    np.testing.assert_array_equal(sharded["layers"]["w_up"], single["layers"]["w_up"])


def test_checkpoint_roundtrip(tmp_path):
    engine = Engine.from_preset("tiny", seed=3, config=CFG)
    sp = SamplingParams(max_tokens=6, temperature=0)
    want = engine.generate(["roundtrip"], sp, use_tqdm=False)[0].token_ids
    engine.save(str(tmp_path / "ckpt"))
    restored = Engine.load(str(tmp_path / "ckpt"), config=CFG)
    assert restored.generate(["roundtrip"], sp, use_tqdm=False)[0].token_ids == want


def test_16_bit_dtype_on_cpu_warns_that_it_is_slow():
    with pytest.warns(UserWarning, match="use float32 on a CPU"):
        Engine.from_preset("tiny", config=EngineConfig(dtype="bfloat16", max_model_len=64))
