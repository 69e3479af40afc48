"""EAGLE-3's training-time-test loss (`models/eagle3.py` declares it as `FAMILY.compute_loss`).

The head is unrolled S steps from the fused target layers; step i's draft-vocabulary distribution imitates the
target's at position t + 1 + i by soft cross-entropy, weighted `ttt_decay`^i; with `loss` containing "lk" the
S-step chain also gets `models.losses.expected_accept_loss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.models.eagle_common import chain_labels, next_tokens, select_positions, soft_cross_entropy
from specdraft.models.eagle_copy import mixed_logits
from specdraft.models.layers import d2t_to_draft_ids, scatter_to_vocab
from specdraft.models.losses import expected_accept_loss

if TYPE_CHECKING:
    from specdraft.models.eagle3 import Eagle3Drafter


def compute_loss(
    model: nn.Module, batch: dict[str, Tensor], target_out: Any, opts: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Training-time-test loss: sum_i ttt_decay^i * softCE(step i, target distribution at t+1+i).

    Args:
        model: the (possibly accelerate-wrapped) Eagle3Drafter.
        batch: `input_ids` (B, L), `root` (B, L), `targets` (B, L, D), `pos_mask` (B, L) from data.collate; with a
            copy gate also `copy_ids`, `copy_len` (B, L, D) (the collator adds them: `FAMILY.copy_ngram`).
        target_out: `TargetOutput` with `hidden` (B, L, H) and `layers` (B, L, m, H) of `config.target_layers`.
        opts: `draft_len` (S), `max_positions`, `generator`; `loss` containing "lk" adds `lk_weight` *
            `models.losses.expected_accept_loss` over the S unroll steps (draft-vocabulary labels; a label outside
            the draft vocabulary ends the chain); the ce/kl parts and `kl_*` do not apply to EAGLE-3.

    Returns:
        (loss, aux) with aux["logits"] (N, S', V) (full vocabulary; outside the draft vocab: row min - 20),
        aux["targets"] (N, S'); S' = S in eval mode, 1 in training (metrics of slot 0 only); and
        aux["step_losses"] (S,) the detached soft CE of every unroll step (loss = sum_i ttt_decay^i * step i).
    """
    opts = opts or {}
    inner = cast("Eagle3Drafter", getattr(model, "module", model))
    lk = "lk" in str(opts.get("loss", "ce"))
    if target_out.layers is None:
        raise ValueError(
            f"EAGLE-3 needs the target layers {inner.config.target_layers} in TargetOutput.layers"
        )
    steps = int(opts.get("draft_len") or inner.config.draft_len)
    feats = target_out.layers.flatten(2)  # (B, L, m*H)
    b, t = select_positions(batch, opts)
    outs = model(feats, next_tokens(batch["input_ids"], steps), steps=steps, at=(b, t))  # (N, S, H)
    targets = batch["targets"][b, t, :steps]  # (N, S)
    copy = (
        None
        if inner.copy_gate is None
        else (batch["copy_ids"][b, t, :steps], batch["copy_len"][b, t, :steps])
    )
    f, ids = target_out.hidden, inner.draft_ids()  # (B, L, H), (Vd,)
    w_teacher = inner.borrowed.weight("lm_head", f)  # (V, H) target LM head, cast once
    if ids.shape[0] < w_teacher.shape[0]:
        w_teacher = inner.borrowed.rows("lm_head", f, ids)  # (Vd, H) draft-vocabulary rows, cached
    length, v = f.shape[1], inner.config.vocab_size
    n_aux = 1 if inner.training else steps  # training logs slot 0 only: skip the (N, V) scatter of the others
    loss, logits, step_losses = outs.new_zeros((), dtype=torch.float32), [], []
    chain: list[Tensor] = []  # the S steps' (N, Vd) logits with autograd, for the LK term
    for i in range(steps):
        p = t + 1 + i  # (N,) position whose target distribution step i imitates
        valid = (p < length) & (targets[:, i] != -100)
        q = inner.draft_logits(outs[:, i])  # (N, Vd)
        if copy is not None:  # mixed with step i's lookup candidate (N,)
            q = mixed_logits(inner, inner.draft_head()[0](outs[:, i]), q, copy[0][:, i], copy[1][:, i])
        with torch.no_grad():
            teacher = torch.softmax(
                F.linear(f[b, p.clamp_max(length - 1)], w_teacher).float(), dim=-1
            )  # (N, Vd)
        step_loss = soft_cross_entropy(q, teacher, valid)  # scalar float32
        loss = loss + inner.config.ttt_decay**i * step_loss
        step_losses.append(step_loss.detach())
        if lk:
            chain.append(q)
        if i < n_aux:
            logits.append(scatter_to_vocab(q.detach(), ids, v))  # (N, V)
    if lk:  # + lk_weight * -E[accepted length] of the S-slot chain, labels in draft ids
        labels = d2t_to_draft_ids(chain_labels(batch, b, t, steps), inner.d2t, True, v)  # (N, S)
        lk_loss = expected_accept_loss(torch.stack(chain, dim=1), labels)  # (N, S, Vd) logits
        loss = loss + float(opts.get("lk_weight", 1.0)) * lk_loss
    aux = {
        "logits": torch.stack(logits, dim=1),
        "targets": targets[:, :n_aux],
        "step_losses": torch.stack(step_losses),
    }
    return loss, aux
