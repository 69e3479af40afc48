"""Medusa's training loss (`models/medusa.py` declares it as `FAMILY.compute_loss`): the teacher-forced loss
of every drafter (`models/teacher_forced.py`) with the heads weighted lambda^k."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from specdraft.models.teacher_forced import compute_loss as teacher_forced_loss

if TYPE_CHECKING:
    from specdraft.models.medusa import Medusa


def head_weights(decay: float, num_heads: int) -> Tensor:
    """(D,) float32 Medusa loss weights lambda^k, k = 0..D-1."""
    return torch.tensor([decay**k for k in range(num_heads)], dtype=torch.float32)


def compute_loss(
    model: nn.Module, batch: dict[str, Tensor], target_out: Any, opts: dict[str, Any] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-head CE weighted by lambda^k (or the soft top-k KL), on the positions that train.

    Position selection, hard labels and soft-teacher alignment are those of every teacher-forced drafter
    (`models.teacher_forced.compute_loss`, which only needs `model(hidden, root, targets)`); Medusa adds the
    lambda^k head weights unless `opts["slot_weights"]` is set explicitly.

    Args:
        model: the (possibly accelerate-wrapped) Medusa.
        batch: from `data.collate` - `root` (B, L), `targets` (B, L, D'), `pos_mask` (B, L) bool, optional
            cached teacher `topk_ids`/`topk_logprobs` (B, L, k).
        target_out: `TargetOutput` of the frozen target (`hidden` (B, L, H); `logits` for online soft targets).
        opts: as in `teacher_forced.compute_loss` (`loss`, `kl_weight`, `kl_topk`, `slot_weights`, `draft_len`,
            `max_positions`, `generator`).

    Returns:
        (loss, aux) with aux["logits"] (N, D, V) detached and aux["targets"] (N, D) target ids; with a reduced
        draft vocabulary in training mode, (N, D, Vd) and draft ids (-1 outside it), as `teacher_forced` says.
    """
    opts = dict(opts or {})
    config = cast("Medusa", getattr(model, "module", model)).config  # unwrap DDP
    d = int(opts.get("draft_len") or batch["targets"].shape[-1])
    if not opts.get("slot_weights"):
        opts["slot_weights"] = head_weights(float(config.loss_decay), d).tolist()
    return teacher_forced_loss(model, batch, target_out, opts)
