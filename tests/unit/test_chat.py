"""Chat-template tokenisation: the loss mask covers exactly the assistant turns."""

from __future__ import annotations

from specdraft.data.chat import prompt_ids, stop_token_ids, tokenize_conversation

MSGS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Yo!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_ids_match_apply_chat_template(tiny_tokenizer) -> None:
    enc = tokenize_conversation(tiny_tokenizer, MSGS)
    assert enc["input_ids"] == list(tiny_tokenizer.apply_chat_template(MSGS, tokenize=True)["input_ids"])


def test_assistant_only_mask(tiny_tokenizer) -> None:
    enc = tokenize_conversation(tiny_tokenizer, MSGS)
    masked = "".join(tiny_tokenizer.decode([i]) for i, m in zip(enc["input_ids"], enc["loss_mask"]) if m)
    assert masked == "Yo!<|im_end|>4<|im_end|>"  # not the template's newline after the marker
    unmasked = tiny_tokenizer.decode([i for i, m in zip(enc["input_ids"], enc["loss_mask"]) if not m])
    assert "Hi" in unmasked and "2+2?" in unmasked and "Yo!" not in unmasked


def test_truncation(tiny_tokenizer) -> None:
    full = tokenize_conversation(tiny_tokenizer, MSGS)
    cut = tokenize_conversation(tiny_tokenizer, MSGS, max_length=10)
    assert cut["input_ids"] == full["input_ids"][:10] and cut["loss_mask"] == full["loss_mask"][:10]


def test_prompt_ids_end_with_assistant_header(tiny_tokenizer) -> None:
    ids = prompt_ids(tiny_tokenizer, MSGS[:1])
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    full = tokenize_conversation(tiny_tokenizer, MSGS[:2])["input_ids"]
    assert full[: len(ids)] == ids  # the prompt is a prefix of the rendered conversation


def test_stop_tokens(tiny_tokenizer) -> None:
    stops = stop_token_ids(tiny_tokenizer)
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
