"""Build the shipped `mini` preset: a byte-level Llama trained with optax on questions about
the corpus, answered with a passage's first sentence, plus its LoRA embedding adapter.

    PYTHONPATH=. python scripts/build_default_model.py --out DIR --epochs 100 --stop-after 81
    PYTHONPATH=. python scripts/build_default_model.py --out DIR --epochs 140 --stop-after 118
    PYTHONPATH=. python scripts/build_default_model.py --out DIR --epochs 200

builds the shipped weights in three phases, each resuming the last one's state in --work
under a longer schedule (the learning rate back up to ~0.4 of its peak), about 75 minutes
on one core here, and the adapter about 30 more (docs/results.md, "Issue 29 item 2, fourth
try").

In: data/corpus.jsonl (104 passages). Each epoch every passage becomes `--per-passage`
documents "Question: <q>\nAnswer: <its first sentence>" and EOS, with <q> one of
`TRAIN_TEMPLATES` over the passage's title, drawn per (seed, epoch, passage), and
`--passages` documents of its plain text. The answer's first bytes weigh `--answer-weight`
in the loss. The batch example's phrasings are never trained on: its prompts ask `ASK`, its
query rows `HELD_OUT`. The model (`presets.PRESETS["mini"]`, random init from --seed) learns
next-token cross-entropy with AdamW (`train.lm`, dense causal attention, cosine schedule over
--epochs), saving its state after each epoch in --work, so a killed run started again
resumes. Then the embedding adapter is fitted on that frozen model over (question, passage)
pairs of the train templates (`train.fit`).
Out: a model directory in --out (config.json, model.safetensors in fp32, tokenizer_config.json
naming the byte tokenizer) with adapter/ (PEFT); printed: the greedy answers to `ASK` for
every passage and how many start as its first sentence, and recall@5 of the `HELD_OUT`
questions over all passages before and after the adapter. Every seed is fixed, so a rerun on
the same jax version and machine writes the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models import llama
from hetero_jax.models.formats.hf_llama import export_hf_model
from hetero_jax.models.presets import PRESETS
from hetero_jax.models.tokenizer import BYTE_TOKENIZER_CLASS, ByteTokenizer
from hetero_jax.train import data
from hetero_jax.train.checkpoint import export_adapter
from hetero_jax.train.fit import FitOptions, fit_adapter, recall
from hetero_jax.train.lm import LMConfig, dense_logits, init_lm_state, lm_batches, lm_step
from hetero_jax.train.step import AdapterConfig, init_lora

ANSWER_HEAD = 16
CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "corpus.jsonl")
PROMPT = "Question: {question}\nAnswer:"
# chat turns in PROMPT's format, so Engine.chat and /v1/chat/completions ask as trained
CHAT_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}Question: {{ m.content }}\n"
                 "{% elif m.role == 'assistant' %}Answer: {{ m.content }}\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}")
HELD_OUT = "What is {title} known for?"  # the batch example's query rows: never trained on
ASK = "What can you tell me about {title}?"  # the batch example's prompts: never trained on
# every trained question ends with the title, as ASK does: the answer's first bytes then hang
# on bytes a fixed distance back, which a 3-layer byte model learns to look up
TRAIN_TEMPLATES = ("Tell me about {title}.", "What do you know about {title}?",
                   "Describe {title}.", "What is {title}?", "Give one fact about {title}.",
                   "{title}?", "Say something about {title}.", "Who or what is {title}?")


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?]) ", text, maxsplit=1)[0]


def qa_document(row: dict, template: str) -> str:
    """One training text: the passage, a question on its title, the answer (batch format)."""
    return PROMPT.format(question=template.format(title=row["title"])) + " " + \
        first_sentence(row["text"])


def epoch_documents(corpus: list, seed: int, epoch: int, per_passage: int,
                    answer_weight: float, passages: int) -> list:
    """(token ids: BOS + bytes + EOS, weights) `per_passage` times per passage, each with a
    template drawn by (seed, epoch); the answer's first ANSWER_HEAD bytes weigh
    `answer_weight` (where the model must look back), every other byte 1."""
    rng = np.random.default_rng([seed, epoch, 1])
    tok, out = ByteTokenizer(), []
    for _ in range(per_passage):
        for row, t in zip(corpus, rng.integers(0, len(TRAIN_TEMPLATES), len(corpus))):
            text = qa_document(row, TRAIN_TEMPLATES[t])
            ids = tok.encode(text) + [tok.eos_token_id]
            start = len(tok.encode(text.rsplit("Answer:", 1)[0] + "Answer:"))  # ids index
            weights = [1.0] * len(ids)
            for j in range(start - 1, min(start - 1 + ANSWER_HEAD, len(ids))):
                weights[j] = answer_weight  # predicting ids[j + 1], the answer's bytes
            out.append((ids, weights))
    for _ in range(passages):
        out += [(ids, [1.0] * len(ids)) for ids in
                (tok.encode(row["text"]) + [tok.eos_token_id] for row in corpus)]
    return out


def train_lm(cfg, corpus: list, args) -> dict:
    """The language model, resumed from --work/lm_state.msgpack when a run left one."""
    docs = lambda epoch: epoch_documents(corpus, args.seed, epoch, args.per_passage,
                                         args.answer_weight, args.passages)
    per_epoch = len(lm_batches(docs(0), args.batch_size, args.seed, 0))
    lc = LMConfig(learning_rate=args.lr, steps=args.epochs * per_epoch, warmup=20,
                  weight_decay=0.0)
    state, first = init_lm_state(llama.init_params(cfg, args.seed), lc), 0
    path = os.path.join(args.work, "lm_state.msgpack")
    if os.path.exists(path):
        with open(path, "rb") as f:
            saved = flax.serialization.msgpack_restore(f.read())
        state, first = flax.serialization.from_state_dict(state, saved["state"]), saved["epoch"]
        print(f"resumed after epoch {first} from {path}")
    for epoch in range(first, min(args.epochs, args.stop_after or args.epochs)):
        t, losses = time.perf_counter(), []
        for tokens, mask in lm_batches(docs(epoch),
                                       args.batch_size, args.seed, epoch):
            state, loss = lm_step(state, tokens, mask, cfg=cfg, lc=lc)
            losses.append(float(loss))
        print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.3f} nats/byte, "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        blob = {"epoch": epoch + 1, "state": flax.serialization.to_state_dict(state)}
        with open(path + ".tmp", "wb") as f:
            f.write(flax.serialization.msgpack_serialize(jax.device_get(blob)))
        os.replace(path + ".tmp", path)
    return state.params


def greedy_answer(params, cfg, prompt: str, max_tokens: int = 48) -> str:
    """The model's greedy continuation of `prompt` (dense forward; a check, not the engine)."""
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    size = -(-(len(ids) + max_tokens) // 64) * 64
    step = jax.jit(dense_logits, static_argnames="cfg")
    out = []
    for _ in range(max_tokens):
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :len(ids)] = ids
        nxt = int(jnp.argmax(step(params, cfg, jnp.asarray(tokens))[0, len(ids) - 1]))
        if nxt == tok.eos_token_id:
            break
        ids, out = ids + [nxt], out + [nxt]
    return tok.decode(out)


def fit_embedding_adapter(params, cfg, corpus: list, args) -> tuple:
    """-> (LoRA weights, info): the adapter on train-template pairs, and recall@5 of the
    held-out questions over every passage before and after it."""
    tok, docs = ByteTokenizer(), [(r["title"], r["text"]) for r in corpus]
    pairs = data.corpus_pairs(docs, TRAIN_TEMPLATES)
    ac = AdapterConfig(pooling="mean", rank=args.adapter_rank, learning_rate=args.adapter_lr,
                       steps=args.adapter_steps)
    opts = FitOptions(batch_size=32, max_len=224, seed=args.seed)
    state = fit_adapter(params, cfg, tok, pairs, ac, opts, lambda k, loss: print(
        f"adapter step {k}/{ac.steps}: loss {loss:.3f}", flush=True) if k % 10 == 0 else None)
    held_out, pool = data.corpus_pairs(docs, (HELD_OUT,)), [r["text"] for r in corpus]
    before, after = (recall(params, cfg, tok, held_out, pool, "mean", lora, 5, opts.max_len)
                     for lora in (init_lora(cfg, ac, args.seed), state.lora))
    info = dict(base="mini", pooling="mean", steps=ac.steps, rank=ac.rank, k=5,
                recall_before=before, recall_after=after,
                note=f"recall@5 of the held-out question {HELD_OUT!r} (never trained on) "
                     "over every corpus passage; the passages were trained on")
    return state.lora, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write (to ship it: "
                    "hetero_jax/models/preset_weights/<name>, named in presets.SHIPPED)")
    ap.add_argument("--work", default="/tmp/build_default_model",
                    help="where the language model's state is saved after each epoch")
    ap.add_argument("--epochs", type=int, default=200, help="passes over the 104 passages")
    ap.add_argument("--batch-size", type=int, default=8, help="documents per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    ap.add_argument("--adapter-steps", type=int, default=1000, help="embedding adapter steps")
    ap.add_argument("--adapter-lr", type=float, default=3e-3, help="adapter learning rate")
    ap.add_argument("--adapter-rank", type=int, default=8, help="adapter LoRA rank")
    ap.add_argument("--per-passage", type=int, default=4, help="documents per passage an epoch")
    ap.add_argument("--answer-weight", type=float, default=4.0,
                    help="loss weight of the answer's first bytes")
    ap.add_argument("--passages", type=int, default=0,
                    help="plain passage documents per passage an epoch")
    ap.add_argument("--stop-after", type=int, default=None, metavar="EPOCH",
                    help="stop after this epoch, the schedule still spanning --epochs (a "
                    "later run with the same --work resumes from it)")
    ap.add_argument("--seed", type=int, default=0, help="init and data order")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    start, cfg = time.perf_counter(), PRESETS["mini"]
    corpus = data.read_jsonl(CORPUS)
    params = train_lm(cfg, corpus, args)
    if args.stop_after is not None and args.stop_after < args.epochs:
        print(f"stopped after epoch {args.stop_after} of {args.epochs}; run again to go on")
        return
    lm_wall = time.perf_counter() - start
    right = 0
    for row in corpus:
        prompt = PROMPT.format(question=ASK.format(title=row["title"]))
        answer = greedy_answer(params, cfg, prompt)
        right += answer.strip().startswith(first_sentence(row["text"])[:24])
        print(f"{row['title']!r} -> {answer!r}", flush=True)
    print(f"greedy answers to {ASK!r} starting as the passage's first sentence: "
          f"{right}/{len(corpus)}", flush=True)
    export_hf_model(args.out, cfg, params)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": BYTE_TOKENIZER_CLASS, "chat_template": CHAT_TEMPLATE}, f)
    lora, info = fit_embedding_adapter(params, cfg, corpus, args)
    export_adapter(os.path.join(args.out, "adapter"), lora, cfg.num_layers, info, "mini")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"{args.out}: {cfg.num_params / 1e6:.2f}M params, {size / 1e6:.1f} MB; recall@5 of "
          f"the held-out questions {info['recall_before']:.3f} -> {info['recall_after']:.3f}; "
          f"wall {time.perf_counter() - start:.0f} s ({lm_wall:.0f} s language model)")


if __name__ == "__main__":
    main()
