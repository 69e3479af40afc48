"""EAGLE-1's training loss (`models/eagle.py` declares it as `FAMILY.compute_loss`).

smooth-L1 between the head's predicted feature f̂_{t+1} and the target's f_{t+1}, times `feature_weight`, plus the
soft cross-entropy of the next token through the target's LM head, times `token_weight`; with `loss` containing
"lk" the D-step chain also gets `models.losses.expected_accept_loss`. In eval mode the head is unrolled for D metric
slots, scored as the decoder drafts (draft vocabulary, copy gate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from specdraft.models.eagle_common import (
    chain_labels,
    next_tokens,
    select_positions,
    smooth_l1_feature_loss,
    soft_cross_entropy,
)
from specdraft.models.eagle_copy import mixed_logits
from specdraft.models.layers import scatter_to_vocab
from specdraft.models.losses import expected_accept_loss

if TYPE_CHECKING:
    from specdraft.models.eagle import EagleDrafter


def compute_loss(
    model: nn.Module, batch: dict[str, Tensor], target_out: Any, opts: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE-1 loss on sampled trainable positions; in eval mode the head is also unrolled for D metric slots.

    Args:
        model: the (possibly accelerate-wrapped) EagleDrafter.
        batch: `input_ids` (B, L), `root` (B, L), `targets` (B, L, D), `pos_mask` (B, L) from data.collate; with a
            copy gate also `copy_ids`, `copy_len` (B, L, D) (the collator adds them: `FAMILY.copy_ngram`): every
            slot's distribution is mixed with its candidate (`models/eagle_copy.py`).
        target_out: `TargetOutput` with `hidden` (B, L, H).
        opts: `draft_len`, `max_positions`, `generator`; `loss` containing "lk" adds `lk_weight` *
            `models.losses.expected_accept_loss` over the D-step unroll (trained through every step); the
            ce/kl parts and `kl_*` do not apply to EAGLE.

    Returns:
        (loss, aux) with aux["logits"] (N, S, V) detached (S = 1 in training, D in eval) and aux["targets"] (N, S).
    """
    opts = opts or {}
    inner = cast("EagleDrafter", getattr(model, "module", model))
    cfg = inner.config
    d = int(opts.get("draft_len") or batch["targets"].shape[-1])
    lk = "lk" in str(opts.get("loss", "ce"))
    steps = 1 if inner.training and not lk else d
    f = target_out.hidden  # (B, L, H)
    b, t = select_positions(batch, opts)
    outs = model(
        f,
        next_tokens(batch["input_ids"], steps),
        steps=steps,
        grad_steps=None if lk else 1,
        noise=cfg.noise if inner.training else 0.0,
        at=(b, t),
    )  # (N, S, H)
    pred = outs[:, 0]  # (N, H) predicts f_{t+1}
    true = f[b, t + 1].to(pred.dtype)  # (N, H)
    copy = (
        None if inner.copy_gate is None else (batch["copy_ids"][b, t], batch["copy_len"][b, t])
    )  # (N, D) x2

    def full(i: int) -> Tensor:  # (N, V) slot i's logits through the LM head, mixed with its candidate
        logits = inner.full_logits(outs[:, i])
        if copy is None:
            return logits
        return mixed_logits(inner, outs[:, i], logits, copy[0][:, i], copy[1][:, i], target_ids=True)

    logits0 = full(0)  # (N, V)
    with torch.no_grad():
        teacher = torch.softmax(inner.full_logits(true).float(), dim=-1)  # (N, V) target's p(x_{t+2})
    loss = cfg.feature_weight * smooth_l1_feature_loss(pred, true) + cfg.token_weight * soft_cross_entropy(
        logits0, teacher
    )
    if lk:  # the D-slot chain with autograd: + lk_weight * -E[accepted length]
        chain = torch.stack([logits0] + [full(i) for i in range(1, steps)], dim=1)
        loss = loss + float(opts.get("lk_weight", 1.0)) * expected_accept_loss(
            chain, chain_labels(batch, b, t, steps)
        )  # chain: (N, D, V)
    steps = 1 if inner.training else d
    with torch.no_grad():  # the drafts the decoder makes: draft-vocabulary logits, in target ids
        slot = [None if copy is None else (copy[0][:, i], copy[1][:, i]) for i in range(steps)]
        first = logits0.detach() if not inner.reduced else _drafted(inner, pred, slot[0])  # (N, V)
        logits = torch.stack(
            [first] + [_drafted(inner, outs[:, i], slot[i]) for i in range(1, steps)], dim=1
        )  # (N, S, V)
    return loss, {"logits": logits, "targets": batch["targets"][b, t, :steps]}


def _drafted(head: EagleDrafter, out: Tensor, copy: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """(N, H) head outputs -> (N, V) the decoder's draft scores in target ids (outside the draft vocabulary:
    below every drafted token, `scatter_to_vocab`); `copy`: the slot's candidates and match lengths (N,) each."""
    logits = head.draft_logits(out.detach())
    if copy is not None:
        logits = mixed_logits(head, out.detach(), logits, *copy)  # the gate's mixture, as the decoder drafts
    return scatter_to_vocab(logits, head.draft_ids(), head.config.vocab_size) if head.reduced else logits
