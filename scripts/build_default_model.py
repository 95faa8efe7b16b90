"""Build a small trained preset: a byte-level Llama trained with optax on the corpus and
questions about it, plus its LoRA embedding adapter (`hetero_jax.train`).

    PYTHONPATH=. python scripts/build_default_model.py --out DIR [--epochs 28]

Not shipped: at these defaults (25 min wall, shared 2-core CPU, docs/results.md) the model
reaches 1.88 nats/byte on the answers and its greedy answers are not readable yet ("The the
the ..."), and the adapter does not learn on its pooled states; it needs far more steps.

In: data/corpus.jsonl. Each passage becomes one document in the format of the batch example's
prompts, "Passage: <text>\\nQuestion: What is <title> known for?\\nAnswer: <its first
sentence>" and EOS; the model (`MINI`, random init from seed 0) learns
them with next-token cross-entropy (`train.lm`). Then the embedding adapter is fitted on that
frozen model over (query, passage) pairs made from every passage (`data.corpus_pairs`).
Out: a model directory (config.json, model.safetensors, tokenizer_config.json naming the
byte tokenizer) with adapter/ (PEFT) in --out, and the CPU time spent. Every seed is fixed, so a rerun on the same
jax version and machine writes the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import numpy as np
from tqdm.auto import tqdm

from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import export_hf_model
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.tokenizer import BYTE_TOKENIZER_CLASS, ByteTokenizer
from hetero_jax.train import data
from hetero_jax.train.checkpoint import export_adapter
from hetero_jax.train.fit import FitOptions, fit_adapter, recall
from hetero_jax.train.lm import LMConfig, init_lm_state, lm_batches, lm_step
from hetero_jax.train.step import AdapterConfig, init_lora

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "corpus.jsonl")
# 1.9M parameters, 7.6 MB in fp32 (tied embeddings)
MINI = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                   num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=2048,
                   tie_word_embeddings=True, bos_token_id=ByteTokenizer.bos_token_id,
                   eos_token_ids=(ByteTokenizer.eos_token_id,))
PROMPT = "Passage: {text}\nQuestion: What is {title} known for?\nAnswer:"


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?]) ", text, maxsplit=1)[0]


def qa_documents(corpus: list) -> list:
    """The training texts: each passage with its question and answer (the batch format)."""
    return [PROMPT.format(**row) + " " + first_sentence(row["text"]) for row in corpus]


def weighted_ids(doc: str, passage_weight: float) -> tuple:
    """(BOS + the doc's bytes + EOS, the weight of predicting each next token): the passage's
    own text `passage_weight`, the question and answer 1 (what the prompt asks for)."""
    tok = ByteTokenizer()
    ids = tok.encode(doc) + [tok.eos_token_id]
    cut = len(tok.encode(doc.split("\nQuestion:")[0]))  # BOS + "Passage: <text>"
    weights = [passage_weight] * (cut - 1) + [1.0] * (len(ids) - cut + 1)
    return ids, weights


def train_lm(cfg, docs: list, epochs: int, batch_size: int, seed: int,
             passage_weight: float) -> dict:
    ids = [weighted_ids(d, passage_weight) for d in docs]
    seq_len = -(-max(len(x) for x, _ in ids) // 32) * 32
    per_epoch = len(lm_batches(ids, batch_size, seq_len, seed, 0))
    lc = LMConfig(learning_rate=5e-3, steps=epochs * per_epoch)
    state = init_lm_state(llama.init_params(cfg, seed), lc)
    bar = tqdm(total=lc.steps, unit="step", desc="language model")
    for epoch in range(epochs):
        for tokens, mask in lm_batches(ids, batch_size, seq_len, seed, epoch):
            state, loss = lm_step(state, tokens, mask, cfg=cfg, lc=lc)
            bar.update()
            bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    bar.close()
    return state.params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write (to ship it: "
                    "hetero_jax/models/preset_weights/<name>, named in presets.SHIPPED)")
    ap.add_argument("--epochs", type=int, default=28, help="passes over the documents")
    ap.add_argument("--batch-size", type=int, default=4, help="documents per step")
    ap.add_argument("--adapter-steps", type=int, default=100, help="embedding adapter steps")
    ap.add_argument("--seed", type=int, default=0, help="init and data order")
    ap.add_argument("--passage-weight", type=float, default=0.1,
                    help="loss weight of the passage's own text (questions and answers: 1)")
    args = ap.parse_args()
    start, cpu = time.perf_counter(), time.process_time()
    cfg, tok = MINI, ByteTokenizer()
    corpus = data.read_jsonl(CORPUS)
    params = train_lm(cfg, qa_documents(corpus), args.epochs, args.batch_size, args.seed,
                      args.passage_weight)
    lm_cpu = time.process_time() - cpu
    export_hf_model(args.out, cfg, params)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": BYTE_TOKENIZER_CLASS}, f)
    pairs = data.corpus_pairs([(r["title"], r["text"]) for r in corpus])
    ac = AdapterConfig(pooling="mean", rank=8, learning_rate=3e-3, steps=args.adapter_steps)
    opts = FitOptions(batch_size=32, max_len=128, seed=args.seed)
    bar = tqdm(total=ac.steps, unit="step", desc="embedding adapter")
    state = fit_adapter(params, cfg, tok, pairs, ac, opts, lambda k, loss: (
        bar.update(), bar.set_postfix(loss=f"{loss:.3f}", refresh=False)))
    bar.close()
    questions = data.corpus_pairs([(r["title"], r["text"]) for r in corpus],
                                  data.QUERY_TEMPLATES[:1])
    pool = list(dict.fromkeys(pairs.passages))
    before, after = (recall(params, cfg, tok, questions, pool, "mean", lora, 5, opts.max_len)
                     for lora in (init_lora(cfg, ac, args.seed), state.lora))
    info = dict(base="mini", pooling="mean", steps=ac.steps, k=5, recall_before=before,
                recall_after=after, note="recall of 'What is <title> known for?' over every "
                "corpus passage; these pairs were trained on")
    export_adapter(os.path.join(args.out, "adapter"), state.lora, cfg.num_layers, info, "mini")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"{args.out}: {cfg.num_params / 1e6:.2f}M params, {size / 1e6:.1f} MB; recall@5 of "
          f"the corpus questions {before:.3f} -> {after:.3f}; CPU {time.process_time() - cpu:.0f}"
          f" s ({lm_cpu:.0f} s language model), wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
