"""What vLLM's penalties cost a decode step: step time with them off and on, and compiles.

    PYTHONPATH=$PWD python scripts/sampler_overhead.py [--preset tiny] [--rounds 5]

Runs the same greedy batch (`--prompts` prompts, `--tokens` tokens each) in interleaved rounds
with the penalties off and on (`--modes off` alone runs on a checkout without them, for a
before/after comparison), after two warm-up runs of each (the second hits the prefix cache,
as the timed ones do), and prints the median step time of
each mode (the engine's own step time: compiling left out) and the executables each mode's
timed runs built (0: the penalties compile nothing new).
"""
from __future__ import annotations

import argparse
import statistics


def _params(mode: str, tokens: int):
    from hetero_jax import SamplingParams

    knobs = dict(presence_penalty=0.5, frequency_penalty=0.3,
                 repetition_penalty=1.3) if mode == "on" else {}
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **knobs)


def _step_ms(engine, prompts: list, params) -> tuple[float, int]:
    """One run -> (its mean step time in ms, executables it built)."""
    s = engine.stats
    steps, seconds, compiles = s.steps, s.step_time_s, s.compiles
    engine.generate(prompts, params, use_tqdm=False)
    s = engine.stats
    return 1e3 * (s.step_time_s - seconds) / (s.steps - steps), s.compiles - compiles


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="embedded model (default: tiny)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per run (default: 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each (default: 64)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--modes", default="off,on", help="penalties off/on (default: off,on)")
    args = parser.parse_args(argv)
    from hetero_jax import Engine, EngineConfig

    engine = Engine.from_preset(args.preset, config=EngineConfig(max_model_len=512))
    prompts = [f"prompt {i}: the cat sat on the mat" for i in range(args.prompts)]
    modes = args.modes.split(",")
    for mode in modes * 2:  # warm-up: every variant built, prefix-cache hits included
        _step_ms(engine, prompts, _params(mode, args.tokens))
    times, built = {m: [] for m in modes}, dict.fromkeys(modes, 0)
    for _ in range(args.rounds):
        for mode in modes:
            ms, n = _step_ms(engine, prompts, _params(mode, args.tokens))
            times[mode].append(ms)
            built[mode] += n
    for mode in modes:
        print(f"penalties {mode}: median step {statistics.median(times[mode]):.2f} ms over "
              f"{args.rounds} rounds ({', '.join(f'{t:.2f}' for t in times[mode])}); "
              f"executables built in timed rounds: {built[mode]}")


if __name__ == "__main__":
    main()
