"""Drafter losses and acceptance metrics: pure functions of tensors (golden-value tests in tests/unit).

Shapes: `logits (..., D, V)`, `targets (..., D)` long with -100 on ignored slots, where D is the number of draft
slots (slot k predicts the token k+1 places after the root) and `...` is any batch shape (B, L) or (N,).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdraft.models.layers import rows_per_chunk

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
    p, logp = _teacher(topk_logprobs)  # (..., D, k) each
    kl = (p * (logp - logq)).sum(-1)  # (..., D)
    vf = valid.float()
    per_slot = (kl * vf).reshape(-1, d).sum(0) / vf.reshape(-1, d).sum(0).clamp_min(1.0)  # (D,)
    if weights is not None:
        per_slot = per_slot * weights.to(per_slot)
    return per_slot.sum()


def _teacher(topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """Cached teacher top-k log-probs (..., k) -> renormalised (p, log p) (..., k) float32; -inf entries drop out
    as p = log p = 0 (an all -inf row, nan after renormalising, too: it adds 0 and a 0 gradient)."""
    logp = torch.log_softmax(topk_logprobs.float(), dim=-1)  # (..., k)
    p = logp.exp()
    keep = p > 0
    return torch.where(keep, p, 0.0), torch.where(keep, logp, 0.0)


def distill_loss(
    logits: Tensor,
    targets: Tensor | None,
    weights: Tensor | None = None,
    kl: tuple[Tensor, Tensor, Tensor] | None = None,
    kl_weight: float = 1.0,
    chunk_rows: int | None = None,
) -> Tensor:
    """`multi_position_ce(logits, targets, weights) + kl_weight * soft_kl(logits, *kl, weights)` in one pass,
    computed over chunks of rows of (N * D, V) so the fp32 softmax stays in cache.

    Same value and gradient as the two reference functions (tests/unit/test_losses.py), 3x faster for a
    (1024, 4, 16,384) batch on a 2-core CPU: the reference materialises and re-reads fp32 (N, D, V) tensors
    ~10 times (two log_softmax, their gathers and backward passes); this reads the logits once forward and
    writes the gradient once backward. The loss (grad 1) is all that flows back: the logits' gradient is
    `c_ce * (softmax - onehot(label)) + c_kl * (sum_j p_j * softmax - p)` per row, c = the row's weight.

    Args:
        logits: (..., D, V) drafter logits (any float dtype; the gradient has the same dtype).
        targets: (..., D) long labels, -100 = ignored; None: no CE term.
        weights: (D,) per-slot weights (None: all ones).
        kl: (topk_ids (..., D, k) long, topk_logprobs (..., D, k), valid (..., D) bool) as in `soft_kl`;
            None: no KL term.
        kl_weight: weight of the KL term.
        chunk_rows: rows of (N * D, V) per chunk (None: ~1M logits on CPU, the fastest here for V = 16,384;
            ~16M on an accelerator, where each chunk is a few kernel launches).

    Returns:
        scalar float32 loss.
    """
    d, v = logits.shape[-2:]
    w = torch.ones(d) if weights is None else weights.float()
    w = w.to(logits.device)
    flat = logits.reshape(-1, v)  # (R, V), R = N * D
    rows = flat.shape[0]
    zero = torch.zeros(rows, device=logits.device)
    c_ce, labels = zero, torch.zeros(rows, dtype=torch.long, device=logits.device)
    if targets is not None:
        tg = targets.reshape(-1, d)  # (N, D)
        valid = (tg != IGNORE_INDEX).float()  # (N, D)
        c_ce = (valid * (w / valid.sum(0).clamp_min(1.0))).reshape(-1)  # (R,) weight of each row's CE
        labels = tg.clamp_min(0).reshape(-1)  # (R,)
    c_kl, ids = zero, torch.zeros(rows, 1, dtype=torch.long, device=logits.device)
    p = logp = zero[:, None]
    if kl is not None:
        topk_ids, topk_logprobs, kl_valid = kl
        k = topk_ids.shape[-1]
        vf = kl_valid.reshape(-1, d).float()  # (N, D)
        c_kl = (vf * (kl_weight * w / vf.sum(0).clamp_min(1.0))).reshape(-1)  # (R,)
        ids = topk_ids.clamp_min(0).reshape(-1, k)  # (R, k)
        p, logp = (x.reshape(-1, k) for x in _teacher(topk_logprobs))  # (R, k) each, as in `soft_kl`
    chunk = rows_per_chunk(chunk_rows, flat)
    return _ChunkedDistill.apply(flat, labels, c_ce, ids, p, logp, c_kl, chunk)


class _ChunkedDistill(torch.autograd.Function):
    """sum_r c_ce[r] * CE_r + c_kl[r] * KL_r over rows of (R, V) logits, chunk by chunk (see `distill_loss`);
    the teacher comes as (p, log p) (R, k) from `_teacher`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        c_ce: Tensor,
        ids: Tensor,
        p: Tensor,
        logp: Tensor,
        c_kl: Tensor,
        chunk: int,
    ) -> Tensor:
        dt = torch.promote_types(logits.dtype, torch.float32)  # fp32 math for bf16/fp16 logits, fp64 stays
        lses = torch.empty(logits.shape[0], dtype=dt, device=logits.device)  # (R,) logsumexp
        total = torch.zeros((), dtype=dt, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            e = slice(s, s + chunk)
            lg = logits[e].to(dt)  # (r, V)
            lse = torch.logsumexp(lg, dim=-1)  # (r,)
            lses[e] = lse
            ce = lse - lg.gather(-1, labels[e, None]).squeeze(-1)  # (r,)
            logq = lg.gather(-1, ids[e]) - lse[:, None]  # (r, k)
            kl = (p[e] * (logp[e] - logq)).sum(-1)  # (r,)
            total += (c_ce[e] * ce + c_kl[e] * kl).sum()  # (c: fp32 weights, promoted to dt)
        ctx.save_for_backward(logits, labels, c_ce, ids, p, c_kl, lses)
        ctx.chunk = chunk
        return total.float()  # float32 like the reference (fp64 logits: computed in fp64)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, labels, c_ce, ids, p, c_kl, lses = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (R, V)
        coef = c_ce + c_kl * p.sum(-1)  # (R,) total weight on each row's softmax
        for s in range(0, logits.shape[0], ctx.chunk):
            e = slice(s, s + ctx.chunk)
            g = torch.exp(logits[e].to(lses.dtype) - lses[e, None]) * coef[e, None].to(lses.dtype)  # (r, V)
            g.scatter_add_(-1, labels[e, None], -c_ce[e, None].to(g.dtype))
            g.scatter_add_(-1, ids[e], -(c_kl[e, None] * p[e]).to(g.dtype))
            grad[e] = g * grad_out
        return grad, None, None, None, None, None, None, None


def label_logprobs(logits: Tensor, labels: Tensor, chunk_rows: int | None = None) -> Tensor:
    """log p_draft(label) of every slot, computed over chunks of rows (no (N * D, V) fp32 softmax is kept).

    Args:
        logits: (..., D, V) drafter logits (any float dtype).
        labels: (..., D) long, -100 = ignored (its entry is the log-prob of token 0: mask it yourself).
        chunk_rows: rows of (N * D, V) per chunk (None: as `distill_loss`).

    Returns:
        (..., D) log-probs in fp32 (fp64 for fp64 logits); differentiable, backward `g * (onehot - softmax)`.
    """
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)  # (R, V)
    out = _ChunkedLabelLogProb.apply(flat, labels.clamp_min(0).reshape(-1), rows_per_chunk(chunk_rows, flat))
    return out.reshape(labels.shape)


class _ChunkedLabelLogProb(torch.autograd.Function):
    """(R, V) logits, (R,) labels -> (R,) log_softmax(logits)[label], chunk by chunk (see `label_logprobs`)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, chunk: int) -> Tensor:  # type: ignore[override]
        dt = torch.promote_types(logits.dtype, torch.float32)
        lses = torch.empty(logits.shape[0], dtype=dt, device=logits.device)  # (R,)
        out = torch.empty_like(lses)  # (R,)
        for s in range(0, logits.shape[0], chunk):
            e = slice(s, s + chunk)
            lg = logits[e].to(dt)  # (r, V)
            lses[e] = torch.logsumexp(lg, dim=-1)
            out[e] = lg.gather(-1, labels[e, None]).squeeze(-1) - lses[e]
        ctx.save_for_backward(logits, labels, lses)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, labels, lses = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (R, V)
        for s in range(0, logits.shape[0], ctx.chunk):
            e = slice(s, s + ctx.chunk)
            g = grad_out[e, None].to(lses.dtype)  # (r, 1)
            d = -torch.exp(logits[e].to(lses.dtype) - lses[e, None]) * g  # (r, V) -softmax * g
            d.scatter_add_(-1, labels[e, None], g)
            grad[e] = d
        return grad, None, None


def expected_accept_loss(logits: Tensor, labels: Tensor, chunk_rows: int | None = None) -> Tensor:
    """LK-style acceptance loss: minus the expected number of accepted draft tokens of a greedy chain.

    Slot k of a position is accepted by a greedy verifier iff the draft token equals the target's token there
    and every earlier slot was accepted. Treating the slots' draws as independent, with q_k = p_draft_k(y_k) the
    drafter's probability of the label y_k (the target's greedy token), the expected accepted length is

        E[L] = sum_k prod_{i<=k} q_i        and the loss is  -mean over chains of E[L],   in [-D, 0].

    An ignored slot (label -100) ends the chain (q = 0 from there on); the mean is over positions whose slot 0
    is valid, so a perfect drafter (q = 1 on D valid slots) scores -D, and 1 - loss is the tokens per step that
    `simulated_acceptance_length` reports. Teacher forcing fits: slot k is fed labels y_{<k}, exactly what it
    sees whenever it can be accepted. Why -E[L] rather than the survival-weighted -log q_k: it is the quantity
    greedy decoding pays for (no proxy), bounded, and its gradient, d(-E[L])/d log q_j = -sum_{k>=j} prod_{i<=k}
    q_i, weights each slot by how often it is reached; the price is a gradient that vanishes as q -> 0 (an
    untrained drafter), so use it next to CE (`train.loss=ce+lk`) rather than alone. No per-slot weights: the
    survival product already discounts later slots.

    Args:
        logits: (..., D, V) drafter logits (any float dtype).
        labels: (..., D) long, -100 = ignored.
        chunk_rows: rows of (N * D, V) per chunk of the log-softmax (None: as `distill_loss`).

    Returns:
        scalar loss in fp32 (fp64 for fp64 logits); 0 when no chain has a valid slot 0.
    """
    d = logits.shape[-2]
    valid = (labels != IGNORE_INDEX).reshape(-1, d)  # (N, D)
    logq = label_logprobs(logits, labels, chunk_rows).reshape(-1, d)  # (N, D)
    # prod_{i<=k} q_i in log space; an ignored slot zeroes its own and every later survival
    surv = torch.exp(torch.cumsum(logq.masked_fill(~valid, 0.0), dim=1)) * valid.long().cumprod(1)  # (N, D)
    chains = valid[:, 0].sum().clamp_min(1)
    return -surv.sum() / chains


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
