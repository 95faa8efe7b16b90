"""Loading is safe and checked: no code runs from a model directory, and a corrupt, inconsistent
or escaping file fails naming the file and the tensor or key, before anything is allocated.

Each test edits a copy of a good directory (the tiny Hugging Face models of `hf_model`, a tiny
BERT, an engine checkpoint of the `tiny` preset) in one way and expects one clear error.
"""
import io
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from hetero_jax import Engine
from hetero_jax.models import llama
from hetero_jax.models.formats.hf_bert import load_bert
from hetero_jax.models.formats.hf_llama import load_hf_model
from hetero_jax.models.formats.peft import load_adapter
from hetero_jax.models.formats.safetensors import SafetensorsFile
from hetero_jax.models.formats.sentence_transformers import read_sentence_transformers_pooling
from hetero_jax.models.presets import preset_config
from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer
from hetero_jax.serving import checkpoint


def _copy(hf_model, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(hf_model(name)[0], dst)
    return dst


def _edit_json(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del raw[key]
    path.write_text(json.dumps(raw))


# -- 1. no code from a model directory ------------------------------------------------------
EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nclass EvilTokenizer: pass\n"


def _evil_dir(hf_model, tmp_path, **tokenizer_config):
    model_dir = tmp_path / "evil"
    model_dir.mkdir()
    shutil.copy(os.path.join(hf_model("llama3")[0], "config.json"), model_dir)
    # A Llama to hetero-jax, an architecture transformers does not know (no built-in tokenizer).
    _edit_json(model_dir / "config.json", model_type="evil", auto_map={"AutoConfig": "evil.Cfg"})
    marker = tmp_path / "marker"
    (model_dir / "evil.py").write_text(EVIL.format(marker=str(marker)))
    auto_map = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(dict(auto_map=auto_map,
                                                                     **tokenizer_config)))
    return model_dir, marker


@pytest.fixture
def answers_yes(monkeypatch, tmp_path):
    """stdin is not a terminal and would answer "y" to transformers' remote-code prompt."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 4))
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE",
                        str(tmp_path / "modules"))


def test_tokenizer_never_runs_code_from_the_model_directory(hf_model, tmp_path, answers_yes):
    model_dir, marker = _evil_dir(hf_model, tmp_path)
    with pytest.raises(ValueError, match=f"{model_dir}: .*custom code"):
        load_tokenizer(str(model_dir), (2,))
    assert not marker.exists(), "the model directory's code ran"


def test_tokenizer_with_auto_map_falls_back_to_the_builtin_class(hf_model, tmp_path,
                                                                 answers_yes):
    from tokenizers import Tokenizer, models, pre_tokenizers
    model_dir, marker = _evil_dir(hf_model, tmp_path, tokenizer_class="PreTrainedTokenizerFast")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    assert load_tokenizer(str(model_dir), (2,)).encode("hello world") == [1, 2]
    assert not marker.exists(), "the model directory's code ran"


# -- 2. safetensors headers -----------------------------------------------------------------
def _write_raw(path, header, data: bytes):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, match", [
    ({"a": _f32([4], 0, 16), "b": _f32([4], 0, 16)}, "tensor b overlaps tensor a"),
    ({"a": _f32([4], 0, 16), "b": _f32([4], 8, 24)}, "tensor b overlaps tensor a"),
    ({"a": _f32([4], 16, 0)}, r"tensor a: data_offsets \[16, 0\] run backwards"),
    ({"a": _f32([4], 0, 8)}, (r"tensor a: shape \[4\] x F32 needs 16 bytes, data_offsets "
                             r"\[0, 8\] hold 8")),
    ({"a": _f32([2, 4], 0, 16)}, r"tensor a: shape \[2, 4\] x F32 needs 32 bytes"),
    ({"a": {"dtype": "F32", "shape": [4]}}, "tensor a: .*data_offsets"),
    ({"a": _f32([-4], 0, 16)}, r"tensor a: .*shape \[-4\]"),
    ([1, 2], "header is not a JSON object"),
    (b"{not json", "header is not valid JSON"),
])
def test_bad_safetensors_header_names_file_and_tensor(tmp_path, header, match):
    path = tmp_path / "w.safetensors"
    _write_raw(path, header, bytes(32))
    with pytest.raises(ValueError, match=f"w.safetensors: {match}") as err:
        SafetensorsFile(str(path))
    assert not isinstance(err.value, json.JSONDecodeError)


def test_good_header_with_unused_dtypes_reads(tmp_path):
    path = tmp_path / "w.safetensors"
    header = {"__metadata__": {"format": "pt"}, "ids": {"dtype": "I64", "shape": [2],
                                                         "data_offsets": [16, 32]},
              "a": _f32([4], 0, 16), "empty": _f32([0], 32, 32)}
    _write_raw(path, header, np.arange(4, dtype=np.float32).tobytes() + bytes(16))
    np.testing.assert_array_equal(SafetensorsFile(str(path)).get("a"), [0, 1, 2, 3])


def test_aliased_tensor_in_a_checkpoint_is_refused(hf_model, tmp_path):
    model_dir = _copy(hf_model, "llama3", tmp_path)
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = "model.layers.1.mlp.up_proj.weight"
    header[name]["data_offsets"] = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"]
    _write_raw(path, header, data[8 + n:])
    with pytest.raises(ValueError, match="model.safetensors: tensor .*up_proj.weight overlaps"):
        load_hf_model(str(model_dir))


# -- 3. every tensor is accounted for -------------------------------------------------------
def test_config_with_fewer_layers_than_the_weights_is_refused(hf_model, tmp_path):
    model_dir = _copy(hf_model, "llama3", tmp_path)
    _edit_json(model_dir / "config.json", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model\.layers\.1\..* "
                                         r"not used"):
        load_hf_model(str(model_dir))


def test_unknown_tensor_is_refused(hf_model, tmp_path):
    model_dir = _copy(hf_model, "mistral", tmp_path)
    path = str(model_dir / "model.safetensors")
    save_file(dict(load_file(path), **{"model.extra.weight": np.ones(3, np.float32)}), path)
    with pytest.raises(ValueError, match="model.safetensors: tensor model.extra.weight .*not used"):
        load_hf_model(str(model_dir))


def test_tied_checkpoint_may_ship_an_lm_head_of_the_embedding_shape(hf_model, tmp_path):
    model_dir = _copy(hf_model, "qwen2", tmp_path)
    path = str(model_dir / "model.safetensors")
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    save_file(dict(tensors, **{"lm_head.weight": embed}), path)
    cfg, params = load_hf_model(str(model_dir))
    assert cfg.tie_word_embeddings and "lm_head" not in params
    save_file(dict(tensors, **{"lm_head.weight": embed[:, :8].copy()}), path)
    with pytest.raises(ValueError, match=r"tensor lm_head.weight has shape \(300, 8\)"):
        load_hf_model(str(model_dir))


def test_bert_ignores_heads_by_rule_not_everything(tmp_path):
    config = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=96)
    transformers.BertForPreTraining(config).save_pretrained(tmp_path)  # bert.pooler.*, cls.*
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    ids = np.arange(512, dtype=np.int64)[None]
    save_file(dict(tensors, **{"bert.embeddings.position_ids": ids}), path)
    assert load_bert(str(tmp_path))[0].num_layers == 2
    _edit_json(tmp_path / "config.json", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"tensor bert\.encoder\.layer\.1\..* not used"):
        load_bert(str(tmp_path))


# -- 4. sharded index entries stay inside the directory -------------------------------------
@pytest.fixture
def sharded(hf_model, tmp_path):
    model_dir = tmp_path / "sharded"
    hf_model("qwen2")[1].save_pretrained(model_dir, max_shard_size="50KB")
    return model_dir


def _point_entry(model_dir, target):
    index = model_dir / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = "model.embed_tokens.weight"
    outside = model_dir.parent / "outside.safetensors"
    shutil.copy(model_dir / raw["weight_map"][name], outside)
    raw["weight_map"][name] = target(model_dir, outside)
    index.write_text(json.dumps(raw))


def _symlink(model_dir, outside):
    os.symlink(outside, model_dir / "link.safetensors")
    return "link.safetensors"


@pytest.mark.parametrize("target", [lambda d, out: "../outside.safetensors",
                                    lambda d, out: str(out), _symlink],
                         ids=["dotdot", "absolute", "symlink"])
def test_index_entry_outside_the_directory_is_refused(sharded, target):
    _point_entry(sharded, target)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: entry "
                                         r"model.embed_tokens.weight -> .* outside"):
        load_hf_model(str(sharded))


def test_hub_cache_snapshot_symlinks_to_its_blobs_load(sharded, tmp_path):
    """The Hugging Face cache keeps files as snapshots/<rev>/f -> ../../blobs/<hash>."""
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(sharded))):
        shutil.move(sharded / f, repo / "blobs" / f"h{i}")
        os.symlink(f"../../blobs/h{i}", snapshot / f)
    assert load_hf_model(str(snapshot))[0].tie_word_embeddings


# -- 5. bad JSON and missing keys ------------------------------------------------------------
def _write(name, text):
    return lambda d: (d / name).write_text(text)


def _edit(name, **changes):
    return lambda d: _edit_json(d / name, **changes)


@pytest.mark.parametrize("mutate, match", [
    (_write("config.json", "{oops"), "config.json: not valid JSON"),
    (_write("config.json", "[1]"), "config.json: expected a JSON object"),
    (_edit("config.json", hidden_size=None), "config.json: missing key 'hidden_size'"),
    (_edit("config.json", num_attention_heads=0), "config.json: num_attention_heads=0 must be"),
    (_edit("config.json", num_key_value_heads=3), ("num_heads=4 must be a multiple of "
                                                  "num_kv_heads=3")),
    (_edit("config.json", rope_scaling={"rope_type": "llama3"}), ("config.json: rope_scaling "
                                                                  "missing key 'factor'")),
])
def test_bad_hf_config_names_file_and_key(hf_model, tmp_path, mutate, match):
    model_dir = _copy(hf_model, "llama3", tmp_path)
    mutate(model_dir)
    with pytest.raises(ValueError, match=match):
        load_hf_model(str(model_dir))


def _bert(d):
    return load_bert(str(d))


def _pooling(d):
    return read_sentence_transformers_pooling(str(d))


@pytest.mark.parametrize("mutate, load, match", [
    (_write("config.json", ""), _bert, "config.json: not valid JSON"),
    (_edit("config.json", num_attention_heads=None), _bert, "missing key 'num_attention_heads'"),
    (_edit("config.json", num_attention_heads=5), _bert, ("hidden_size=64 must be a multiple of "
                                                         "num_attention_heads=5")),
    (_write("modules.json", "[{"), _pooling, "modules.json: not valid JSON"),
    (_write("modules.json", '[{"path": "1_Pooling"}]'), _pooling,
     "modules.json: module 0 missing key 'type'"),
    (_write("modules.json", '[{"type": "sentence_transformers.models.Pooling"}]'), _pooling,
     "modules.json: module 0 missing key 'path'"),
    (_write("modules.json", '{"type": "Pooling"}'), _pooling, "modules.json: expected a JSON list"),
])
def test_bad_bert_or_pooling_config_names_file_and_key(tmp_path, mutate, load, match):
    config = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=96)
    transformers.BertModel(config).save_pretrained(tmp_path)
    mutate(tmp_path)
    with pytest.raises(ValueError, match=match):
        load(tmp_path)


def test_bad_pooling_config_json(tmp_path):
    (tmp_path / "modules.json").write_text(
        '[{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="1_Pooling/config.json: not valid JSON"):
        read_sentence_transformers_pooling(str(tmp_path))


@pytest.mark.parametrize("text, match", [
    ("{", "adapter_config.json: not valid JSON"),
    ('{"r": 4, "target_modules": 5}', r"adapter_config.json: target_modules 5"),
    ('{"r": 4, "target_modules": ["k_proj"], "lora_alpha": "x"}',
     "adapter_config.json: lora_alpha='x' must be a positive number"),
    ('{"r": 4, "target_modules": ["k_proj"], "layers_to_transform": ["a"]}',
     r"adapter_config.json: layers_to_transform \['a'\]"),
])
def test_bad_adapter_config_names_file_and_key(hf_model, tmp_path, text, match):
    (tmp_path / "adapter_config.json").write_text(text)
    cfg = load_hf_model(hf_model("llama3")[0])[0]
    with pytest.raises(ValueError, match=match):
        load_adapter(str(tmp_path), cfg, np.float32)


@pytest.mark.parametrize("text, match", [
    ("{", "model.safetensors.index.json: not valid JSON"),
    ("{}", "model.safetensors.index.json: missing key 'weight_map'"),
])
def test_bad_index_names_file_and_key(sharded, text, match):
    (sharded / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        load_hf_model(str(sharded))


def test_index_entry_missing_from_its_shard(sharded):
    index = sharded / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    weight_map = raw["weight_map"]
    weight_map["model.norm.weight"] = next(f for f in weight_map.values()
                                           if f != weight_map["model.norm.weight"])
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="entry model.norm.weight -> .* not in that file"):
        load_hf_model(str(sharded))


# -- 6. engine checkpoints -------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "ckpt"
    cfg = preset_config("tiny")
    checkpoint.save(str(path), cfg, llama.init_params(cfg, 0), ByteTokenizer())
    return path


@pytest.fixture
def ckpt(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


def _model_json(**changes):
    def mutate(d):
        raw = json.loads((d / "model.json").read_text())
        raw["model_config"].update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del raw["model_config"][key]
        (d / "model.json").write_text(json.dumps(raw))
    return mutate


def _corrupt_data(d):
    for root, _, files in os.walk(d / "params" / "ocdbt.process_0" / "d"):
        for f in files:
            path = Path(root, f)
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("mutate, exc, match", [
    (_model_json(num_layers=2), ValueError, (r"params: param layers\.attn_norm has shape "
                                            r"\(4, 256\); .*model.json expects \(2, 256\)")),
    (_model_json(vocab_size=500), ValueError, (r"param embed has shape \(512, 256\); "
                                              r".* expects \(500, 256\)")),
    (_model_json(hidden_size=10**7), ValueError, (r"param embed has shape \(512, 256\); "
                                                 r".* expects \(512, 10000000\)")),
    (_model_json(tie_word_embeddings=True), ValueError, "param lm_head is not in the model"),
    (_model_json(num_layers=None), ValueError, ("model.json: model_config missing key "
                                               "'num_layers'")),
    (_model_json(num_heads="8"), ValueError, "model.json: model_config: num_heads='8' must be"),
    (_model_json(colour="red"), ValueError, (r"model.json: model_config has unknown keys "
                                            r"\['colour'\]")),
    (_write("model.json", "{"), ValueError, "model.json: not valid JSON"),
    (_write("model.json", '{"model_config": {}}'), ValueError, ("model.json: missing key "
                                                                "'tokenizer'")),
    (lambda d: _edit_json(d / "model.json", tokenizer="sentencepiece"), ValueError,
     "model.json: tokenizer 'sentencepiece' is not one of byte, hf, none"),
    (lambda d: shutil.rmtree(d / "params"), FileNotFoundError, "params not found"),
    (lambda d: os.remove(d / "params" / "_METADATA"), ValueError, "params: cannot read"),
    (_corrupt_data, ValueError, "params: cannot restore"),
])
def test_bad_engine_checkpoint_fails_before_allocating(ckpt, mutate, exc, match):
    mutate(ckpt)
    with pytest.raises(exc, match=match) as err:
        checkpoint.load(str(ckpt))
    assert len(str(err.value)) < 400, f"a {len(str(err.value))}-character message"
    assert not isinstance(err.value, (KeyError, json.JSONDecodeError))


def test_engine_checkpoint_loads_and_engine_load_refuses_an_edited_one(saved, ckpt):
    cfg, params, tokenizer = checkpoint.load(str(saved))
    assert cfg == preset_config("tiny") and isinstance(tokenizer, ByteTokenizer)
    assert params["layers"]["wq"].shape == llama.param_shapes(cfg)["layers"]["wq"]
    _model_json(hidden_size=10**7)(ckpt)  # the engine would allocate GBs of pooler state
    with pytest.raises(ValueError, match=r"param embed has shape \(512, 256\)"):
        Engine.load(str(ckpt))
