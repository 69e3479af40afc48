"""Chat-template tokenisation with an assistant-only loss mask, prompts for generation, stop tokens."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

# Templates for targets whose tokenizer ships none (selected by `base_model.chat_template`).
BUILTIN_TEMPLATES: dict[str, str] = {
    # FastChat's vicuna_v1.1 conversation format (lmsys/vicuna-*-v1.3/v1.5).
    "vicuna": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}{% set rest = messages[1:] %}"
        '{% else %}{{ "A chat between a curious user and an artificial intelligence assistant. The assistant gives '
        "helpful, detailed, and polite answers to the user's questions. \" }}{% set rest = messages %}{% endif %}"
        "{% for m in rest %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
        "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    ),
}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool
) -> str:
    """The chat template applied to `messages`, as text."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return str(text)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` + the assistant header, ready for generation."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_length: int | None = None
) -> dict[str, list[int]]:
    """Tokenise a conversation with the chat template and mark the assistant tokens.

    The mask covers each assistant turn's content and its end-of-turn marker (not the role header, not
    template text after the marker), so a model trained on it learns what the assistant says. The template must be prefix-stable (rendering
    messages[:i] is a prefix of rendering messages[:i+1]), which holds for common chat templates.

    Args:
        tokenizer: a fast tokenizer with a chat template.
        messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
        max_length: truncate to this many tokens (None: no truncation).

    Returns:
        {"input_ids": (L,) ids, "loss_mask": (L,) 1 on assistant tokens else 0}.
    """
    spans: list[tuple[int, int]] = []  # char spans of assistant content + end of turn
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:i], add_generation_prompt=True)
        full = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full.startswith(head):
            raise ValueError(
                "chat template is not prefix-stable: rendering the conversation up to an assistant turn is not "
                "a prefix of rendering it with that turn; set base_model.chat_template to a template that is"
            )
        spans.append((len(head), _turn_end(tokenizer, full, len(head), msg["content"])))
    text = render(tokenizer, messages, add_generation_prompt=False)
    enc: Any = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and start >= spans[j][0] and end <= spans[j][1] and end > start:
            mask[t] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


def _turn_end(tokenizer: PreTrainedTokenizerBase, full: str, start: int, content: str) -> int:
    """Char offset just past the assistant turn's end-of-turn marker (template text after it is not trained)."""
    if not full.startswith(content, start):
        return len(full)
    after = start + len(content)
    ends = [
        full.find(t, after) + len(t)
        for t in {tokenizer.eos_token, *END_OF_TURN_TOKENS}
        if t and t in full[after:]
    ]
    return min(ends) if ends else len(full)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS plus the end-of-turn tokens the tokenizer knows (`<|im_end|>`, `<|eot_id|>`, ...)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)
