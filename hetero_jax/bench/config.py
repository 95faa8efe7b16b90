"""The flags of `hetero-jax bench` and the frozen `BenchConfig` they resolve to.

In: argv. Out: a `BenchConfig` (`parse_config`): every setting of the run, with the ones that
depend on other flags or on the model resolved once (`vocab_size`, `max_model_len`,
`warmup`, `min_gens`), or a `parser.error` (exit status 2) that names the value and the limit.
Every path the run will write (`--json`, `--plot`, `--compile-cache`) is checked here, before
any engine is built: a run must not fail at its end on a path it could have checked first.
The request lists and the Iter-RetGen corpus are not part of it: they are built from it
where they are needed (`cli.workload_items`), deterministic in the seed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from hetero_jax.models.presets import PRESETS
from hetero_jax.config import size_relation
from hetero_jax.sched.bandit import DEFAULT_ARMS, make_arms
from hetero_jax.sched.batching import BATCHING
from hetero_jax.sched.policies import COST_AWARE_IBS
from hetero_jax.sim.options import DefaultsHelpFormatter, compile_cache_dir, int_range, \
    name_list, on_off, output_file, real_range

SCHEDULERS = ("ibs", "fcfs", "homogeneous", "dedicated")  # the default contenders
BATCHINGS = BATCHING + ("each-arm",)  # each-arm: feather with every --arms arm fixed, one row each
LIMITS = dict(clients=(1, 1024), requests=(1, 100_000), min_gens=(0, 100_000), repeats=(1, 20),
              embed_len=(1, 8192), prompt_len=(1, 8192), output_len=(1, 8192), iterations=(1, 10),
              token_budget=(16, 8192), chunk_size=(1, 8192), max_num_seqs=(1, 1024),
              max_chunk_seqs=(1, 64), warmup=(0, 10_000), seed=(0, 2**32 - 1), groups=(1, 10_000),
              prompts_per_group=(1, 10_000), prefix_len=(0, 8192), suffix_len=(1, 8192),
              instruction_len=(0, 8192), chunk_pages=(1, 1024), tensor_parallel=(1, 1024))
QUICK = dict(preset="tiny", clients=4, requests=8, min_gens=2, embed_len=16, prompt_len=16, output_len=16,
             warmup=0, token_budget=16, chunk_size=16, max_num_seqs=8, max_chunk_seqs=1)


def int_in(name: str):
    """An argparse type: an integer within `LIMITS[name]`."""
    return int_range(*LIMITS[name])


def parse_ratios(text: str) -> list:
    """'9:1,5:5' -> [(9, 1), (5, 5)]: embed:gen weights, integers >= 0, not both 0."""
    out = []
    for part in text.split(","):
        try:
            e, g = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad ratio {part!r}: expected EMBED:GEN integers like 9:1") from None
        if e < 0 or g < 0 or e + g == 0 or e + g > 1000:
            raise argparse.ArgumentTypeError(
                f"bad ratio {part!r}: weights must be >= 0 with a sum in [1, 1000]")
        out.append((e, g))
    return out


def parse_arms(text: str) -> tuple:
    """'0:8,2:16,any:max' -> bandit arms ((0, 8), (2, 16), (None, None))."""
    pairs = []
    for part in text.split(","):
        try:
            loss, cap = part.split(":")
            pairs.append(tuple(None if x in ("any", "max") else int(x) for x in (loss, cap)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad arm {part!r}: expected LOSS:CAP like 0:8, 2:16 or any:max") from None
    try:
        return make_arms(pairs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-jax bench", formatter_class=DefaultsHelpFormatter,
                                description="Every scheduler on the "
                                "same closed-loop workload, side by side.")
    p.add_argument("--preset", default="small", choices=list(PRESETS),
                   help="embedded model (random weights, no download)")
    p.add_argument("--model", metavar="PATH", help="local Hugging Face directory (overrides "
                   "--preset)")
    p.add_argument("--workload", default="mixed", choices=["mixed", "iter-retgen",
                                                           "shared-prefix"],
                   help="mixed: embeddings and generations at --ratios; iter-retgen: "
                   "retrieve-generate rounds; shared-prefix: --groups of prompts sharing a prefix")
    p.add_argument("--ratios", type=parse_ratios, default="9:1,5:5,1:9",
                   help="embed:gen request ratios (mixed workload)")
    p.add_argument("--schedulers", type=name_list(SCHEDULERS + (COST_AWARE_IBS,), "scheduler"),
                   default=",".join(SCHEDULERS), help="contenders, each with the engine's "
                   "defaults (ibs is cost-aware where the engine knows its model's step cost: "
                   f"the small preset on a CPU, any model on an A100 or H200); {COST_AWARE_IBS} "
                   "(not in the default) is ibs with --cost-model, splitting a mixed step when "
                   "two cost less")
    p.add_argument("--cost-model", metavar="SPEC", help=f"the {COST_AWARE_IBS} contender's "
                   "step-cost model: a cost model JSON (scripts/calibrate.py) or roofline:<hw>")
    p.add_argument("--batching", type=name_list(BATCHINGS, "batching policy"), default="fcfs",
                   help="batch-forming policies, each with every scheduler (rows "
                   f"'<scheduler>+<batching>'): {','.join(BATCHINGS)}")
    arms = ",".join(f"{'any' if a.loss_limit is None else a.loss_limit}:"
                    f"{'max' if a.cap is None else a.cap}" for a in DEFAULT_ARMS)
    p.add_argument("--arms", type=parse_arms, default=arms,
                   help="feather-bandit's arms (and each-arm's rows), LOSS:CAP in chunks and "
                   f"running requests, any/max for no limit (default {arms})")
    p.add_argument("--chunk-pages", type=int_in("chunk_pages"), default=4,
                   help="feather: KV pages per chunk of the hash tree")
    p.add_argument("--cascade", type=on_off, default="on",
                   help="cascade attention on, off or on,off (off rows '<name>/plain')")
    p.add_argument("--clients", type=int_in("clients"), default=16,
                   help="closed-loop clients (concurrent requests or questions)")
    p.add_argument("--requests", type=int_in("requests"), default=48,
                   help="requests per scheduler and ratio (iter-retgen: questions)")
    p.add_argument("--min-gens", type=int_in("min_gens"), default=None,
                   help="raise a ratio's request count until its run holds this many "
                   "generations (default: --clients; 9:1 then runs 160 requests)")
    p.add_argument("--repeats", type=int_in("repeats"), default=1,
                   help="timed runs per scheduler and ratio, interleaved rounds over the "
                   "schedulers in a rotating order; each row is the run with the median "
                   "requests/s, with the bootstrap interval over the rounds")
    p.add_argument("--aa", action="store_true",
                   help="A/A: run the first contender twice under two names (the second "
                   "with a '), so the report shows the bench's own noise")
    p.add_argument("--slice-s", type=real_range(0, 60, open_lo=True), default=None,
                   help="serve a round's contenders at once, their engines stepping in turns "
                   "of about this many seconds, each timed on its own clock (bench.timeshare): "
                   "a slow spell of the machine falls on all of them alike (default: whole "
                   "runs, one after another)")
    p.add_argument("--embed-len", type=int_in("embed_len"), default=128,
                   help="tokens per embedding input")
    p.add_argument("--prompt-len", type=int_in("prompt_len"), default=128,
                   help="prompt tokens per generation request")
    p.add_argument("--output-len", type=int_in("output_len"), default=256,
                   help="generated tokens per generation request (default 256)")
    quick = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help="a smoke run, well under a minute: "
                   f"the defaults become {quick} (flags given still win)")
    p.add_argument("--iterations", type=int_in("iterations"), default=2,
                   help="iter-retgen: retrieve-generate rounds per question")
    p.add_argument("--scale", type=real_range(0, 1, open_lo=True), default=0.05,
                   help="iter-retgen: fraction of the Iter-RetGen paper's lengths (prompts of "
                   "500 tokens and 3000 generated tokens on average)")
    p.add_argument("--instruction-len", type=int_in("instruction_len"), default=0,
                   help="iter-retgen: a shared instruction of this many tokens starts every "
                   "query and prompt")
    p.add_argument("--groups", type=int_in("groups"), default=8,
                   help="shared-prefix: groups of requests that share a prefix")
    p.add_argument("--prompts-per-group", type=int_in("prompts_per_group"), default=16,
                   help="shared-prefix: requests per group")
    p.add_argument("--prefix-len", type=int_in("prefix_len"), default=512,
                   help="shared-prefix: tokens of the prefix a group shares")
    p.add_argument("--suffix-len", type=int_in("suffix_len"), default=32,
                   help="shared-prefix: tokens of each request's own suffix")
    p.add_argument("--control", action="store_true", help="shared-prefix: also run the same "
                   "lengths with nothing shared")
    p.add_argument("--prefix-caching", type=on_off, default="on",
                   help="on, off or on,off (side by side: each scheduler twice)")
    p.add_argument("--token-budget", type=int_in("token_budget"), default=256,
                   help="tokens per engine step")
    p.add_argument("--chunk-size", type=int_in("chunk_size"), default=64,
                   help="prompt tokens per chunk (at most --token-budget)")
    p.add_argument("--max-num-seqs", type=int_in("max_num_seqs"), default=32,
                   help="sequences per engine step")
    p.add_argument("--max-chunk-seqs", type=int_in("max_chunk_seqs"), default=4,
                   help="prompt chunks per engine step (at most --max-num-seqs)")
    p.add_argument("--tensor-parallel", type=int_in("tensor_parallel"), default=1, metavar="N",
                   help="split every engine's decoder over N devices (EngineConfig("
                   "tensor_parallel=N)); not with the dedicated contender")
    p.add_argument("--warmup", type=int_in("warmup"), default=None,
                   help="warm-up requests per engine before measuring (default: --clients)")
    p.add_argument("--baseline", choices=["hf"], help="also run transformers on PyTorch CPU "
                   "on the same weights and requests (mixed workload)")
    p.add_argument("--seed", type=int_in("seed"), default=0,
                   help="weights (preset), request lengths and sampling")
    p.add_argument("--compile-cache", type=compile_cache_dir, default="auto", metavar="DIR",
                   help="persistent XLA compilation cache: 'auto' ($XDG_CACHE_HOME or "
                   "~/.cache, /hetero-jax/xla), a directory, or 'none'")
    p.add_argument("--json", type=output_file, metavar="PATH",
                   help="write {config, results} here")
    p.add_argument("--plot", type=output_file, metavar="PATH", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Every setting of a bench run: the flags (same names), with defaults that depend on other
    flags resolved, and what the model fixes (`vocab_size`, `max_model_len`)."""

    preset: str
    model: str | None  # a Hugging Face directory, or None for the preset
    workload: str  # "mixed" | "iter-retgen" | "shared-prefix"
    ratios: tuple  # ((embed, gen) weights, ...)
    schedulers: tuple
    cost_model: str | None  # EngineConfig.cost_model of the ibs-cost contender
    clients: int
    requests: int
    min_gens: int
    repeats: int
    aa: bool  # the first contender twice, as two names
    slice_s: float | None  # a round's contenders at once, in turns of this many seconds
    embed_len: int
    prompt_len: int
    output_len: int
    quick: bool
    iterations: int
    scale: float
    instruction_len: int
    groups: int
    prompts_per_group: int
    prefix_len: int
    suffix_len: int
    control: bool
    prefix_caching: tuple  # (True,), (False,) or both: every scheduler with each
    batching: tuple  # batch-forming policies: every scheduler with each
    arms: tuple  # sched.bandit.Arm: feather-bandit's, and each-arm's rows
    chunk_pages: int
    cascade: tuple  # (True,), (False,) or both
    token_budget: int
    chunk_size: int
    max_num_seqs: int
    max_chunk_seqs: int
    tensor_parallel: int  # EngineConfig.tensor_parallel of every contender
    warmup: int
    baseline: str | None
    seed: int
    compile_cache: str | None  # EngineConfig.compile_cache
    json: str | None
    plot: str | None
    no_progress: bool
    vocab_size: int  # the model's
    max_model_len: int  # positions the longest request needs, rounded up to 64

    @classmethod
    def from_args(cls, parser, args) -> "BenchConfig":
        """Resolve parsed flags; limits that depend on several flags or on the model go to
        `parser.error`, which names them."""
        from hetero_jax.bench.workloads import synthetic_iter_retgen  # imports jax
        from hetero_jax.models.config import model_config_from_hf, read_hf_config
        from hetero_jax.models.presets import preset_config

        if args.model and not os.path.isdir(args.model):
            parser.error(f"argument --model: {args.model!r} is not a directory")
        model_cfg = (model_config_from_hf(read_hf_config(args.model)) if args.model
                     else preset_config(args.preset))
        model_max = model_cfg.max_position_embeddings
        need = max(args.embed_len, args.prompt_len + args.output_len)
        if args.workload == "shared-prefix":
            need = args.prefix_len + args.suffix_len + args.output_len
        if args.workload == "iter-retgen":
            _, plans = synthetic_iter_retgen(args.requests, args.scale, args.seed,
                                             instruction_len=args.instruction_len)
            need = max(p.prompt_budget + p.max_tokens for p in plans) + 1
            if args.baseline:
                parser.error("--baseline hf runs the mixed workload only")
        if need > model_max:
            parser.error(f"the requests need {need} positions; the model has "
                         f"max_position_embeddings={model_max}")
        if (COST_AWARE_IBS in args.schedulers) != (args.cost_model is not None):
            parser.error(f"--schedulers {COST_AWARE_IBS} and --cost-model go together (got "
                         f"--schedulers {','.join(args.schedulers)}, --cost-model "
                         f"{args.cost_model})")
        if args.cost_model and not (args.cost_model.startswith("roofline:")
                                    or os.path.isfile(args.cost_model)):
            parser.error(f"argument --cost-model: {args.cost_model!r} is not a file or "
                         "roofline:<hardware>")
        if args.tensor_parallel > 1:
            _check_tensor_parallel(parser, args, model_cfg)
        if args.slice_s and "dedicated" in args.schedulers:
            parser.error(f"argument --slice-s: --slice-s {args.slice_s:g} with the dedicated "
                         "contender cannot share turns (it steps in its own processes); drop it "
                         "from --schedulers")
        relation = size_relation(args.token_budget, args.chunk_size, args.max_num_seqs,
                                 args.max_chunk_seqs)
        if relation:
            parser.error(f"argument --{relation[0].replace('_', '-')}: {relation[1]}")
        return cls(**dict(
            vars(args), ratios=tuple(args.ratios), schedulers=tuple(args.schedulers),
            batching=tuple(args.batching),
            warmup=args.clients if args.warmup is None else args.warmup,
            min_gens=args.clients if args.min_gens is None else args.min_gens,
            vocab_size=model_cfg.vocab_size, max_model_len=-(-need // 64) * 64))

    def run_size(self, ratio: tuple) -> int:
        """Requests in a run at `ratio`."""
        from hetero_jax.bench.workloads import MixedWorkload

        if self.workload == "shared-prefix":
            return self.groups * self.prompts_per_group
        return MixedWorkload.run_size(ratio, self.requests, self.min_gens)

    def engine_config(self):
        """The `EngineConfig` every contender shares (each sets its own scheduler)."""
        from hetero_jax.config import EngineConfig

        from hetero_jax.sched import FeatherConfig

        return EngineConfig(token_budget=self.token_budget, chunk_size=self.chunk_size,
                            max_num_seqs=self.max_num_seqs, max_chunk_seqs=self.max_chunk_seqs,
                            max_model_len=self.max_model_len, seed=self.seed,
                            compile_cache=self.compile_cache, tensor_parallel=self.tensor_parallel,
                            feather=FeatherConfig(chunk_pages=self.chunk_pages, arms=self.arms))


def _check_tensor_parallel(parser, args, model_cfg) -> None:
    """--tensor-parallel N > 1 against the contenders, the model and the devices jax sees."""
    import jax

    from hetero_jax.runner.sharding import check_tensor_parallel

    n = args.tensor_parallel
    if "dedicated" in args.schedulers:
        parser.error(f"argument --tensor-parallel: --tensor-parallel {n} with the dedicated "
                     "contender is not built (its two processes would split over the same "
                     "devices); drop it from --schedulers")
    try:
        check_tensor_parallel(model_cfg, n, len(jax.devices()))
    except ValueError as e:
        parser.error(f"argument --tensor-parallel: {e}")


def parse_config(argv=None) -> BenchConfig:
    """argv -> BenchConfig; `--quick` swaps in `QUICK` defaults (flags given still win)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return BenchConfig.from_args(parser, args)
