"""Tiny offline models and tokenizers for tests and examples (no network, builds in milliseconds)."""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (printable ASCII + ChatML specials, vocab < 110) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # type: ignore[assignment]
    tk.decoder = decoders.Fuse()  # type: ignore[assignment]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_llama(
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> LlamaForCausalLM:
    """A randomly initialised GQA Llama in eval mode with grads off (deterministic for a given seed)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).to(dtype)  # type: ignore[arg-type]  # transformers' `@wraps(nn.Module.to)` stub
    # Random init gives near-uniform logits; sharpen them so greedy paths are not all near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval()
    model.requires_grad_(False)
    return model
