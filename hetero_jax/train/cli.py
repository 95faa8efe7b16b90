"""`hetero-jax train-adapter`: fit a LoRA embedding adapter on a frozen model, write it as PEFT.

    hetero-jax train-adapter --pairs data/corpus.jsonl --output out/adapter [--preset tiny |
                             --model DIR] [--pooling mean] [--steps 200] [--rank 8] ...

In: argv (checked by argparse before jax is imported, so `--help` and a bad flag are quick),
a pairs or corpus file (`data.read_pairs`). Then: load the base model, split the pairs by
passage into train and held-out, measure recall@k of the held-out queries against every
passage on the base model's pooled states, train (`fit.fit_adapter`, a tqdm bar with the loss
on stderr; checkpoints in `--checkpoint-dir`, so the same command after a kill resumes),
measure recall@k through the adapter, and write the PEFT directory OUTPUT (with
`training.json`). Out: a summary on stdout; exit status 0, 2 on a bad flag or file.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from hetero_jax.models.config import PROJECTIONS as TARGETS
from hetero_jax.models.presets import PRESETS
from hetero_jax.requests import STREAMING_KINDS as POOLERS
from hetero_jax.sim.options import DefaultsHelpFormatter, int_range, real_range



def _targets(text: str) -> tuple:
    names = tuple(t for t in text.split(",") if t)
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: pick among {','.join(TARGETS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetero-jax train-adapter", formatter_class=DefaultsHelpFormatter,
        description="Fit a LoRA embedding adapter (contrastive, in-batch negatives, optax) on a "
        "frozen model; write a PEFT directory that Engine.from_pretrained(dir, "
        "embed_adapter=OUTPUT) loads.")
    p.add_argument("--pairs", required=True, metavar="PATH", help="JSONL of {query, passage} "
                   "rows, or a corpus of {title, text} rows (data/corpus.jsonl) to make pairs of")
    p.add_argument("--output", required=True, metavar="DIR", help="the PEFT adapter directory")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="base model")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face model directory as the base (overrides --preset)")
    p.add_argument("--pooling", default="mean", choices=POOLERS, help="the engine's pooler")
    p.add_argument("--rank", type=int_range(1, 256), default=8, help="LoRA rank")
    p.add_argument("--targets", type=_targets, default=TARGETS, metavar="W,W,...",
                   help=f"adapted projections, among {','.join(TARGETS)}")
    p.add_argument("--steps", type=int_range(1, 1_000_000), default=200, help="train steps")
    p.add_argument("--batch-size", type=int_range(2, 4096), default=32,
                   help="pairs per step (the in-batch negatives)")
    p.add_argument("--lr", type=real_range(0, open_lo=True), default=2e-3,
                   help="peak learning rate (AdamW, warm-up then cosine decay)")
    p.add_argument("--temperature", type=real_range(0, open_lo=True), default=0.05,
                   help="of the contrastive softmax")
    p.add_argument("--max-len", type=int_range(1, 8192), default=128,
                   help="tokens kept of each query and passage")
    p.add_argument("--held-out", type=real_range(0, 0.9), default=0.2,
                   help="share of the passages (with their pairs) kept out of training")
    p.add_argument("--k", type=int_range(1, 1000), default=5, help="recall@k")
    p.add_argument("--seed", type=int_range(0, 2**32 - 1), default=0,
                   help="the split, the adapter's init, the batches (and a preset's weights)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="orbax train-state checkpoints; a rerun resumes from the latest "
                   "(default: OUTPUT.checkpoints)")
    p.add_argument("--checkpoint-every", type=int_range(1, 1_000_000), default=50,
                   help="steps between checkpoints")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def train_main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isfile(args.pairs):
        parser.error(f"argument --pairs: {args.pairs!r} is not a file")
    if args.model and not os.path.isdir(args.model):
        parser.error(f"argument --model: {args.model!r} is not a directory")
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hetero-jax train-adapter: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from tqdm.auto import tqdm

    from hetero_jax.train import data
    from hetero_jax.train.base import load_base
    from hetero_jax.train.checkpoint import export_adapter
    from hetero_jax.train.fit import FitOptions, fit_adapter, recall
    from hetero_jax.train.step import AdapterConfig

    start = time.perf_counter()
    base = load_base(args.model or args.preset, args.seed)
    pairs = data.read_pairs(args.pairs)
    train, held = data.split(pairs, args.held_out, args.seed)
    pool = list(dict.fromkeys(pairs.passages))
    ac = AdapterConfig(pooling=args.pooling, rank=args.rank, targets=args.targets,
                       learning_rate=args.lr, temperature=args.temperature, steps=args.steps)
    opts = FitOptions(batch_size=args.batch_size, max_len=args.max_len, seed=args.seed,
                      checkpoint_dir=args.checkpoint_dir or args.output + ".checkpoints",
                      checkpoint_every=args.checkpoint_every)
    print(f"base: {base.name} ({base.cfg.num_params / 1e6:.1f}M params); {len(train)} train "
          f"pairs, {len(held)} held-out pairs, {len(pool)} passages; {args.pooling} pooling, "
          f"rank {args.rank}", flush=True)
    measure = lambda lora: recall(base.params, base.cfg, base.tokenizer, held, pool,  # noqa
                                  args.pooling, lora, args.k, args.max_len) if len(held) else None
    before = measure(None)
    bar = tqdm(total=args.steps, unit="step", desc="train", disable=args.no_progress)
    state = fit_adapter(base.params, base.cfg, base.tokenizer, train, ac, opts,
                        lambda step, loss: (bar.update(step - bar.n),
                                            bar.set_postfix(loss=f"{loss:.3f}")))
    bar.close()
    after = measure(state.lora)
    info = dict(base=base.name, pooling=args.pooling, steps=args.steps, k=args.k,
                recall_before=before, recall_after=after, train_pairs=len(train),
                held_out_pairs=len(held), passages=len(pool))
    export_adapter(args.output, state.lora, base.cfg.num_layers, info, base.name)
    if before is not None:
        print(f"recall@{args.k} of {len(held)} held-out queries over {len(pool)} passages: "
              f"{before:.3f} on the base model, {after:.3f} through the adapter")
    print(f"{args.output}: PEFT adapter (load with Engine.from_pretrained(model, "
          f"embed_adapter={args.output!r})); {time.perf_counter() - start:.1f} s in all")
    return 0
