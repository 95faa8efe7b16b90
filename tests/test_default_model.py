"""Presets shipped as trained model directories, and the batch job's retrieval recall line.

A preset named in `presets.SHIPPED` loads from its directory with its embedding adapter
(tested on a directory made here: the tiny preset's weights, an adapter exported by
`train.checkpoint.export_adapter`, the byte tokenizer named in tokenizer_config.json), and
serves what `from_pretrained` on that directory serves. The shipped `mini` itself: greedy
answers to the batch example's questions start as the right passage's first sentence (at
least MIN_RIGHT of them), its adapter's recall@5 of the example's query rows is at least 0.8,
its config is the preset's, and its chat template asks in the trained format. Hand-computed:
`offline.recall` on a small OUTPUT.
"""
import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from hetero_jax.models import llama, presets
from hetero_jax.models.formats.hf_llama import export_hf_model
from hetero_jax.models.tokenizer import BYTE_TOKENIZER_CLASS
from hetero_jax.offline.recall import retrieval_recall
from hetero_jax.train.checkpoint import export_adapter
from hetero_jax.train.step import AdapterConfig, init_lora

ROOT = os.path.join(os.path.dirname(__file__), "..")
MIN_RIGHT = 0.7  # share of the example's 32 greedy answers from the right passage (26/32 here)


@pytest.mark.slow  # 15 s: builds and loads a model directory
def test_shipped_preset_loads_its_directory_and_adapter(tmp_path, monkeypatch):
    from hetero_jax import Engine, EngineConfig

    cfg = presets.PRESETS["tiny"]
    path = tmp_path / "preset_weights" / "tiny"
    export_hf_model(str(path), cfg, llama.init_params(cfg, 3))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class":
                                                            BYTE_TOKENIZER_CLASS}))
    lora = {w: (a, jnp.full(b.shape, 0.01))  # B non-zero: the adapter changes the embeddings
            for w, (a, b) in init_lora(cfg, AdapterConfig(rank=4, targets=("wq", "wv")),
                                       0).items()}
    export_adapter(str(path / "adapter"), lora, cfg.num_layers, {})
    monkeypatch.setattr(presets, "SHIPPED", ("tiny",))
    monkeypatch.setattr(presets, "preset_dir", lambda name: str(path) if name == "tiny" else None)
    import hetero_jax.serving.engine as engine_module
    monkeypatch.setattr(engine_module, "preset_dir", presets.preset_dir)
    ecfg = EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=4, max_model_len=128)
    shipped = Engine.from_preset("tiny", config=ecfg)
    direct = Engine.from_pretrained(str(path), config=ecfg, embed_adapter=str(path / "adapter"))
    base = Engine.from_pretrained(str(path), config=ecfg)
    texts = ["What is Mars known for?", "Mars is the fourth planet from the Sun."]
    got = shipped.embed(texts, use_tqdm=False)  # strings: the byte tokenizer was found
    np.testing.assert_allclose(got, direct.embed(texts, use_tqdm=False), atol=1e-6)
    assert np.abs(got - base.embed(texts, use_tqdm=False)).max() > 1e-3  # adapter in use


def test_batch_recall_of_query_rows_by_hand(tmp_path):
    rows = [{"id": "passage/a", "embedding": [1.0, 0.0]}, {"id": "passage/b", "embedding":
            [0.0, 1.0]}, {"id": "query/a", "embedding": [0.2, 0.9]},
            {"id": "query/b", "embedding": [0.1, 0.8]}, {"id": "question/1", "text": "x"},
            {"id": "query/c", "embedding": [1.0, 1.0]}]  # no passage/c: not counted
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = retrieval_recall(str(out), k=1)
    assert (found.value, found.queries, found.passages) == (0.5, 2, 2)
    assert retrieval_recall(str(out), k=2).value == 1.0
    (tmp_path / "none.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert retrieval_recall(str(tmp_path / "none.jsonl")) is None


@pytest.mark.slow  # two engines of the tiny preset, each compiling its step variants
def test_generate_and_embed_commands_print_texts(capsys):
    from hetero_jax.cli import main

    assert main(["generate", "Hello", "--preset", "tiny", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    assert "'Hello' -> '" in capsys.readouterr().out
    assert main(["embed", "What is Mars known for?", "Mars is the fourth planet."]) == 0
    out = capsys.readouterr().out
    assert "cosine similarities:" in out and "(256 dims, L2-normalised)" in out, out


def example_rows(prefix: str) -> list:
    with open(os.path.join(ROOT, "data", "batch_example.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["id"].startswith(prefix)]


@pytest.fixture(scope="module")
def mini():
    from hetero_jax import Engine, EngineConfig

    return Engine.from_preset("mini", config=EngineConfig(token_budget=256, chunk_size=64,
                                                          max_num_seqs=32))


def test_the_shipped_default_answers_the_example_from_the_corpus(mini):
    """Greedy answers to the batch example's questions (a phrasing the model was not trained
    on) start as the first sentence of the passage asked about."""
    from hetero_jax import SamplingParams

    with open(os.path.join(ROOT, "data", "corpus.jsonl"), encoding="utf-8") as f:
        corpus = {r["title"]: r["text"] for r in map(json.loads, f)}
    rows = example_rows("question/")
    titles = [re.search(r"about (.*)\?\nAnswer:$", r["prompt"]).group(1) for r in rows]
    outs = mini.generate([r["prompt"] for r in rows], SamplingParams(max_tokens=32,
                                                                     temperature=0.0),
                         use_tqdm=False)
    right = [o.text.strip().startswith(corpus[t][:24]) for o, t in zip(outs, titles)]
    assert sum(right) >= MIN_RIGHT * len(rows), [o.text for o in outs]


def test_the_shipped_adapter_finds_the_asked_passage(mini, tmp_path):
    """recall@5 of the example's query rows (a phrasing held out of the adapter's training)
    over every passage row, through the engine's embeddings and the batch summary's
    `retrieval_recall`: at least 0.8 (issue 29)."""
    rows = example_rows("passage/") + example_rows("query/")
    vectors = mini.embed([r["embed"] for r in rows], use_tqdm=False)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": r["id"], "embedding": v.tolist()}) + "\n"
                           for r, v in zip(rows, vectors)))
    found = retrieval_recall(str(out), k=5)
    assert found.queries == 32 and found.value >= 0.8, found


def test_the_shipped_config_is_the_preset_s(mini):
    assert mini.model_cfg == presets.PRESETS["mini"]


def test_chat_on_the_shipped_default_asks_in_its_trained_format(mini):
    """The shipped tokenizer_config.json's template turns a user message into "Question: ...
    \\nAnswer:", for Engine.chat and for the server started on the preset."""
    from hetero_jax import SamplingParams
    from hetero_jax.server.cli import build_parser, server_config

    params = SamplingParams(max_tokens=24, temperature=0.0)
    chat = mini.chat([{"role": "user", "content": "What can you tell me about Mars?"}], params,
                     use_tqdm=False)[0]
    plain = mini.generate(["Question: What can you tell me about Mars?\nAnswer:"], params,
                          use_tqdm=False)[0]
    assert chat.token_ids == plain.token_ids
    template = server_config(build_parser().parse_args([])).chat_template
    assert template == mini.tokenizer.chat_template and "Question: " in template
