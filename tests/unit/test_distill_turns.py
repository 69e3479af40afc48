"""Multi-turn self-distillation (distill/turns.py): turn k is generated after the model's own turns < k."""

from __future__ import annotations

import torch

from specdraft.data.chat import prompt_ids, tokenize_conversation
from specdraft.data.conversations import Conversation
from specdraft.distill.continuations import greedy_continuations, positions_to_compute
from specdraft.distill.generate import Generation, GenerationSettings, generate_batched
from specdraft.distill.turns import build_rows, mask_unowned_tokens, regenerate
from specdraft.testing import tiny_llama, tiny_tokenizer

CONVS = [
    Conversation("a", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ORIGINAL-1"},
                       {"role": "user", "content": "and?"}, {"role": "assistant", "content": "ORIGINAL-2"},
                       {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ORIGINAL-3"}]),
    Conversation("b", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a longer question"},
                       {"role": "assistant", "content": "ORIGINAL"}]),
]  # fmt: skip


def test_second_turn_prompt_holds_the_models_own_first_turn():
    """A stub generator answers with fixed text; the turn-2 prompt must contain it, not the original."""
    tok = tiny_tokenizer()
    seen: list[list[list[int]]] = []

    def stub(model, prompts, settings, max_new_tokens=None, generator=None, on_tokens=None):
        seen.append([list(p) for p in prompts])
        k = len(seen)
        return [
            Generation(tok.encode(f"OWN{k}", add_special_tokens=False) + [tok.eos_token_id], "eos")
            for _ in prompts
        ]

    out = regenerate(None, tok, CONVS, GenerationSettings(max_new_tokens=8), 2, 512, generate_fn=stub)
    assert len(seen) == 2 and len(seen[0]) == 2 and len(seen[1]) == 1  # round 2 only for conversation "a"
    msgs = CONVS[0].messages
    assert seen[0][0] == prompt_ids(tok, msgs[:1])
    own_history = [msgs[0], {"role": "assistant", "content": "OWN1"}, msgs[2]]
    assert seen[1][0] == prompt_ids(tok, own_history)
    assert "ORIGINAL-1" not in tok.decode(seen[1][0])
    a, b = out
    assert [m["content"] for m in a.messages if m["role"] == "assistant"] == ["OWN1", "OWN2"]
    assert len(a.messages) == 4  # cut after the last regenerated turn (max_turns=2)
    assert (
        a.finish_reasons == ["eos", "eos"]
        and b.finish_reasons == ["eos"]
        and b.messages[-1]["content"] == "OWN1"
    )


def test_real_model_turns_match_unbatched_greedy_on_own_history():
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), dtype=torch.float64)
    s = GenerationSettings(max_new_tokens=6, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    out = regenerate(model, tok, CONVS, s, max_turns=3, max_length=512)
    a = out[0]
    assert len(a.responses) == 3
    for k, (prompt, resp) in enumerate(zip(a.prompts, a.responses)):
        i = [j for j, m in enumerate(a.messages) if m["role"] == "assistant"][k]
        assert prompt == prompt_ids(tok, a.messages[:i])  # the final conversation's own history
        (ref,) = generate_batched(model, [prompt], s)  # a batch of one: the unbatched reference
        assert resp == ref.tokens


def test_build_rows_schema_skips_and_budget():
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), dtype=torch.float64)
    s = GenerationSettings(max_new_tokens=8, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    long_conv = Conversation(
        "long", [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]
    )
    first_len = len(prompt_ids(tok, CONVS[0].messages[:1]))
    rows, skipped, stats = build_rows(model, tok, [*CONVS, long_conv], s, True, 2, 60, T=3)
    assert skipped == {"prompt_too_long": 1} and [r["id"] for r in rows] == ["a", "b"]
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"]) <= 60
        assert "continuations" not in r  # greedy self-distilled: shift the sequence instead
        assert len(r["response_lengths"]) == len(r["finish_reasons"])
    assert rows[0]["response_lengths"][0] <= min(8, 60 - first_len)
    assert stats["turns"] == 3 and stats["generated_tokens"] == sum(sum(r["response_lengths"]) for r in rows)


def test_original_responses_get_computed_continuations():
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), dtype=torch.float64)
    s = GenerationSettings(max_new_tokens=8, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    rows, skipped, _ = build_rows(model, tok, CONVS[1:], s, regen=False, max_turns=2, max_length=512, T=3)
    (row,) = rows
    enc = tokenize_conversation(tok, CONVS[1].messages, 512)
    assert row["input_ids"] == enc["input_ids"] and row["finish_reasons"] == ["original"]
    assert row["response_lengths"] == [sum(enc["loss_mask"])]
    want = greedy_continuations(model, enc["input_ids"], 3, positions_to_compute(enc["loss_mask"]))
    assert row["continuations"] == want and sum(c[0] != -100 for c in want) == sum(enc["loss_mask"])


def test_tokens_the_target_did_not_generate_are_masked():
    """A non-canonical split (two "\\n" ids re-tokenise to one id) and a length cut leave the loss mask."""
    tok = tiny_tokenizer()
    nl = tok.convert_tokens_to_ids("\n")
    a = tok.encode("ab", add_special_tokens=False)
    answers = iter([a + [nl, nl] + a + [tok.eos_token_id], a + a])  # turn 1 ends at eos, turn 2 is cut

    def stub(model, prompts, settings, max_new_tokens=None, generator=None, on_tokens=None):
        toks = next(answers)
        return [Generation(toks, "eos" if toks[-1] == tok.eos_token_id else "length")]

    conv = [Conversation("a", CONVS[0].messages[:4])]
    (r,) = regenerate(None, tok, conv, GenerationSettings(max_new_tokens=8), 2, 512, generate_fn=stub)
    enc = tokenize_conversation(tok, r.messages, 512)
    mask = list(enc["loss_mask"])
    stats = mask_unowned_tokens(enc["input_ids"], mask, r)
    # the template's mask ends at each <|im_end|> (the "\n" after it is never trained)
    assert stats == {"retokenize_mismatch": 1, "masked_retokenized": 4, "masked_template": 1}
    p1, p2 = len(r.prompts[0]), len(r.prompts[1])
    assert mask[p1 : p1 + 2] == [1, 1]  # "ab"
    assert (
        mask[p1 + 2 : p1 + 7] == [0] * 5
    )  # "\n\n" -> <unk>, "ab", eos (masked here), "\n" (never in the mask)
    assert mask[p2 : p2 + 4] == [1] * 4  # the cut answer
    assert mask[p2 + 4 : p2 + 6] == [0, 0]  # the template's end-of-turn after the cut, "\n"
    assert sum(mask) == sum(enc["loss_mask"]) - 5


def test_greedy_rows_shift_to_exact_continuations_on_trained_positions():
    """On greedy rows, every trained (position, slot) of the shifted sequence is the target's greedy token."""
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), dtype=torch.float64)
    s = GenerationSettings(
        max_new_tokens=7, stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, max_batch_size=2
    )
    rows, _, stats = build_rows(model, tok, CONVS, s, True, 3, 512, T=4)
    checked = 0
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        cont = greedy_continuations(model, ids, 4, positions_to_compute(mask))
        for t in positions_to_compute(mask):
            for k in range(4):
                if t + 1 + k >= len(ids) or not mask[t + 1 + k]:
                    break
                assert ids[t + 1 + k] == cont[t][k], (row["id"], t, k)
                checked += 1
    assert checked > 20 and stats["masked_template"] > 0
