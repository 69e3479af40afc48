"""The teacher-forced loss of the drafters whose `forward(hidden, root, targets)` scores every draft slot at once
(ReDrafter, Medusa): hard-label CE and/or KL to the teacher's top-k, on a random subset of the trainable
positions. Handles a reduced draft vocabulary (`reduced_vocab`, `to_draft_ids`, `draft_ids` of ReDrafter and
Medusa): labels outside it are ignored (-100), teacher top-k mass on them is dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from specdraft.data.ngrams import follows_own_text
from specdraft.models.base_llm import teacher_topk
from specdraft.models.layers import scatter_to_vocab
from specdraft.models.losses import distill_loss, expected_accept_loss


def compute_loss(
    model: nn.Module, batch: dict[str, Tensor], target_out: Any, opts: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Teacher-forced loss on the positions that train (`batch["pos_mask"]`).

    Args:
        model: the (possibly accelerate-wrapped) ReDrafter or Medusa.
        batch: from `data.collate` - `root` (B, L), `targets` (B, L, D'), `pos_mask` (B, L) bool, and optionally
            `topk_ids`/`topk_logprobs` (B, L, k) cached teacher top-k.
        target_out: `TargetOutput` of the frozen target on `batch["input_ids"]` (`hidden` (B, L, H); `layers`
            (B, L, m, H) when the drafter has `target_layers`; `logits` (B, L, V) only for online soft targets).
        opts: `loss` ("ce" | "kl" | "ce+kl", optionally with "lk": + `lk_weight` * `expected_accept_loss`),
            `kl_weight`, `lk_weight`, `kl_topk`, `slot_weights` (list; not applied to the LK term), `draft_len`,
            `max_positions` (random subset of positions per call), `generator` (torch.Generator).

    Returns:
        (loss, aux) with aux["logits"] (N, D, V) detached and aux["targets"] (N, D) target ids for metrics; with a
        reduced draft vocabulary in training mode, (N, D, Vd) and draft ids (-1 outside it) instead (cheaper).
    """
    opts = opts or {}
    d = int(opts.get("draft_len") or batch["targets"].shape[-1])
    sel = batch["pos_mask"].nonzero()  # (N, 2) (b, t) pairs
    cap = opts.get("max_positions")
    if cap and sel.shape[0] > cap:
        keep = torch.randperm(sel.shape[0], generator=opts.get("generator"))[:cap].sort().values
        sel = sel[keep.to(sel.device)]
    b, t = sel[:, 0], sel[:, 1]
    inner: Any = getattr(model, "module", model)  # a ReDrafter or a Medusa
    reduced = bool(getattr(inner, "reduced_vocab", False))  # `draft_vocab_size` < V (ReDrafter, Medusa)
    hidden = target_out.hidden[b, t]  # (N, H)
    if getattr(inner.config, "target_layers", None):  # ReDrafter with extra layers: [h_t; l_i1; ...; l_im]
        if target_out.layers is None:
            raise ValueError(
                f"the drafter needs target layers {inner.config.target_layers} in TargetOutput.layers"
            )
        extra = target_out.layers[b, t].flatten(1).to(hidden)  # (N, m*H)
        hidden = torch.cat([hidden, extra], dim=-1)  # (N, H * (1 + m))
    root, targets = batch["root"][b, t], batch["targets"][b, t, :d]  # (N,), (N, D) target ids
    copy = None
    if getattr(inner.config, "copy_ngram", 0):  # ReDrafter with the copy gate: the slots' lookup candidates
        if "copy_ids" not in batch:
            raise ValueError(
                "the drafter has copy_ngram > 0 but the batch has no `copy_ids` (build the Collator with copy_ngram)"
            )
        copy = (batch["copy_ids"][b, t, :d][None], batch["copy_len"][b, t, :d][None])  # (1, N, D) each
    if getattr(inner.config, "context_heads", 0):  # ReDrafter with prefix attention: rows of the batch kept
        logits = _forward_with_context(model, batch, target_out.hidden, hidden, root, targets, b, t, copy)
    else:  # `copy` only when set: Medusa's forward has no such argument
        extra_in = {} if copy is None else {"copy": copy}
        logits = model(hidden[None], root[None], targets[None], **extra_in)[0]  # (N, D, Vd)
    # (N, D) draft ids, -1 for padding and tokens outside the draft vocabulary (one lookup, used twice below)
    draft = inner.to_draft_ids(targets, missing=-1) if reduced else targets
    labels = draft.masked_fill(draft < 0, -100) if reduced else targets  # (N, D); out of vocabulary: ignored
    weights = torch.tensor(opts["slot_weights"][:d]) if opts.get("slot_weights") else None
    kind = opts.get("loss", "ce")
    kl = None
    if "kl" in kind:
        # Teacher for slot k at position t: the target's distribution at t+1+k (greedy-path sequences only).
        seq_len = batch["root"].shape[1]
        pos = t[:, None] + 1 + torch.arange(d, device=t.device)  # (N, D)
        valid = (pos < seq_len) & (targets != -100)
        pos = pos.clamp_max(seq_len - 1)
        if "input_ids" in batch:
            # The teacher at t+1+k saw the row's own tokens x_{t+1..t+1+k}; slot k saw (root, targets[:k]).
            # They differ on rows whose labels are greedy continuations of *other* text (distill.regenerate=
            # false): there the teacher is only right while the text follows the chain.
            valid = valid & follows_own_text(batch["input_ids"][b[:, None], pos], root, targets)  # (N, D)
        if "topk_ids" in batch:
            ids, lps = (
                batch["topk_ids"][b[:, None], pos],
                batch["topk_logprobs"][b[:, None], pos],
            )  # (N, D, k)
        else:
            lps, ids = teacher_topk(
                target_out.logits[b[:, None], pos], int(opts.get("kl_topk", 20))
            )  # (N, D, k)
        if reduced:  # teacher mass on tokens the drafter cannot draft is dropped (renormalised in the loss)
            ids = inner.to_draft_ids(ids, missing=-1)  # (N, D, k)
            lps = lps.float().masked_fill(ids < 0, float("-inf"))
            valid = valid & (ids >= 0).any(-1)
        kl = (ids, lps, valid)
    # multi_position_ce + kl_weight * soft_kl, chunked (one read of the (N, D, Vd) logits; same value and gradient)
    loss = distill_loss(
        logits, labels if "ce" in kind else None, weights, kl, float(opts.get("kl_weight", 1.0))
    )
    if "lk" in kind:  # + lk_weight * -E[accepted length]; an out-of-vocabulary label (-100) ends the chain
        loss = loss + float(opts.get("lk_weight", 1.0)) * expected_accept_loss(logits, labels)
    out = logits.detach()  # (N, D, Vd)
    if reduced and not inner.training:  # metrics in target ids
        out = scatter_to_vocab(out, inner.draft_ids(), inner.config.vocab_size)  # (N, D, V)
    elif reduced:  # training metrics stay in draft ids (out-of-vocabulary labels -> -1: always a miss)
        targets = draft.masked_fill(targets == -100, -100)
    return loss, {"logits": out, "targets": targets}


def _forward_with_context(
    model: nn.Module,
    batch: dict[str, Tensor],
    last: Tensor,
    hidden: Tensor,
    root: Tensor,
    targets: Tensor,
    b: Tensor,
    t: Tensor,
    copy: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The teacher-forced forward of a drafter with prefix attention: the N selected positions stay flat; each
    attends to its own row's committed positions 2 <= j <= t (a (B, n, 1 + L) mask with the attention's sink
    first, n = most positions in a row).

    Args:
        last: (B, L, H) the target's last-layer states of the whole batch; hidden (N, F), root (N,),
            targets (N, D): the selected positions' inputs; b, t (N,): their row and position (row-major order);
            copy: the copy gate's candidates and match lengths (1, N, D) each, or None.

    Returns:
        logits (N, D, Vd).
    """
    bsz, seq = batch["input_ids"].shape
    counts = torch.bincount(b, minlength=bsz)  # (B,)
    first = counts.cumsum(0) - counts  # (B,) index of each row's first selected position
    rank = torch.arange(b.shape[0], device=b.device) - first[b]  # (N,) index within the row
    tpos = t.new_full((bsz, int(counts.max())), -1)  # (B, n); -1: padding, sees nothing
    tpos[b, rank] = t
    j = torch.arange(seq, device=t.device)
    mask = (j >= 2) & (j[None, None, :] <= tpos[:, :, None])  # (B, n, L)
    mask = torch.nn.functional.pad(mask, (1, 0), value=True)  # (B, n, 1 + L): the sink column first
    ids = batch["input_ids"]
    # (B, L) x_{j+1}: the sequence itself (as at decode time), not the labels' greedy root
    nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    ctx = {"last": last, "input_ids": ids, "next": nxt, "mask": mask, "row": b, "rank": rank}
    return model(hidden[None], root[None], targets[None], context=ctx, copy=copy)[0]  # (N, D, Vd)
