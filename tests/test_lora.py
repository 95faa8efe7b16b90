"""LoRA adapters against transformers with the adapter merged into its weights (W + scale·B·A)."""
import copy
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from hetero_jax.models import layers, llama
from hetero_jax.models.formats.hf_llama import load_hf_model
from hetero_jax.models.formats.peft import load_adapter
from hetero_jax.models.lora import lora_delta, merge_lora_layers, stack_adapters
from tests.hf_models import hf_logits
from tests.model_runs import forward_logits

MLP = ("gate_proj", "up_proj", "down_proj")


def _module(model, layer, name):
    block = model.model.layers[layer]
    return getattr(block.mlp if name in MLP else block.self_attn, name)


def write_adapter(path, model, rank, targets, *, alpha=16.0, rslora=False, seed=0, infix="",
                  num_layers=None, in_extra=0):
    """A PEFT LoRA directory with random A [r, in], B [out, r]; returns {(layer, module): (A, B)}.

    `num_layers` and `in_extra` make adapters that do not fit the model (error cases)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=rank, lora_alpha=alpha, use_rslora=rslora,
                       target_modules=targets, bias="none"), f)
    modules = (["q_proj", "k_proj", "v_proj", "o_proj", *MLP] if targets == "all-linear"
               else list(targets))
    weights, tensors = {}, {}
    for i in range(num_layers or len(model.model.layers)):
        for name in modules:
            out_dim, in_dim = _module(model, 0, name).weight.shape
            a = rng.normal(0, 0.2, (rank, in_dim + in_extra)).astype(np.float32)
            b = rng.normal(0, 0.2, (out_dim, rank)).astype(np.float32)
            part = "mlp" if name in MLP else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A{infix}.weight"], tensors[f"{key}.lora_B{infix}.weight"] = a, b
            weights[i, name] = (a, b)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return weights


def merged_model(model, weights, scale):
    merged = copy.deepcopy(model)
    with torch.no_grad():
        for (i, name), (a, b) in weights.items():
            _module(merged, i, name).weight += torch.from_numpy(scale * b @ a)
    return merged


def batch_logits(cfg, params, seqs, adapters, page_size=8):
    """Sequences as one ragged prefill step, sequence i on adapter id adapters[i]; -> [n_i, V]."""
    lens = [len(s) for s in seqs]
    pages = [-(-n // page_size) for n in lens]
    first = np.cumsum([1] + pages)  # page 0 is scratch
    page_indices = np.zeros((len(seqs), max(pages)), np.int32)
    for i, p in enumerate(pages):
        page_indices[i, :p] = np.arange(first[i], first[i] + p)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    slots = np.concatenate([page_indices[i, np.arange(n) // page_size] * page_size
                            + np.arange(n) % page_size for i, n in enumerate(lens)])
    ids = np.concatenate([np.full(n, a, np.int32) for n, a in zip(lens, adapters)])
    kv = llama.KVCache.zeros(cfg, int(first[-1]), page_size, params["embed"].dtype)
    meta = llama.AttnMeta(kv_lens=np.array(lens, np.int32), page_indices=page_indices,
                          cu_q_lens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                          num_seqs=np.int32(len(seqs)))
    logits = np.asarray(forward_logits(params, cfg, jnp.asarray(np.concatenate(seqs), jnp.int32),
                                       pos, slots.astype(np.int32), kv, meta, jnp.asarray(ids)))
    return np.split(logits, np.cumsum(lens)[:-1])


def rel_err(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.fixture(scope="module")
def base(hf_model):
    path, model = hf_model("llama3")
    cfg, params = load_hf_model(path)
    return cfg, params, model


def with_adapters(params, adapters, cfg):
    stacked = stack_adapters(adapters, cfg, jnp.float32)
    return dict(params, layers=merge_lora_layers(params["layers"], stacked))


def test_lora_delta_equals_per_token_matrices():
    """Hand reference: token t adds x_t @ a[id-1] @ b[id-1]; id 0 adds exactly zero."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 5), np.float32)
    a, b = rng.standard_normal((3, 5, 4), np.float32), rng.standard_normal((3, 4, 6), np.float32)
    ids = np.array([0, 1, 2, 3, 0, 3, 1], np.int32)
    got = np.asarray(lora_delta(x, a, b, ids))
    want = np.stack([np.zeros(6, np.float32) if k == 0 else x[t] @ a[k - 1] @ b[k - 1]
                     for t, k in enumerate(ids)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[ids == 0].any()


def test_adapter_equals_merged_weights_and_id0_equals_base(base, tmp_path):
    cfg, params, model = base
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    weights = write_adapter(tmp_path, model, 8, targets, alpha=16.0, infix=".default")
    adapter = load_adapter(str(tmp_path), cfg, jnp.float32)
    assert (adapter.rank, adapter.scale) == (8, 2.0)
    lp = with_adapters(params, [adapter], cfg)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    want_lora = hf_logits(merged_model(model, weights, 2.0), ids)
    want_base = hf_logits(model, ids)
    assert rel_err(want_base, want_lora) > 0.1, "the adapter should change the logits"
    (got_lora,), (got_base,) = batch_logits(cfg, lp, [ids], [1]), batch_logits(cfg, lp, [ids], [0])
    assert rel_err(got_lora, want_lora) < 1e-4, f"adapter: {rel_err(got_lora, want_lora):.2e}"
    assert rel_err(got_base, want_base) < 1e-4, f"base: {rel_err(got_base, want_base):.2e}"
    # the unrolled layer loop carries the adapters too
    (unrolled,) = batch_logits(cfg, layers.split_layers(lp), [ids], [1])
    np.testing.assert_allclose(unrolled, got_lora, rtol=1e-5, atol=1e-5)


def test_mixed_batch_equals_single_runs(base, tmp_path):
    """Adapter and base sequences share one step; each equals its own single-sequence run
    (fp32, up to matmul reduction order: max error / max |logit| < 1e-5)."""
    cfg, params, model = base
    write_adapter(tmp_path, model, 8, ["q_proj", "k_proj", "down_proj"], seed=3)
    lp = with_adapters(params, [load_adapter(str(tmp_path), cfg, jnp.float32)], cfg)
    rng = np.random.default_rng(2)
    # ragged, two lengths: the single runs compile two shapes, not four
    seqs = [rng.integers(0, cfg.vocab_size, n) for n in (13, 21, 13, 21)]
    mixed = batch_logits(cfg, lp, seqs, [1, 0, 0, 1])
    for seq, adapter, got in zip(seqs, [1, 0, 0, 1], mixed):
        (single,) = batch_logits(cfg, lp, [seq], [adapter])
        assert rel_err(got, single) < 1e-5, f"id {adapter}: {rel_err(got, single):.2e}"
    (no_lora,) = batch_logits(cfg, params, seqs[1:2], [0])
    assert rel_err(mixed[1], no_lora) < 1e-5, f"base: {rel_err(mixed[1], no_lora):.2e}"
    (base_only,) = batch_logits(cfg, lp, seqs[:1], [0])
    assert rel_err(mixed[0], base_only) > 0.01, "the adapter should change the logits"


def test_rslora_scale(base, tmp_path):
    cfg, params, model = base
    weights = write_adapter(tmp_path, model, 4, ["v_proj", "up_proj"], alpha=8.0, rslora=True)
    adapter = load_adapter(str(tmp_path), cfg, jnp.float32)
    assert adapter.scale == pytest.approx(8.0 / math.sqrt(4))
    ids = np.arange(3, 30)
    want = hf_logits(merged_model(model, weights, 4.0), ids)
    (got,) = batch_logits(cfg, with_adapters(params, [adapter], cfg), [ids], [1])
    assert rel_err(got, want) < 1e-4, f"rsLoRA: {rel_err(got, want):.2e}"


def test_two_adapters_of_different_ranks(base, tmp_path):
    """Rank 8 on five projections, rank 4 on all-linear, stacked; ids 1, 2, 0 in one step."""
    cfg, params, model = base
    w1 = write_adapter(tmp_path / "a", model, 8, ["q_proj", "v_proj", "o_proj", "gate_proj",
                                                   "down_proj"], alpha=16.0, seed=1)
    w2 = write_adapter(tmp_path / "b", model, 4, "all-linear", alpha=4.0, seed=2)
    adapters = [load_adapter(str(tmp_path / d), cfg, jnp.float32) for d in "ab"]
    stacked = stack_adapters(adapters, cfg, jnp.float32)
    assert stacked["lora_a_wq"].shape == (cfg.num_layers, 2, cfg.hidden_size, 8)
    assert stacked["lora_b_wk"].shape == (cfg.num_layers, 2, 8, cfg.num_kv_heads * cfg.head_dim)
    assert not stacked["lora_a_wk"][:, 0].any() and not stacked["lora_a_wq"][:, 1, :, 4:].any()
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 24)
    got = batch_logits(cfg, with_adapters(params, adapters, cfg), [ids, ids, ids], [1, 2, 0])
    wants = [hf_logits(merged_model(model, w1, 2.0), ids),
             hf_logits(merged_model(model, w2, 1.0), ids), hf_logits(model, ids)]
    for k, (g, w) in enumerate(zip(got, wants)):
        assert rel_err(g, w) < 1e-4, f"adapter id {(1, 2, 0)[k]}: {rel_err(g, w):.2e}"


def _drop(name):
    def mutate(path):
        os.remove(os.path.join(path, name))
    return mutate


def _drop_layer1(path):
    file = os.path.join(path, "adapter_model.safetensors")
    save_file({k: v for k, v in load_file(file).items() if ".layers.1." not in k}, file)


def _set_config(**kw):
    def mutate(path):
        file = os.path.join(path, "adapter_config.json")
        with open(file) as f:
            raw = json.load(f)
        with open(file, "w") as f:
            json.dump({**raw, **kw}, f)
    return mutate


@pytest.mark.parametrize("mutate, writer_kw, exc, match", [
    (_drop("adapter_config.json"), {}, FileNotFoundError, "adapter_config.json"),
    (_drop("adapter_model.safetensors"), {}, FileNotFoundError, "adapter_model.safetensors"),
    (_set_config(target_modules=["q_proj", "lm_head"]), {}, ValueError, "lm_head"),
    (_set_config(r=6), {}, ValueError, r"shape \(4, 64\).*expect \(6, 64\)"),
    (_set_config(r=32, target_modules=["k_proj"]), {}, ValueError, "r=32 exceeds"),
    (None, dict(in_extra=16), ValueError, r"shape \(4, 80\)"),
    (_drop_layer1, {}, ValueError, "layers.1.*missing"),
    (None, dict(num_layers=3), ValueError, "layer 2, the base model has 2 layers"),
    (_set_config(target_modules=["q_proj"]), {}, ValueError, "k_proj.*outside target_modules"),
    (_set_config(use_dora=True), {}, ValueError, "use_dora"),
])
def test_bad_adapters_raise(base, tmp_path, mutate, writer_kw, exc, match):
    cfg, _, model = base
    write_adapter(tmp_path, model, 4, ["k_proj"], **writer_kw)
    if mutate:
        mutate(tmp_path)
    with pytest.raises(exc, match=match):
        load_adapter(str(tmp_path), cfg, jnp.float32)


def test_missing_directory_raises(base, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_adapter(str(tmp_path / "nowhere"), base[0], jnp.float32)


def test_engine_embeds_on_adapter_and_generates_on_base(base, hf_model, tmp_path):
    """In one run, embeddings use the adapter (= transformers with it merged) while generation
    stays on the base weights (= an engine without adapters)."""
    from hetero_jax import (EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams,
                            SamplingParams)

    cfg, _, model = base
    path = hf_model("llama3")[0]
    weights = write_adapter(tmp_path / "lora", model, 8, ["q_proj", "v_proj", "down_proj"])
    ecfg = EngineConfig(token_budget=32, chunk_size=16, max_num_seqs=8, max_model_len=256,
                        token_buckets=(8, 32), page_buckets=(8, 32))
    engine = Engine.from_pretrained(path, config=ecfg, embed_adapter=str(tmp_path / "lora"))
    ids = np.random.default_rng(3).integers(3, 300, 40).tolist()
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    gen, emb = engine.run([GenerateRequest(ids[:12], greedy),
                           EmbedRequest(ids, PoolingParams("last", normalize=False))],
                          use_tqdm=False)
    with torch.no_grad():
        want = merged_model(model, weights, 16.0 / 8).model(torch.tensor([ids]))
    want = want.last_hidden_state[0, -1].numpy()
    assert rel_err(emb.embedding, want) < 1e-4
    plain = Engine.from_pretrained(path, config=ecfg).generate([ids[:12]], greedy, use_tqdm=False)
    assert gen.token_ids == plain[0].token_ids
    engine.save(str(tmp_path / "ckpt"))  # the base model only: adapters stay in their dirs
    restored = Engine.load(str(tmp_path / "ckpt"), config=ecfg)
    assert restored.generate([ids[:12]], greedy, use_tqdm=False)[0].token_ids == gen.token_ids
    with pytest.raises(ValueError, match="unknown adapter 'other'; loaded: \\['default'\\]"):
        engine.embed([ids], PoolingParams(adapter="other"), use_tqdm=False)
