"""Drafter losses and acceptance metrics: pure functions of tensors (golden-value tests in tests/unit).

Shapes: `logits (..., D, V)`, `targets (..., D)` long with -100 on ignored slots, where D is the number of draft
slots (slot k predicts the token k+1 places after the root) and `...` is any batch shape (B, L) or (N,).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def per_slot_ce(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of each draft slot over its non-ignored entries.

    Args:
        logits: (..., D, V) drafter logits.
        targets: (..., D) long labels, -100 = ignored.

    Returns:
        (D,) float32 mean CE per slot (0 for a slot with no valid entry).
    """
    d, v = logits.shape[-2:]
    lg = logits.reshape(-1, d, v).float()  # (N, D, V)
    tg = targets.reshape(-1, d)  # (N, D)
    ce = F.cross_entropy(lg.transpose(1, 2), tg, ignore_index=IGNORE_INDEX, reduction="none")  # (N, D)
    valid = (tg != IGNORE_INDEX).float()  # (N, D)
    return ce.sum(0) / valid.sum(0).clamp_min(1.0)  # (D,)


def multi_position_ce(logits: Tensor, targets: Tensor, weights: Tensor | None = None) -> Tensor:
    """ReDrafter distillation loss (s3.5): sum over slots of the mean -log p_draft(teacher token).

    Args:
        logits: (..., D, V).
        targets: (..., D) long, -100 = ignored.
        weights: (D,) per-slot weights (None: all ones).

    Returns:
        scalar loss = sum_k weights[k] * CE_k.
    """
    ce = per_slot_ce(logits, targets)  # (D,)
    if weights is not None:
        ce = ce * weights.to(ce)
    return ce.sum()


def soft_kl(
    logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, valid: Tensor, weights: Tensor | None = None
) -> Tensor:
    """KL(p_teacher || q_draft) with the teacher truncated to its cached top-k (renormalised).

    Args:
        logits: (..., D, V) drafter logits.
        topk_ids: (..., D, k) long teacher top-k token ids for each slot.
        topk_logprobs: (..., D, k) teacher log-probs of those ids (need not sum to 1: renormalised here; -inf
            drops an entry, e.g. a token outside a reduced draft vocabulary).
        valid: (..., D) bool, slots that count.
        weights: (D,) per-slot weights (None: all ones).

    Returns:
        scalar = sum_k weights[k] * mean over valid entries of slot k of
        sum_j p_j (log p_j - log q(id_j)).
    """
    d = logits.shape[-2]
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids.clamp_min(0))  # (..., D, k)
    logp = torch.log_softmax(topk_logprobs.float(), dim=-1)  # (..., D, k) renormalised teacher
    p = logp.exp()  # (..., D, k)
    keep = p > 0  # -inf teacher entries drop out (and all -inf rows, nan here, give 0 and a 0 gradient)
    p, logp = torch.where(keep, p, 0.0), torch.where(keep, logp, 0.0)
    kl = (p * (logp - logq)).sum(-1)  # (..., D)
    vf = valid.float()
    per_slot = (kl * vf).reshape(-1, d).sum(0) / vf.reshape(-1, d).sum(0).clamp_min(1.0)  # (D,)
    if weights is not None:
        per_slot = per_slot * weights.to(per_slot)
    return per_slot.sum()


def topk_hits(logits: Tensor, targets: Tensor, k: int = 1) -> Tensor:
    """Whether each slot's label is among the drafter's top-k tokens.

    Args:
        logits: (..., D, V).
        targets: (..., D) long, -100 = ignored.
        k: how many top tokens count as a hit.

    Returns:
        (..., D) bool, False on ignored slots.
    """
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # (..., D, k)
    return (top == targets.unsqueeze(-1)).any(-1) & (targets != IGNORE_INDEX)


def per_slot_accuracy(hits: Tensor, valid: Tensor) -> Tensor:
    """hits, valid (..., D) bool -> (D,) float32 fraction of valid entries that are hits (0 when none)."""
    d = hits.shape[-1]
    h = (hits & valid).reshape(-1, d).float().sum(0)
    n = valid.reshape(-1, d).float().sum(0)
    return h / n.clamp_min(1.0)


def simulated_acceptance_length(acc: Tensor) -> float:
    """Expected tokens per step of one greedy draft chain from per-slot top-1 accuracies.

    1 + sum_k prod_{i<=k} acc_i (the 1 is the target's own token); e.g. acc = (0.5, 0.5) -> 1.75.

    Args:
        acc: (D,) per-slot accuracies in [0, 1].
    """
    return float(1.0 + torch.cumprod(acc.double(), dim=0).sum())


def chain_acceptance_length(hits: Tensor, valid: Tensor) -> float:
    """Measured tokens per step of one greedy chain: 1 + mean number of leading hits per position.

    Unlike `simulated_acceptance_length` (a product of marginals) this uses the joint event "all slots up to k
    were right", which is what a greedy verifier accepts. Positions whose slot 0 is ignored are skipped; an
    ignored later slot ends the chain.

    Args:
        hits, valid: (..., D) bool.
    """
    d = hits.shape[-1]
    h = (hits & valid).reshape(-1, d)
    rows = valid.reshape(-1, d)[:, 0]
    if not bool(rows.any()):
        return 1.0
    lead = torch.cumprod(h[rows].long(), dim=1).sum(1).double()  # (N,)
    return float(1.0 + lead.mean())


def unigram_hits(counts: Tensor, targets: Tensor, k: int = 1) -> Tensor:
    """Hits of the context-free baseline that always proposes the k most frequent training tokens.

    Args:
        counts: (V,) token frequencies of the training labels.
        targets: (..., D) long, -100 = ignored.

    Returns:
        (..., D) bool.
    """
    top = counts.topk(min(k, counts.numel())).indices.to(targets.device)  # (k,)
    return (targets.unsqueeze(-1) == top).any(-1) & (targets != IGNORE_INDEX)
