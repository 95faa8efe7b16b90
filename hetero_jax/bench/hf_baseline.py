"""What users would run instead: transformers on PyTorch CPU, on the same weights and requests.

In: a Hugging Face model directory (for a preset, `export_preset` writes one with
`models.formats.hf_llama.export_hf_model`: the preset's weights under Hugging Face names) and a list
of `EmbedRequest`/`GenerateRequest` from `bench.workloads.MixedWorkload`. Out: one bench row
(`scheduler="hf"`) per request list.

The usual way to serve transformers: static batches. The same closed-loop clients as the
bench's engines submit the same requests; each round takes every pending request and runs
its embeddings (`embed_batch` inputs per forward of the base model, mean of
`last_hidden_state` over the attention mask, L2-normalised), then its generations
(`gen_batch` prompts per greedy `generate` with exactly `max_tokens` new tokens, as the
engine's `ignore_eos=True`). A request submitted during a round waits for the next one (no
continuous batching). With as many clients as requests it is an offline batch run, the
baseline's best case. torch is imported here only; the engine never imports it.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import time

from hetero_jax.bench.loop import EMBED, GEN, Record, summarize
from hetero_jax.requests import EmbedRequest


def export_preset(name: str, seed: int, path: str) -> str:
    """Write the preset's weights (`Engine.from_preset(name, seed)`) as a Hugging Face Llama
    directory at `path`; returns it."""
    from hetero_jax.models import llama
    from hetero_jax.models.formats.hf_llama import export_hf_model
    from hetero_jax.models.presets import preset_config

    cfg = preset_config(name)
    export_hf_model(path, cfg, llama.init_params(cfg, seed))
    return path


def _torch():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValueError(f"the transformers baseline needs torch and transformers ({e}); "
                         "pip install torch transformers") from None
    return torch, transformers


def load_model(model_dir: str, threads: int | None = None):
    torch, transformers = _torch()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _padded(rows: list, pad: int, left: bool):
    """Token lists -> (ids [B, L], mask [B, L]) padded on the left or right."""
    torch, _ = _torch()
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


def embed_batch(model, inputs: list):
    """Token lists -> [B, d] L2-normalised mean of the last hidden state (float32 numpy)."""
    torch, _ = _torch()
    ids, mask = _padded(inputs, 0, left=False)
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, d]
        m = mask[..., None].to(hidden.dtype)
        mean = (hidden * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(mean, dim=-1).numpy()


def generate_batch(model, prompts: list, max_tokens: int) -> list:
    """Token lists -> greedy continuations of exactly `max_tokens` tokens each."""
    torch, _ = _torch()
    ids, mask = _padded(prompts, 0, left=True)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def warmup(model, requests: list) -> None:
    """One small embedding and generation batch, so that one-time setup is not timed."""
    embeds = [r.input for r in requests if isinstance(r, EmbedRequest)][:2]
    prompts = [r.prompt for r in requests if not isinstance(r, EmbedRequest)][:2]
    if embeds:
        embed_batch(model, embeds)
    if prompts:
        generate_batch(model, prompts, 2)


def run_hf(model, requests: list, clients: int, gen_batch: int = 32,
           embed_batch_size: int = 32, on_done=None) -> dict:
    """Serve `requests` with `clients` closed-loop clients over static rounds; -> a bench row.

    A round takes every pending request: its embeddings (batches of `embed_batch_size`),
    then its generations (batches of `gen_batch`). A client whose request finishes submits
    its next one, which waits for the next round. `clients >= len(requests)`: offline.
    """
    todo = iter(requests)
    start = time.perf_counter()
    pending = [(r, start) for r in itertools.islice(todo, clients)]  # (request, submit time)
    records = []
    while pending:
        embeds = [p for p in pending if isinstance(p[0], EmbedRequest)]
        gens = [p for p in pending if not isinstance(p[0], EmbedRequest)]
        pending = []
        for batches, run in ((_chunks(embeds, embed_batch_size), _run_embeds),
                             (_chunks(gens, gen_batch), _run_gens)):
            for batch in batches:
                outs = run(model, [r for r, _ in batch])
                now = time.perf_counter()
                for (r, submit), n_out in zip(batch, outs):
                    if isinstance(r, EmbedRequest):
                        records.append(Record(EMBED, submit, now, None, len(r.input), embeds=1))
                    else:
                        records.append(Record(GEN, submit, now, None, len(r.prompt), n_out,
                                              gens=1))
                    nxt = next(todo, None)  # this client's next request, for the next round
                    if nxt is not None:
                        pending.append((nxt, now))
                if on_done:
                    on_done(len(batch))
    row = summarize(records, dict(steps=0, scheduled_tokens=0, compiles=0, compile_stall_s=0.0),
                    1)
    return dict(row, scheduler="hf", budget_fill=None, steps=None, compiles=None,
                compile_s=None, gen_batch=gen_batch, embed_batch=embed_batch_size)


def _chunks(items: list, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _run_embeds(model, reqs: list) -> list:
    embed_batch(model, [r.input for r in reqs])
    return [0] * len(reqs)


def _run_gens(model, reqs: list) -> list:
    n = max(r.params.max_tokens for r in reqs)
    return [len(t) for t in generate_batch(model, [r.prompt for r in reqs], n)]


def hf_rows(model, lists: list, clients: int, gen_batch: int, embed_batch_size: int,
            on_done=None) -> list:
    """One `run_hf` row per `(label, requests)` of `lists`, each after an untimed warm-up."""
    rows = []
    for label, reqs in lists:
        warmup(model, reqs)
        row = run_hf(model, reqs, clients, gen_batch, embed_batch_size, on_done)
        rows.append(dict(row, ratio=label))
    return rows


def run_hf_rows(cfg, lists: list) -> list:
    """The bench's `--baseline hf` (`cfg`: its `BenchConfig`): the engines' request lists, one
    row per ratio. A preset is exported to a temporary Hugging Face directory first."""
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="hetero-jax-hf-") as tmp:
        model = load_model(cfg.model or export_preset(cfg.preset, cfg.seed, tmp))
        bar = tqdm(total=sum(len(reqs) for _, reqs in lists), unit="req", desc="transformers",
                   disable=cfg.no_progress)
        rows = hf_rows(model, lists, cfg.clients, cfg.max_num_seqs, cfg.max_num_seqs,
                       bar.update)
        bar.close()
    return rows
