"""Nothing silent in the engine (issue 30): absurd sizes are refused before anything is
allocated, naming the knob and the bytes; non-finite weights are refused at load naming the
tensor, and a non-finite output fails its request alone; a corrupt tokenizer, special token
ids and a vocabulary that disagree fail at load naming the file and the field; prompts and
params of the wrong shape say what was passed and what is expected; `EngineConfig` checks
types and relations (the bench's among them, one validation); the router sends nothing to a
replica whose process is gone."""
import dataclasses
import json
import os
import signal

import jax
import numpy as np
import pytest

from hetero_jax import Engine, EngineConfig, SamplingParams
from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import export_hf_model, hf_config_dict
from hetero_jax.models.presets import preset_config
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.serving import engine as engine_mod

TINY = dict(token_budget=32, chunk_size=16, max_num_seqs=4, max_chunk_seqs=1, max_model_len=64,
            token_buckets=(32,), page_buckets=(4,), seq_buckets=(4,), prefix_caching=False,
            cascade_rows=0)


def boom(*args, **kwargs):
    raise AssertionError("allocated before the sizes were checked")


@pytest.fixture
def no_allocation(monkeypatch):
    for name in ("Scheduler", "DecoderRunner", "load_params"):
        monkeypatch.setattr(engine_mod, name, boom)
    monkeypatch.setattr(llama, "init_params", boom)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = dataclasses.replace(preset_config("tiny"), num_layers=1)
    path = tmp_path_factory.mktemp("tiny_hf")
    export_hf_model(str(path), cfg, jax.tree.map(np.asarray, llama.init_params(cfg, 0)))
    return path


def edited_dir(src, dst, config=None, tensors=None):
    """A copy of `src` with config.json keys changed and tensors edited (name -> fn(arr))."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst)
    raw = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(raw, **(config or {}))))
    weights = load_file(str(src / "model.safetensors"))
    for name, fn in (tensors or {}).items():
        weights[name] = fn(weights[name].copy())
    save_file(weights, str(dst / "model.safetensors"))
    return dst


# -- 4. absurd sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("knob,config", [
    ("num_pages", dict(num_pages=10**9)),
    ("num_pages", dict(num_pages=10**8)),
    ("token_buckets", dict(token_budget=2**30, chunk_size=64, token_buckets=(2**30,))),
    ("max_num_seqs", dict(max_num_seqs=2**28)),
])
def test_absurd_engine_sizes_are_refused_before_allocating(knob, config, no_allocation):
    with pytest.raises(ValueError, match=rf"{knob}=.*\d bytes") as e:
        Engine.from_preset("tiny", config=EngineConfig(**config))
    assert "memory" in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 10**6), ("vocab_size", 10**10),
                                       ("hidden_size", 2**24), ("intermediate_size", 10**9),
                                       ("max_position_embeddings", 10**9)])
def test_absurd_model_sizes_are_refused_before_reading_weights(tiny_dir, tmp_path, key, value,
                                                               no_allocation):
    model = edited_dir(tiny_dir, tmp_path / "m", config={key: value})
    cfg = EngineConfig(max_model_len=10**9) if key == "max_position_embeddings" else None
    with pytest.raises(ValueError, match=r"\d bytes") as e:
        Engine.from_pretrained(str(model), config=cfg)
    assert "memory" in str(e.value) and (key in str(e.value) or "max_model_len" in str(e.value))


# -- 5. non-finite weights and outputs -------------------------------------------------------

@pytest.mark.parametrize("name,value", [("model.layers.0.mlp.up_proj.weight", np.nan),
                                        ("model.norm.weight", np.inf),
                                        ("model.layers.0.mlp.down_proj.weight", 1e38)])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(tiny_dir, tmp_path, name,
                                                                  value):
    def poison(arr):
        arr.reshape(-1)[arr.size // 2] = value
        return arr

    model = edited_dir(tiny_dir, tmp_path / "m", tensors={name: poison})
    with pytest.raises(ValueError, match=rf"tensor {name} holds 1 non-finite value"):
        Engine.from_pretrained(str(model), config=EngineConfig(**TINY))


@pytest.fixture(scope="module")
def poisoned():
    """The tiny preset with token 7's embedding row NaN: inputs holding 7 go non-finite."""
    cfg = preset_config("tiny")
    params = llama.init_params(cfg, 0)
    params = dict(params, embed=params["embed"].at[7].set(np.nan))
    return Engine(cfg, params, ByteTokenizer(), EngineConfig(**TINY))


def test_a_non_finite_output_fails_its_request_alone(poisoned):
    clean = Engine.from_preset("tiny", config=EngineConfig(**TINY))
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outs = poisoned.generate([[1, 2, 3], [1, 7, 3], [4, 5]], greedy, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "not finite" in outs[1].error and "NaN" in outs[1].error
    want = clean.generate([[1, 2, 3], [4, 5]], greedy, use_tqdm=False)
    assert [o.token_ids for o in (outs[0], outs[2])] == [w.token_ids for w in want]
    vectors = poisoned.run([_embed([1, 2]), _embed([7, 8]), _embed([3])], use_tqdm=False)
    assert [o.finish_reason for o in vectors] == ["embedded", "error", "embedded"]
    assert all(np.isfinite(o.embedding).all() for o in (vectors[0], vectors[2]))
    again = poisoned.generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert again[0].token_ids == want[0].token_ids
    assert poisoned.scheduler.cache_stats().free_pages == poisoned.config.num_pages - 1


def _embed(ids):
    from hetero_jax import EmbedRequest, PoolingParams

    return EmbedRequest(ids, PoolingParams())


# -- 6 and 8. tokenizer files and special ids ------------------------------------------------

def with_tokenizer(src, dst, vocab: int = 8, config=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = edited_dir(src, dst, config=config)
    words = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        unk_token="[UNK]")))
    return model


def test_a_good_tokenizer_directory_loads(tiny_dir, tmp_path):
    model = with_tokenizer(tiny_dir, tmp_path / "m", config=dict(bos_token_id=1, eos_token_id=2))
    engine = Engine.from_pretrained(str(model), config=EngineConfig(**TINY))
    assert engine.tokenizer.encode("w3 w4") == [3, 4]


@pytest.mark.parametrize("content,message", [
    (os.urandom(4096), "tokenizer.json: not valid JSON"),
    (b'{"version": "1.0"}', "tokenizer.json: "),
    (b"[1, 2]", "tokenizer.json: expected a JSON object"),
])
def test_a_corrupt_tokenizer_json_is_an_error_naming_the_file(tiny_dir, tmp_path, content,
                                                              message):
    model = with_tokenizer(tiny_dir, tmp_path / "m")
    (model / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(str(model), config=EngineConfig(**TINY))


@pytest.mark.parametrize("config,vocab,message", [
    (dict(eos_token_id=600), 8, r"config.json: eos_token_id=600 .*vocab_size=512"),
    (dict(eos_token_id=[2, -1]), 8, r"config.json: eos_token_id=\[2, -1\]"),
    (dict(bos_token_id="x"), 8, r"config.json: bos_token_id='x' must be"),
    (dict(), 1000, r"tokenizer.json.* 1000 tokens .*vocab_size=512"),
])
def test_model_files_that_disagree_are_refused_at_load(tiny_dir, tmp_path, config, vocab,
                                                       message):
    model = with_tokenizer(tiny_dir, tmp_path / "m", vocab=vocab, config=config)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(str(model), config=EngineConfig(**TINY))


# -- 7. prompts and params of the wrong shape --------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=EngineConfig(**TINY))


@pytest.mark.parametrize("call,message", [
    (lambda e: e.generate(None), "prompts is None; expected a string, a list of token ids"),
    (lambda e: e.generate(5), r"prompts is an int \(5\); expected a string, a list of token ids"),
    (lambda e: e.generate(b"abc"), r"prompts is bytes \(b'abc'\); expected a string"),
    (lambda e: e.generate(["x"], {"max_tokens": 2}),
     r"params is a dict \(\{'max_tokens': 2\}\); expected SamplingParams, a list of them or "
     r"None \(as in vLLM, a dict is not taken: SamplingParams\(\*\*params\) builds one\)"),
    (lambda e: e.embed(None), "inputs is None; expected a string, a list of token ids"),
    (lambda e: e.embed([b"x"]), "input 0 is bytes"),
    (lambda e: e.generate("x", SamplingParams), "params is the class SamplingParams"),
])
def test_prompts_of_the_wrong_shape_say_what_was_passed(engine, call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call(engine)
    assert not engine.has_work()


def test_one_list_of_token_ids_is_one_prompt_as_in_openais_api(engine):
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    one = engine.generate([1, 2, 3], greedy, use_tqdm=False)
    assert [o.token_ids for o in one] == [o.token_ids for o in engine.generate(
        [[1, 2, 3]], greedy, use_tqdm=False)]
    assert len(engine.generate(np.array([4, 5]), greedy, use_tqdm=False)) == 1


# -- 9. EngineConfig types and relations ----------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    (dict(batching=["fcfs"]), r"batching=\['fcfs'\] is not a batching policy; expected one of"),
    (dict(token_buckets=()), r"token_buckets=\(\) must hold at least one"),
    (dict(seq_buckets=[]), r"seq_buckets=\[\] must hold at least one"),
    (dict(chunk_size=512, token_budget=256), "chunk_size=512 exceeds token_budget=256"),
    (dict(max_chunk_seqs=64, max_num_seqs=32), "max_chunk_seqs=64 exceeds max_num_seqs=32"),
    (dict(scheduler=None), "scheduler=None must be"),
    (dict(kv_cache_gib="2"), "kv_cache_gib='2' must be"),
])
def test_engine_config_checks_types_and_relations(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_defaults_follow_the_knobs_they_depend_on():
    cfg = EngineConfig(token_budget=16, max_num_seqs=2)
    assert (cfg.chunk_size, cfg.max_chunk_seqs) == (16, 2)
    # no budget given: the engine sizes it from the cost model it knows, at resolve (256 and a
    # chunk of 64 where it knows none)
    resolved = EngineConfig().resolve(model_max_len=512, kv_bytes_per_token=64)
    assert (resolved.token_budget, resolved.chunk_size, resolved.max_chunk_seqs) == (256, 64, 4)


def test_the_bench_refuses_what_engine_config_refuses(capsys):
    from hetero_jax.bench.config import parse_config

    for flags, message in ((["--chunk-size", "512"], "chunk_size=512 exceeds token_budget=256"),
                           (["--max-chunk-seqs", "64"], "max_chunk_seqs=64 exceeds "
                            "max_num_seqs=32")):
        with pytest.raises(SystemExit):
            parse_config(flags)
        assert message in capsys.readouterr().err


# -- 10. a dead replica gets no work ------------------------------------------------------------

def test_a_replica_killed_while_idle_gets_no_more_work():
    from hetero_jax.serving.replicas import ReplicaSet

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two replicas need two cores")
    with ReplicaSet.from_preset("tiny", 2, config=EngineConfig(**TINY)) as rs:
        os.kill(rs._procs[0].pid, signal.SIGKILL)
        rs._procs[0].join(timeout=30)
        outs = rs.generate([[256, i + 1] for i in range(12)],
                           SamplingParams(max_tokens=2, ignore_eos=True))
        assert [o.finish_reason for o in outs] == ["length"] * 12, [o.error for o in outs]
