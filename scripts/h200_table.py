"""Bytes the 8B-shaped decode step moves on an H200 against its floor, from a deviceless compile.

In: `--layers` (default 8), `--layer-loop` (default `scan,unrolled`) and `--cascade-rows` (0:
the step without the cascade tiles' launch, which the engine's default runs in every step). For
each layer loop the GPU engine's step (`runner/h200.py`: bf16, the Pallas kernel) of the
`llama-8b-shape` preset at that depth is compiled for the H200 at the decode variant (64, 64, 0,
128, 0) of EngineConfig(max_num_seqs=64, max_model_len=2048): 64 sequences of 2,048 cached
tokens (the new token included). Then the bf16 kernel alone (32 query heads on 8 KV heads, the
same decode batch) at head_dim 64 and 128, compiled with ptxas refusing register spills.

Out: markdown tables on stdout and, with `--json PATH`, the same rows as JSON. Per step: the
bytes of XLA's launches (`scripts/hlo_bytes.py` over the optimised HLO, custom calls apart),
the kernel's KV read (computed: every sequence's K and V read once per layer; the custom
call's operands are the whole cache), the floor (every weight but the embedding read once,
the batch's embedding rows, the KV read once, the new tokens' K and V written), their ratio,
the temporaries (`memory_analysis()`), the seconds to lower and compile, the 5 largest
launches. Per kernel: ptxas's verdict, registers and spills (XLA logs ptxas -v at
TF_CPP_VMODULE=subprocess_compilation=2, captured from fd 2).

Needs the `gpu-compile` extra. Sets JAX_PLATFORMS=cpu and the logging before jax is imported
(in `main`, so `--help` imports no jax). Minutes on a small CPU host (one compile at a time):

    JAX_PLATFORMS=cpu python scripts/h200_table.py --layers 8 --json out/h200_table.json
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time

import hlo_bytes  # scripts/ is sys.path[0] when this file runs as a script

KEY = (64, 64, 0, 128, 0)  # (T, S, Sc, pages_per_seq, second_pages): 64 decodes at 2,048 tokens
ENGINE = dict(max_num_seqs=64, max_model_len=2048, dtype="bfloat16")
KERNEL_HEADS = (32, 8)  # (Hq, Hkv)
_PTXAS = re.compile(
    r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\s*\n(?:ptxas info\s*: Used (\d+) registers)?")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--layer-loop", default="scan,unrolled",
                   help="comma-separated layer loops to compile (default: %(default)s)")
    p.add_argument("--head-dims", default="64,128",
                   help="head sizes of the kernel-alone compiles, '' for none "
                        "(default: %(default)s)")
    p.add_argument("--cascade-rows", type=int, default=8,
                   help="the engine's cascade_rows: 0 compiles the step without its cascade "
                   "tiles' launch (default: %(default)s, the engine's)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    return p.parse_args(argv)


def set_compile_env() -> None:
    """What must be set before jax starts: the CPU platform (the CUDA plugin would look for a
    GPU) and XLA's logging of ptxas -v."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
    os.environ.setdefault("TF_CPP_VMODULE", "subprocess_compilation=2")


@contextlib.contextmanager
def captured_stderr(sink: list):
    """Redirect fd 2 (XLA's C++ logging) to a file for the block; append its text to `sink`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


def ptxas_report(log: str) -> list:
    """[{kernel, registers, stack, spill_stores, spill_loads}] of each ptxas -v in `log`."""
    return [dict(kernel=name, registers=int(regs) if regs else None, stack=int(stack),
                 spill_stores=int(stores), spill_loads=int(loads))
            for name, stack, stores, loads, regs in _PTXAS.findall(log)]


def kv_bytes_per_token(model_cfg, itemsize: int) -> int:
    """K and V of one token over every layer."""
    return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize


def kernel_kv_read(model_cfg, cfg, key: tuple, itemsize: int) -> int:
    """Bytes the kernel reads from the cache: each of the S sequences' kv_len = pages x
    page_size tokens of K and V, once per layer."""
    kv_lens = [key[3] * cfg.page_size] * key[1]
    return sum(kv_lens) * kv_bytes_per_token(model_cfg, itemsize)


def floor_bytes(model_cfg, cfg, key: tuple, itemsize: int) -> dict:
    """The least a step of variant `key` must move: every weight but the embedding once, the
    T tokens' embedding rows, the KV read once, the T new tokens' K and V written."""
    from hetero_jax.models import llama
    shapes = llama.param_shapes(model_cfg)
    weights = [shape for name, shape in shapes.items() if name not in ("embed", "layers")]
    weights += list(shapes["layers"].values())
    parts = dict(weights=sum(math.prod(s) for s in weights) * itemsize,
                 embedding_rows=key[0] * model_cfg.hidden_size * itemsize,
                 kv_read=kernel_kv_read(model_cfg, cfg, key, itemsize),
                 kv_written=key[0] * kv_bytes_per_token(model_cfg, itemsize))
    return dict(parts, total=sum(parts.values()))


def step_row(model_cfg, layer_loop: str, cascade_rows: int) -> dict:
    """Compile the step at `KEY` with `layer_loop` for the H200; its bytes against the floor."""
    import jax.numpy as jnp
    from hetero_jax.config import EngineConfig
    from hetero_jax.runner import gpu_lowering, h200
    cfg = gpu_lowering.gpu_config(model_cfg, EngineConfig(layer_loop=layer_loop,
                                                          cascade_rows=cascade_rows, **ENGINE))
    assert KEY in cfg.variants(), f"{KEY=} is not a variant of {cfg.max_num_seqs=}"
    itemsize = jnp.dtype(cfg.dtype).itemsize
    logs: list = []
    start = time.perf_counter()
    with captured_stderr(logs):
        compiled = h200.compile_step(model_cfg, cfg, KEY)
    seconds = time.perf_counter() - start
    moved = hlo_bytes.bytes_moved(compiled.as_text())
    kernel = kernel_kv_read(model_cfg, cfg, KEY, itemsize)
    floor = floor_bytes(model_cfg, cfg, KEY, itemsize)
    triton = [c for c in moved.custom_calls if c.name.startswith("pallas_call")]
    return dict(
        layers=model_cfg.num_layers, layer_loop=layer_loop, key=list(KEY), dtype=cfg.dtype,
        xla_bytes=moved.total, kernel_kv_read=kernel, floor=floor,
        ratio=(moved.total + kernel) / floor["total"],
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        compile_s=round(seconds, 1), kernel_launches=sum(c.count for c in triton),
        cascade_rows=cascade_rows, xla_launches=sum(r.count for r in moved.launches),
        other_custom_calls=[dataclasses.asdict(c) for c in moved.custom_calls
                            if c not in triton],
        top=[dataclasses.asdict(r) for r in moved.launches[:5]])


def kernel_structs(head_dim: int, cfg) -> tuple:
    """Shape structs of the kernel's arguments for the decode batch at `KEY` on `cfg`'s
    cache (one layer of pages)."""
    import jax
    import jax.numpy as jnp
    (t, s, _, pages, _), (hq, hkv) = KEY, KERNEL_HEADS
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache = sds((cfg.num_pages, cfg.page_size, hkv, head_dim), bf16)
    return (sds((t, hq, head_dim), bf16), cache, cache, sds((s,), i32), sds((s, pages), i32),
            sds((s + 1,), i32), sds((), i32))


def kernel_row(head_dim: int, cfg) -> dict:
    """Compile the bf16 kernel alone with spills refused; ptxas's verdict and its numbers."""
    import jax
    from hetero_jax.ops.pallas_attention import ragged_paged_attention_pallas
    from hetero_jax.runner import h200
    logs: list = []
    start = time.perf_counter()
    try:
        with captured_stderr(logs):
            h200.compile_for_h200(ragged_paged_attention_pallas, *kernel_structs(head_dim, cfg),
                                  fail_on_spills=True)
        verdict = "compiles, no spills"
    except jax.errors.JaxRuntimeError as e:  # the refusal is the answer being measured
        verdict = f"refused: {str(e).splitlines()[0][:120]}"
    ptxas = [r for r in ptxas_report(logs[0]) if r["kernel"].startswith("ragged_paged")]
    return dict(head_dim=head_dim, heads=list(KERNEL_HEADS), dtype="bfloat16", verdict=verdict,
                compile_s=round(time.perf_counter() - start, 1), ptxas=ptxas)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def step_table(rows: list) -> str:
    """Markdown: one line per compiled step."""
    lines = ["| layers | loop | cascade rows | XLA GB | kernel KV GB | floor GB | ratio | "
             "temp MB | XLA launches | Pallas launches | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['layer_loop']} | {r['cascade_rows']} | "
              f"{_gb(r['xla_bytes'])} | {_gb(r['kernel_kv_read'])} | "
              f"{_gb(r['floor']['total'])} | {r['ratio']:.2f}x | {r['temp_bytes'] / 1e6:.1f} | "
              f"{r['xla_launches']} | {r['kernel_launches']} | {r['compile_s']} |"
              for r in rows]
    return "\n".join(lines)


def movers_table(rows: list) -> str:
    """Markdown: the 5 largest launches of each step (bytes over all executions)."""
    lines = ["| loop | launch | op | runs | MB | result |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['layer_loop']} | {m['name']} | {m['op']} | {m['count']} | "
              f"{m['bytes'] / 1e6:.1f} | {m['type'][:40]} |" for r in rows for m in r["top"]]
    return "\n".join(lines)


def kernel_table(rows: list) -> str:
    """Markdown: ptxas on the kernel alone, per head size (one line per Triton kernel)."""
    lines = ["| Hq/Hkv | D | verdict | kernel | registers | stack B | spill st/ld B |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in r["ptxas"] or [dict(kernel="(no ptxas log)", registers=None, stack=None,
                                     spill_stores=None, spill_loads=None)]:
            lines.append(f"| {r['heads'][0]}/{r['heads'][1]} | {r['head_dim']} | {r['verdict']} "
                         f"| {p['kernel']} | {p['registers']} | {p['stack']} | "
                         f"{p['spill_stores']}/{p['spill_loads']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_compile_env()
    from hetero_jax.config import EngineConfig
    from hetero_jax.models.presets import preset_config
    from hetero_jax.runner import gpu_lowering, h200
    assert h200.unavailable() is None, h200.unavailable()
    model_cfg = dataclasses.replace(preset_config("llama-8b-shape"), num_layers=args.layers)
    cfg = gpu_lowering.gpu_config(model_cfg, EngineConfig(**ENGINE))
    # kernels first: XLA may reuse a kernel's cubin within a process, and log no ptxas then
    kernels = [kernel_row(int(d), cfg) for d in filter(None, args.head_dims.split(","))]
    steps = [step_row(model_cfg, loop, args.cascade_rows)
             for loop in args.layer_loop.split(",")]
    print(step_table(steps), movers_table(steps), kernel_table(kernels), sep="\n\n", flush=True)
    result = dict(steps=steps, kernels=kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
