"""A digest of the optimised CPU HLO of engine steps, to tell whether a change moved the CPU path.

Compiles the given step variants of a preset on this host's CPU and prints, per variant, the
number of HLO lines and a digest of the text with source locations and numeric name suffixes
removed. Two checkouts that print the same digests run the same CPU code, so their step times
can only differ by noise:

    PYTHONPATH=/path/to/old python scripts/cpu_hlo_digest.py --preset small
    PYTHONPATH=/path/to/new python scripts/cpu_hlo_digest.py --preset small
"""
from __future__ import annotations

import argparse
import hashlib
import re

import jax

from hetero_jax import Engine, EngineConfig
from hetero_jax.runner.wire import wire_spec

_LOCATIONS = re.compile(r"file_name_id|file_location_id|function_name_id|^\d+ \"")


def normalised_hlo(runner, key: tuple) -> str:
    """The optimised HLO text of variant `key` without metadata, source locations or the
    numeric suffixes XLA gives names."""
    fn = jax.jit(runner.step_fn(key), donate_argnums=(1,))
    text = fn.lower(runner.params, runner.state, *wire_spec(runner.spec(key))).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}|, stack_frame_id=\d+", "", text)
    lines = [line for line in text.splitlines() if not _LOCATIONS.search(line)]
    return re.sub(r"\.\d+", "", "\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="embedded model (default: %(default)s)")
    p.add_argument("--variants", default="16,16,0,32,0;256,32,4,32,8;32,32,0,8,8",
                   help="variant keys T,S,Sc,pages,second separated by ';' (default: a decode, "
                        "a mixed and a cascade step)")
    args = p.parse_args()
    runner = Engine.from_preset(args.preset, config=EngineConfig(compile_cache=None)).runner
    for spec in args.variants.split(";"):
        key = tuple(int(x) for x in spec.split(","))
        text = normalised_hlo(runner, key)
        print(key, len(text.splitlines()), "lines", hashlib.sha256(text.encode()).hexdigest()[:16])


if __name__ == "__main__":
    main()
