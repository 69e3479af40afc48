"""Multi-turn self-distillation and row building: conversations in, dataset rows out.

Assistant turns are regenerated in turn order across a whole group of conversations: round k batches the
k-th assistant turn of every conversation, with the prompt built from the model's *own* turns < k. The
conversation is cut after its last regenerated turn, then tokenised with the chat template
(`tokenize_conversation`), so `input_ids`/`loss_mask` follow the same rules as every other stage, except
that on greedy rows `loss_mask` is 0 on the few assistant tokens the target did not generate itself (see
`mask_unowned_tokens`), which keeps `cont[t] = x_{t+1..t+T}` exact on every trained position.

With `capture`, each turn's generation pass also records the target features (`distill/generate.py`), fed on
past the answer with the template's end of turn (`template_tail`). A row keeps those of its last turn when
its final `input_ids` are a prefix of the ids that pass fed (its prompt holds every earlier turn, so one
prefill covers them); any other row (a retokenised answer, a template that renders differently) is left
without features for `compute_features`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdraft.data.chat import prompt_ids, render, tokenize_conversation
from specdraft.data.conversations import Conversation
from specdraft.data.features import FeatureSpec
from specdraft.distill.continuations import greedy_continuations, positions_to_compute
from specdraft.distill.features import pack_features
from specdraft.distill.generate import Captured, GenerationSettings, TailFn, generate_batched

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GenerateFn = Callable[..., list]  # generate_batched's signature; tests may stub it


@dataclass
class Regenerated:
    """One conversation after regeneration (or the reason it was dropped)."""

    id: str
    messages: list[dict[str, str]] = field(default_factory=list)  # cut after the last regenerated turn
    responses: list[list[int]] = field(default_factory=list)  # generated ids per turn (incl. the stop token)
    prompts: list[list[int]] = field(default_factory=list)  # prompt ids each turn was generated from
    finish_reasons: list[str] = field(default_factory=list)  # "eos" | "length" per turn
    skip: str | None = None  # reason when no turn could be generated
    captured: Captured | None = None  # features of the last turn's generation pass (`capture` set)


def template_tail(tokenizer: PreTrainedTokenizerBase) -> TailFn:
    """The ids the chat template puts after an assistant turn, as a `generate_batched` tail.

    An "eos" answer is rendered without its stop token, a "length" one in full, each followed by the template
    text after the content (e.g. `<|im_end|>\\n`). Returns a tail feeding that text's ids (a prediction of
    the final tokenisation, which `build_rows` checks).
    """
    mark = "SPECDRAFT-TAIL-MARK"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}]
    try:
        text = render(tokenizer, msgs, add_generation_prompt=False)
    except (ValueError, KeyError, TypeError):  # the template cannot render it: predict no tail text
        text = mark
    after = text[text.find(mark) + len(mark) :] if mark in text else ""
    suffix = list(tokenizer(after, add_special_tokens=False)["input_ids"]) if after else []

    def tail(tokens: list[int], reason: str) -> list[int]:
        return suffix if reason == "eos" else tokens[-1:] + suffix

    return tail


def regenerate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    convs: Sequence[Conversation],
    settings: GenerationSettings,
    max_turns: int,
    max_length: int,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int], None] | None = None,
    generate_fn: GenerateFn = generate_batched,
    capture: FeatureSpec | None = None,
) -> list[Regenerated]:
    """Regenerate the first `max_turns` assistant turns of every conversation, turn by turn.

    A turn's budget is `min(max_new_tokens, max_length - prompt_len)` (tokens past `max_length` would be
    truncated anyway); a conversation stops at the first turn whose prompt already fills `max_length`.

    With `capture`, each conversation keeps the features its last generated turn captured.

    Returns:
        One `Regenerated` per conversation, in input order; `skip="prompt_too_long"` when not even the
        first turn fits.
    """
    extra = {} if capture is None else {"capture": capture, "tail": template_tail(tokenizer)}
    msgs = [[dict(m) for m in c.messages] for c in convs]
    slots = [[i for i, m in enumerate(ms) if m["role"] == "assistant"][:max_turns] for ms in msgs]
    out = [Regenerated(id=c.id) for c in convs]
    alive = [True] * len(convs)
    for k in range(max_turns):
        jobs: list[tuple[int, int, list[int], int]] = []  # (conversation, message index, prompt, budget)
        for c in range(len(convs)):
            if not alive[c] or k >= len(slots[c]):
                continue
            i = slots[c][k]
            prompt = prompt_ids(tokenizer, msgs[c][:i])  # earlier assistant turns are already the model's own
            budget = min(settings.max_new_tokens, max_length - len(prompt))
            if budget <= 0:
                alive[c] = False
                continue
            jobs.append((c, i, prompt, budget))
        if not jobs:
            break
        gens = generate_fn(
            model,
            [j[2] for j in jobs],
            settings,
            max_new_tokens=[j[3] for j in jobs],
            generator=generator,
            on_tokens=on_tokens,
            **extra,
        )
        for (c, i, prompt, _), g in zip(jobs, gens):
            content = g.tokens[:-1] if g.finish_reason == "eos" else g.tokens
            msgs[c][i] = {
                "role": "assistant",
                "content": str(tokenizer.decode(content, skip_special_tokens=False)),
            }
            r = out[c]
            r.responses.append(list(g.tokens))
            r.prompts.append(prompt)
            r.finish_reasons.append(g.finish_reason)
            r.captured = g.captured  # a later turn's prefill covers this one: keep the last
    for c, r in enumerate(out):
        n = len(r.responses)
        if n == 0:
            r.skip = "prompt_too_long"
        else:
            r.messages = msgs[c][: slots[c][n - 1] + 1]
    return out


def mask_unowned_tokens(ids: Sequence[int], mask: list[int], r: Regenerated) -> Counter:
    """Zero `mask` (in place) on assistant tokens the target did not itself generate after this very prefix.

    With that, shifting the sequence gives exact greedy continuations (`cont[t] = x_{t+1..t+T}`) on every
    position that still trains. Per regenerated turn, the rest of its assistant span is zeroed from
      * the first token that differs from prompt + generated ids, when the text round trip (decode, then
        the template re-tokenises) changed them, e.g. a non-canonical BPE split; else
      * the end of the generated ids: template text the mask covers after them (the end-of-turn appended
        to an answer cut at its budget, a newline after the end-of-turn token).

    Returns:
        Counter with `retokenize_mismatch` (turns), `masked_retokenized` and `masked_template` (tokens).
    """
    c: Counter = Counter()
    L = len(ids)
    for prompt, resp in zip(r.prompts, r.responses):
        want = prompt + resp
        n = min(len(want), L)
        d = next((i for i in range(n) if ids[i] != want[i]), None)
        start = len(want) if d is None else d
        e = max(start, len(prompt))
        while e < L and mask[e]:
            e += 1
        zeroed = sum(mask[start:e])
        mask[start:e] = [0] * (e - start)
        c["retokenize_mismatch"] += int(d is not None)
        c["masked_retokenized" if d is not None else "masked_template"] += zeroed
    return +c


def _mask_runs(mask: Sequence[int]) -> list[int]:
    """Lengths of the runs of 1s in a loss mask (tokens per assistant turn)."""
    runs, n = [], 0
    for m in list(mask) + [0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def build_rows(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    convs: Sequence[Conversation],
    settings: GenerationSettings,
    regen: bool,
    max_turns: int,
    max_length: int,
    T: int,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int], None] | None = None,
    cont_chunk: int = 256,
    capture: FeatureSpec | None = None,
) -> tuple[list[dict[str, Any]], Counter, Counter]:
    """Turn conversations into dataset rows (schema in docs/design.md), skipping and counting bad ones.

    Continuations are stored only when the responses are not greedy self-generated (original responses, or
    sampled ones); for greedy regenerated rows `shift_continuations(input_ids, T)` gives them for free.

    With `capture` (regenerated rows only), rows whose ids the generation pass fed get its features
    (`features_captured` counts them); the others are left to `compute_features`.

    Returns:
        (rows, skipped reason -> count, stats counter: turns, generated_tokens, finish_<reason>, tokens,
        features_captured and the `mask_unowned_tokens` counts).
    """
    skipped: Counter = Counter()
    stats: Counter = Counter()
    if regen:
        results = regenerate(
            model, tokenizer, convs, settings, max_turns, max_length, generator, on_tokens, capture=capture
        )
    else:
        results = [Regenerated(id=c.id, messages=c.messages) for c in convs]
    need_cont = not (regen and not settings.do_sample)
    rows = []
    for r in results:
        if r.skip:
            skipped[r.skip] += 1
            continue
        try:
            enc = tokenize_conversation(tokenizer, r.messages, max_length)
        except (ValueError, KeyError, TypeError):  # the template cannot render this conversation
            skipped["chat_template_error"] += 1
            continue
        ids, mask = enc["input_ids"], list(enc["loss_mask"])
        if regen and not need_cont:  # greedy: shifting must give exact continuations
            stats.update(mask_unowned_tokens(ids, mask, r))
        if not any(mask[1:]):
            skipped["no_assistant_tokens"] += 1
            continue
        row: dict[str, Any] = {"id": r.id, "input_ids": ids, "loss_mask": mask}
        if regen:
            row["response_lengths"] = [len(t) for t in r.responses]
            row["finish_reasons"] = list(r.finish_reasons)
        else:
            row["response_lengths"] = _mask_runs(mask)
            row["finish_reasons"] = ["original"] * len(row["response_lengths"])
        if need_cont:
            row["continuations"] = greedy_continuations(model, ids, T, positions_to_compute(mask), cont_chunk)
        if capture is not None and r.captured is not None and r.captured.ids[: len(ids)] == ids:
            row.update(pack_features({k: v[: len(ids)] for k, v in r.captured.tensors.items()}, capture))
            stats["features_captured"] += 1
        r.captured = None  # packed or not needed: free the tensors
        stats["turns"] += len(row["finish_reasons"])
        stats["generated_tokens"] += sum(len(t) for t in r.responses)
        stats["tokens"] += len(ids)
        for fr in row["finish_reasons"]:
            stats[f"finish_{fr}"] += 1
        rows.append(row)
    return rows, skipped, stats
