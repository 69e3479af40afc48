"""Copy gate for the EAGLE heads, EAGLE-1 and EAGLE-3 (an extension, off by default: `copy_ngram` = 0).

The ReDrafter's copy gate (`models/copy_lookup.py`) on an EAGLE step: a small target repeats its prompt and itself,
and a head that reads the target's features but not the prefix's tokens cannot copy them. With `copy_ngram` = n > 0
every drafted position gets one lookup candidate,

    c = the token after the most recent earlier occurrence of the longest suffix m-gram (m <= n) of the context
        the step has seen (the committed tokens, the root and the drafted path to the node),

and the head's draft-vocabulary distribution becomes (1 - lam) p_draft + lam onehot(c), with
lam = CopyGate([s; e(c)], m) read from the state the vocabulary head reads (EAGLE-3: norm(o); EAGLE-1: the
predicted feature) and the candidate's target embedding; lam = 0 for a candidate outside the draft vocabulary. The
gate starts at lam = 1/2 on every candidate. Training reads the same candidates from the row's own tokens
(`data.collate.Collator` with the family's declared `copy_ngram`: `copy_ids`, `copy_len` (B, L, S), slot i of
position t being unroll step i there; EAGLE-1 trains slot 0); decoding looks them up per tree node on the committed
tokens + the node's path (`eval/eagle_tree.py`: on the host, or on the device in the fixed-shape expansion).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from specdraft.models.copy_lookup import CopyGate, gated_candidates, mix_log_probs, mix_logits

if TYPE_CHECKING:
    from specdraft.models.eagle import EagleDrafter
    from specdraft.models.eagle3 import Eagle3Drafter


def copy_ngram(config: Any) -> int:
    """`config.copy_ngram` of an EAGLE head's config: the gate's n-gram order (0: no gate; the family's declared
    `FamilySpec.copy_ngram`)."""
    return int(config.copy_ngram or 0)


def build_gate(config: Any) -> CopyGate | None:
    """The head's `CopyGate` when `config.copy_ngram` > 0 (state and candidate embedding both H wide), else None
    (exports older than the field included)."""
    n = copy_ngram(config)
    if n <= 0:
        return None
    h = int(config.base_hidden_size)
    return CopyGate(h, h, n, int(config.copy_hidden), float(config.copy_scale))


def reset_gate(gate: CopyGate | None) -> None:
    """Zero the gate's output layer again after the head's `post_init` drew it: lam = 1/2 on every candidate
    at first (no-op without a gate)."""
    if gate is not None:
        nn.init.zeros_(gate.out.weight)
        nn.init.zeros_(gate.out.bias)


def gate(
    model: EagleDrafter | Eagle3Drafter, state: Tensor, cand: Tensor, length: Tensor
) -> tuple[Tensor, Tensor]:
    """The candidates in draft ids and their copy weights.

    Args:
        model: a head with a copy gate (`model.copy_gate`).
        state: (..., H) the normed step outputs the vocabulary head reads (`draft_head()[0](out)`).
        cand: (...) long target ids (-1: no candidate); length: (...) long match lengths (0: none).

    Returns:
        draft ids (...) long (0 where there is none) and lam (...) float32, 0 where there is no candidate or it is
        outside the draft vocabulary.
    """
    assert model.copy_gate is not None, "gate(): the head has no copy gate (copy_ngram = 0)"
    return gated_candidates(model.copy_gate, model.to_draft_ids, model.embed, state, cand, length)


def mixed_logits(
    model: EagleDrafter | Eagle3Drafter,
    state: Tensor,
    logits: Tensor,
    cand: Tensor,
    length: Tensor,
    target_ids: bool = False,
) -> Tensor:
    """Training: logits (..., Vd) of the mixture (differentiable in the head and the gate: `mix_logits`);
    `target_ids`: `logits` are over the whole target vocabulary (..., V) (EAGLE-1's loss through the LM head)."""
    draft, lam = gate(model, state, cand, length)
    return mix_logits(logits, cand.clamp_min(0).to(draft.device) if target_ids else draft, lam)


def mixed_log_probs(
    model: EagleDrafter | Eagle3Drafter, state: Tensor, logits: Tensor, cand: Tensor, length: Tensor
) -> Tensor:
    """Decoding: log-probabilities (..., Vd) float32 of the mixture (`mix_log_probs`)."""
    draft, lam = gate(model, state, cand, length)
    return mix_log_probs(logits, draft, lam)
