"""Tiny random Hugging Face models saved to a directory: the references of the tests."""
import numpy as np
import torch
import transformers

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
              eos_token_id=2)

CONFIGS = {
    # llama3 rope scaling, GQA 4:1, head_dim that is not hidden/heads
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
}


def save_model(name: str, path: str, seed: int = 0):
    """Random-init the named tiny model, save it (safetensors + config) and return it."""
    config_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).float().eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids) -> np.ndarray:
    """[n] token ids -> [n, V] float32 logits of the full sequence."""
    with torch.no_grad():
        return model(torch.tensor([[int(i) for i in ids]])).logits[0].float().numpy()


def save_byte_tokenizer(path: str, chat_template: str | None = None):
    """A byte-level tokenizer (ids 0-2 `<unk>`, `<s>`, `</s>`, then one id per byte, no
    merges) saved to `path` as transformers saves one; -> the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast
