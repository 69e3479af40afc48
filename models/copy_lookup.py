"""Copy gate for ReDrafter (an extension of the paper, off by default: `copy_ngram` = 0).

A small target repeats itself: in SmolLM2-135M's own greedy answers about 40% of the positions end a 3-gram seen
earlier in the conversation, and the token that followed it then comes next 84% of the time. The drafter's MLP
cannot see the prefix, so it cannot copy. With `copy_ngram` = n > 0 every draft slot gets one *lookup candidate*:

    c_k = the token after the most recent earlier occurrence of the longest suffix m-gram (m <= n) of the
          context x_0 .. x_{t+1}, tok_1 .. tok_k that the slot has seen (prompt lookup, one token)

and the slot's distribution becomes the mixture (1 - lam_k) p_draft + lam_k onehot(c_k), with
lam_k = gate([g_k; e(c_k)], m) (`CopyGate`; g_k is the slot's last ResBlock output), so the drafter decides from
its own state and the match length how far to trust the copy (pointer-generator style; `mix_logits`). The gate
starts at lam = 1/2 on every candidate. The same candidates are computed in training (the row's own tokens,
`data.ngrams.ngram_candidates`, `slot_candidates`) and at decode time (`data.ngrams.NgramIndex` over the
committed tokens, per beam).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.data.ngrams import NO_CANDIDATE
from specdraft.models.layers import ZeroInitLinear, rows_per_chunk


def lookup_fixed_rows(ctx: Tensor, length: Tensor, chains: Tensor, max_ngram: int) -> tuple[Tensor, Tensor]:
    """`NgramIndex.lookup` of S rows x W chains at once, with fixed shapes and no host sync (a CUDA graph
    captures it), each row's chains on its own committed tokens.

    The candidate is the token after the newest earlier occurrence of the longest suffix m-gram (m <= `max_ngram`)
    of committed + chain, as `NgramIndex.lookup` gives: the newest match over all end positions q < p (those inside
    the chain are newer than the indexed committed ones). O(S * W * (C + c) * max_ngram) on the device, against
    the host index's O(1) dict lookups: for the graph-captured draft step only.

    Args:
        ctx: (S, C) long, each row's committed tokens, the first `length[s]` valid (the rest any value).
        length: (S,) long, each row's n0.
        chains: (S, W, c) long, each row's beams after its committed tokens (root first), c >= 1.
        max_ngram: the longest suffix matched.

    Returns:
        candidates (S, W) long (`NO_CANDIDATE` where nothing matches), match lengths (S, W) long (0 there).
    """
    s, w, c = chains.shape
    cap, dev = ctx.shape[1], ctx.device
    q, j, back, started, inside = _grid(cap, c, max_ngram, dev)
    n0 = length[:, None]  # (S, 1)
    rel = (q - n0).clamp(0, c - 1)  # (S, Q) chain index of positions >= n0
    chain = chains.gather(2, rel[:, None, :].expand(s, w, -1))  # (S, W, Q)
    committed = ctx[:, inside][:, None, :]  # (S, 1, Q); positions past the buffer read its last entry
    seq = torch.where((q < n0)[:, None, :], committed, chain)  # (S, W, Q); valid up to p
    p = n0 + c - 1  # (S, 1) the newest position
    # every gram length at once (a few kernels, not a dozen per length: the draft step is launch-bound on a
    # GPU): element j of the m-gram ending at q is seq[q - j]; of the suffix, seq[p - j]
    shifted = seq[..., back]  # (S, W, N, Q)
    tail = seq.gather(2, (p - j).clamp_min(0)[:, None, :].expand(s, w, -1))  # (S, W, N)
    eq = (shifted == tail[..., None]) & started  # (S, W, N, Q)
    match = eq.to(torch.uint8).cummin(dim=2).values.bool()  # m = j + 1 grams ending at q match the suffix
    earlier = (q < p)[:, None, None, :] & (p >= j)[:, None, :, None]  # (S, 1, N, Q)
    best = torch.where(match & earlier, q, -1).amax(dim=-1)  # (S, W, N) the newest occurrence, -1 = none
    # a longer gram's occurrences are occurrences of the shorter ones: the lengths found are 1 .. size
    size = (best >= 0).sum(dim=-1)  # (S, W) the longest suffix found (0: none)
    newest = best.gather(2, (size - 1).clamp_min(0)[..., None])[..., 0]  # (S, W)
    after = seq.gather(2, (newest + 1).clamp(0, cap + c - 1)[..., None])[..., 0]  # (S, W) the token after it
    cand = torch.where(size > 0, after, torch.full_like(after, NO_CANDIDATE))
    return cand, size


_GRIDS: dict[tuple[int, int, int, torch.device], tuple[Tensor, ...]] = {}


def _grid(cap: int, c: int, n: int, device: torch.device) -> tuple[Tensor, ...]:
    """Index tensors of `lookup_fixed_rows` that depend on shapes only, made once per shape (a CUDA graph's
    warm-up makes them, so its replays launch nothing for them): q (Q,) positions, j (N,) gram offsets,
    (q - j).clamp(0) (N, Q), q >= j (N, Q) and q.clamp(max=cap - 1) (Q,), with Q = cap + c."""
    key = (cap, c, n, device)
    # never evicted: captured CUDA graphs keep reading these tensors (a few per capacity)
    if key not in _GRIDS:
        with torch.inference_mode(False):
            q, j = torch.arange(cap + c, device=device), torch.arange(n, device=device)
            back, started = (q[None] - j[:, None]).clamp_min(0), q[None] >= j[:, None]
            _GRIDS[key] = (q, j, back, started, q.clamp_max(cap - 1))
    return _GRIDS[key]


class CopyGate(nn.Module):
    """The copy weight of the lookup candidate c of match length m (0 without a candidate):

        lam = sigmoid(scale * (out(SiLU(fc([g; e(c)]))) + bias[m]))

    and the slot's distribution becomes the mixture (1 - lam) * p_draft + lam * onehot(c) (`mix_logits`), as in a
    pointer-generator: where the lookup is usually right, lam -> its hit rate and c is drafted whatever the head
    scored it (an additive logit bias could not: measured, it stalled at 80% of the right copies, whose head logit
    was often ~6 nats below its top token). `scale` lets Adam, which moves a parameter by about the learning rate
    per step, move lam's log-odds several units in a few hundred steps. At init lam = 1/2 on every candidate.
    """

    def __init__(
        self, state_dim: int, embed_dim: int, max_ngram: int, hidden: int = 64, scale: float = 8.0
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(state_dim + embed_dim, hidden)
        self.out = ZeroInitLinear(hidden, 1)  # zero at init: lam starts at 1/2 where there is a candidate
        self.length_bias = nn.Parameter(torch.zeros(max_ngram + 1))  # (n + 1,) per match length
        self.scale = float(scale)

    def forward(self, g: Tensor, cand_emb: Tensor, length: Tensor) -> Tensor:
        """g (..., X), cand_emb (..., E), length (...) long -> lam (...) float32 in [0, 1), 0 where length == 0."""
        z = self.out(F.silu(self.fc(torch.cat([g, cand_emb.to(g.dtype)], dim=-1))))[..., 0].float()  # (...)
        lam = torch.sigmoid((z + self.length_bias[length].float()) * self.scale)
        return lam * (length > 0).float()


def gated_candidates(
    gate: CopyGate,
    to_draft_ids: Callable[..., Tensor],
    embed: Callable[[Tensor], Tensor],
    state: Tensor,
    cand: Tensor,
    length: Tensor,
) -> tuple[Tensor, Tensor]:
    """The candidates in draft ids and their copy weights, for a head over a (possibly reduced) draft vocabulary.

    Args:
        gate: the head's `CopyGate`; to_draft_ids: target ids -> draft ids (`missing` for the ones outside);
        embed: target ids (...) -> (..., E) their embeddings.
        state: (..., X) what the gate reads beside the candidate (the state the vocabulary head reads).
        cand: (...) long target ids (-1: no candidate); length: (...) long match lengths (0: none).

    Returns:
        draft ids (...) long (0 where there is none) and lam (...) float32, 0 where there is no candidate or it is
        outside the draft vocabulary.
    """
    draft = to_draft_ids(cand, missing=-1)  # (...)
    length = length.to(draft.device).masked_fill(draft < 0, 0)
    lam = gate(state, embed(cand.clamp_min(0).to(draft.device)), length)  # (...)
    return draft.clamp_min(0), lam


def mix_logits(logits: Tensor, cand: Tensor, lam: Tensor, chunk_rows: int | None = None) -> Tensor:
    """Logits of the mixture (1 - lam) * softmax(logits) + lam * onehot(cand), changing the candidate's logit only.

    With p_c = softmax(logits)[c] and pi = (1 - lam) p_c + lam, the candidate's new logit is
    logit(pi) + logsumexp_{j != c}(logits_j); every other token keeps its logit, so its probability becomes
    (1 - lam) p_j. Rows with lam == 0 are returned unchanged. One pass over the logits forward and one backward,
    over chunks of rows in float32 (as `models.losses.distill_loss`): no float32 copy of a (N, V) bf16 tensor.

    Args:
        logits: (..., V) float; cand: (...) long in [0, V); lam: (...) float in [0, 1) (differentiable).
        chunk_rows: rows per chunk (None: `layers.rows_per_chunk`'s default).

    Returns:
        (..., V) logits, logits' dtype.
    """
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)  # (M, V)
    out = _MixLogits.apply(flat, cand.reshape(-1), lam.reshape(-1), rows_per_chunk(chunk_rows, flat))
    return out.reshape(logits.shape)


def mix_log_probs(logits: Tensor, cand: Tensor, lam: Tensor) -> Tensor:
    """Log-probabilities of the mixture (1 - lam) * softmax(logits) + lam * onehot(cand), float32 (float64 stays),
    at decode time: `log_softmax(mix_logits(logits, cand, lam))` without its logsumexp pass and copy (one
    log-softmax, then every token shifted by log(1 - lam) and the candidate set to log(pi)). Not differentiable
    in `lam` through the candidate's entry the way `mix_logits` is; training uses `mix_logits`.

    Args:
        logits: (..., V) float; cand: (...) long in [0, V); lam: (...) float in [0, 1).

    Returns:
        (..., V) log-probabilities; rows with lam == 0 equal log_softmax(logits).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)  # (..., V)
    info = torch.finfo(dtype)
    lam = lam.to(dtype).clamp(0.0, 1 - info.eps)[..., None]  # (..., 1)
    l_c = logp.gather(-1, cand[..., None])  # (..., 1)
    pi = ((1 - lam) * l_c.exp() + lam).clamp(info.tiny, 1.0)  # (..., 1)
    out = logp.add_(torch.log1p(-lam))  # (..., V): every other token keeps (1 - lam) of its probability
    return out.scatter_(-1, cand[..., None], torch.where(lam > 0, pi.log(), l_c))


def _mix_terms(l_c: Tensor, lse: Tensor, lam: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(p_c, pi, new candidate logit) (M,) each, in lse's float dtype, kept inside (0, 1) for the log-odds."""
    info = torch.finfo(lse.dtype)
    p_c = torch.exp(l_c - lse).clamp(info.tiny, 1 - info.eps)
    pi = ((1 - lam) * p_c + lam).clamp(info.tiny, 1 - info.eps)
    return p_c, pi, torch.log(pi) - torch.log1p(-pi) + lse + torch.log1p(-p_c)


class _MixLogits(torch.autograd.Function):
    """`mix_logits` on (M, V) rows. Backward: out_c = f(l_c, lse(l), lam), every other out_j = l_j, so
    d/dl_j gets g_j + g_c (1 - A p_c) s_j (s = softmax(l)) and d/dl_c gets g_c (A p_c + (1 - A p_c) p_c), with
    A = (1 - lam) / (pi (1 - pi)) - 1 / (1 - p_c); d/dlam = g_c (1 - p_c) / (pi (1 - pi))."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, cand: Tensor, lam: Tensor, chunk: int) -> Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # (M,)
        for r in range(0, logits.shape[0], chunk):
            lse[r : r + chunk] = torch.logsumexp(logits[r : r + chunk].to(dtype), dim=-1)
        l_c = logits.gather(-1, cand[:, None])[:, 0].to(dtype)  # (M,)
        lam_f = lam.detach().to(dtype)
        p_c, pi, new = _mix_terms(l_c, lse, lam_f)
        on = lam_f > 0  # (M,) rows with a candidate
        out = logits.clone()
        # rows without a candidate get their own logit back: no host sync (a CUDA graph captures this)
        keep = torch.where(on, new.to(out.dtype), logits.gather(-1, cand[:, None])[:, 0])  # (M,)
        out.scatter_(-1, cand[:, None], keep[:, None])
        ctx.save_for_backward(out, cand, lse, l_c, lam_f, p_c, pi, on)
        ctx.chunk, ctx.lam_dtype = chunk, lam.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, Tensor, None]:  # type: ignore[override]
        out, cand, lse, l_c, lam, p_c, pi, on = ctx.saved_tensors
        g_c = grad.gather(-1, cand[:, None])[:, 0].to(lse.dtype) * on  # (M,) upstream grad of the new logit
        a = (1 - lam) / (pi * (1 - pi)) - 1 / (1 - p_c)  # (M,)
        w = g_c * (1 - a * p_c)  # (M,) weight of softmax(l) in every row's gradient
        grad_in = torch.empty_like(grad)
        for r in range(0, out.shape[0], ctx.chunk):
            sl = slice(r, r + ctx.chunk)
            s = torch.exp(
                out[sl].to(lse.dtype) - lse[sl, None]
            )  # (m, V): softmax, but wrong at c (fixed below)
            grad_in[sl] = (grad[sl].to(lse.dtype) + w[sl, None] * s).to(grad.dtype)
        rows = on.nonzero()[:, 0]
        c = cand[rows]
        grad_c = g_c[rows] * (a[rows] * p_c[rows] + (1 - a[rows] * p_c[rows]) * p_c[rows])
        grad_in[rows, c] = grad_c.to(grad.dtype)  # out_c depends on l_c only through f
        grad_lam = (g_c * (1 - p_c) / (pi * (1 - pi))).to(ctx.lam_dtype)
        return grad_in, None, grad_lam, None
