"""The bench's mixed workload on transformers (PyTorch CPU), on the same weights as the engine.

Exports the preset's weights to a Hugging Face Llama directory (`config.json` +
`model.safetensors`, `models.formats.hf_llama.export_hf_model`), or takes `--model DIR`,
then serves the same request lists as `hetero-jax bench` (same seed, ratios and lengths) with
the same closed-loop clients over static batches: batched mean pooling of `last_hidden_state`
for embeddings, batched greedy `generate` for generations (`hetero_jax.bench.hf_baseline`;
`--clients 0`: offline, every request at once). Prints requests/s per ratio; `--check`
first confirms that transformers and hetero-jax pick the same greedy tokens on these weights.
`hetero-jax bench --baseline hf` runs the same thing and adds the rows to its table.

    python scripts/bench_hf_baseline.py --preset small --json out/hf_baseline.json --check
"""
from __future__ import annotations

import argparse
import json
import tempfile

from hetero_jax.bench.config import int_in, parse_ratios
from hetero_jax.bench.hf_baseline import export_preset, generate_batch, hf_rows, load_model
from hetero_jax.bench.report import COLUMNS
from hetero_jax.bench.workloads import MixedWorkload
from hetero_jax.sim.report import format_table


def check_same_tokens(model, model_dir: str, max_tokens: int = 16) -> None:
    """Greedy tokens of transformers and of `Engine.from_pretrained(model_dir)` agree."""
    from hetero_jax import Engine, EngineConfig, SamplingParams

    prompts = [[256, 72, 101, 108, 108, 111], [256] + list(range(40, 90))]
    engine = Engine.from_pretrained(model_dir, config=EngineConfig(max_model_len=256))
    ours = [o.token_ids for o in engine.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        use_tqdm=False)]
    theirs = [generate_batch(model, [p], max_tokens)[0] for p in prompts]
    same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
    print(f"check: {same}/{len(prompts) * max_tokens} greedy tokens agree with hetero-jax")
    if ours != theirs:
        raise SystemExit(f"greedy tokens differ: hetero-jax {ours} vs transformers {theirs}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--model", metavar="DIR", help="a Hugging Face directory instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratios", type=parse_ratios, default="9:1,5:5,1:9")
    ap.add_argument("--requests", type=int_in("requests"), default=48)
    ap.add_argument("--min-gens", type=int_in("min_gens"), default=16,
                    help="as in hetero-jax bench (where it defaults to --clients): at least "
                    "this many generations per run")
    ap.add_argument("--embed-len", type=int_in("embed_len"), default=128)
    ap.add_argument("--prompt-len", type=int_in("prompt_len"), default=128)
    ap.add_argument("--output-len", type=int_in("output_len"), default=256)
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients, as in "
                    "hetero-jax bench; 0: offline, every request at the start")
    ap.add_argument("--gen-batch", type=int_in("max_num_seqs"), default=32)
    ap.add_argument("--embed-batch", type=int_in("max_num_seqs"), default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--export", metavar="DIR", help="write (and keep) the exported weights here")
    ap.add_argument("--check", action="store_true", help="compare greedy tokens first")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetero-jax-hf-") as tmp:
        model_dir = args.model or export_preset(args.preset, args.seed, args.export or tmp)
        model = load_model(model_dir, args.threads)
        if args.check:
            check_same_tokens(model, model_dir)
        wl = MixedWorkload(args.embed_len, args.prompt_len, args.output_len, args.seed)
        vocab = model.config.vocab_size
        lists = [(f"{e}:{g}", wl.requests((e, g), wl.run_size((e, g), args.requests,
                                                               args.min_gens), vocab))
                 for e, g in args.ratios]
        clients = args.clients or max(len(reqs) for _, reqs in lists)
        rows = hf_rows(model, lists, clients, args.gen_batch, args.embed_batch)
    print(format_table(rows, COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), results=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
