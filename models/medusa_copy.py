"""Copy gate for Medusa heads (an extension, off by default: `copy_ngram` = 0).

The ReDrafter's copy gate (`models/copy_lookup.py`) on Medusa's parallel heads. A small target repeats its prompt
and itself, and a head that reads h_t (and, with `root_token`, the root) but no earlier token cannot copy them:
in one eval run prompt lookup through our decoder served 1.84 tokens per step against the root-token heads' 1.29
(MT-Bench, docs/experiments.md "Session 58"). With `copy_ngram` = n > 0 every node of the static tree gets one
lookup candidate for its children,

    c = the token after the most recent earlier occurrence of the longest suffix m-gram (m <= n) of the committed
        tokens + the root + the node's path (prompt lookup, one token),

and head k's distribution below a node at depth k becomes (1 - lam) p_k + lam onehot(c), with
lam = CopyGate([g_k; E[c]], m): g_k is head k's last residual-block output (what its vocabulary projection reads)
and E the target's input embeddings (borrowed, never saved); lam = 0 for a candidate outside the draft vocabulary.
The heads still run once per step; only the candidates depend on the path. The static tree keeps its rank paths:
the child of rank r under a node is the r-th token of that node's mixture (`mixture_ranks`: the head's top-k with
the candidate moved to its rank in the mixture), so the trees of two parents differ only where their candidates do.

Training reads the candidates of the row's own text (slot k at position t: the lookup after x_0 .. x_{t+1+k},
`data.ngrams.slot_candidates` through `data.collate.Collator` with the family's declared `copy_ngram`), which is
the decode-time candidate of the node whose path follows the text. The gate starts at lam = 1/2 on every
candidate; warm-started from plain heads (`train.init_from`) every other tensor is copied.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.models.copy_lookup import CopyGate, gated_candidates, mix_logits
from specdraft.models.eagle_common import Borrowed

if TYPE_CHECKING:
    from specdraft.models.medusa import Medusa


def copy_ngram(config: Any) -> int:
    """`config.copy_ngram` of a Medusa config: the gate's n-gram order (0: no gate, exports older than the field
    included; the family's declared `FamilySpec.copy_ngram`)."""
    return int(getattr(config, "copy_ngram", 0) or 0)  # (duck-typed heads' configs may lack the field)


class MedusaCopy(nn.Module):
    """The heads' copy gate and the borrowed embeddings it reads candidates through.

    Args:
        hidden: H, the heads' width (= the target's embedding width).
        max_ngram: n, the longest suffix n-gram matched (`length_bias` has n + 1 entries).
        gate_hidden: the gate's hidden width; scale: the gate's log-odds multiplier (`CopyGate`).
    """

    def __init__(self, hidden: int, max_ngram: int, gate_hidden: int = 64, scale: float = 8.0) -> None:
        super().__init__()
        self.gate = CopyGate(hidden, hidden, max_ngram, gate_hidden, scale)
        self.borrowed = Borrowed()  # the target's input embeddings (`attach`), not in the state dict

    def attach(self, embed: nn.Module) -> None:
        """Borrow the target's input embeddings, an (V, H) `nn.Embedding` (after building or loading)."""
        self.borrowed.set("embed", embed)

    def embed(self, ids: Tensor) -> Tensor:
        """ids (...) long target ids -> (..., H) their target embeddings, in the gate's dtype."""
        w = self.gate.fc.weight
        return F.embedding(ids.to(w.device), self.borrowed.weight("embed", w))

    def candidates(self, model: Medusa, state: Tensor, cand: Tensor, length: Tensor) -> tuple[Tensor, Tensor]:
        """state (..., H) head outputs g_k, cand (...) target ids (-1: none), length (...) long -> draft ids (...)
        and lam (...) float32 (0: no candidate or outside the draft vocabulary; `copy_lookup.gated_candidates`)."""
        return gated_candidates(self.gate, model.to_draft_ids, self.embed, state, cand, length)


def build(config: Any) -> MedusaCopy | None:
    """The heads' `MedusaCopy` when `config.copy_ngram` > 0, else None."""
    n = copy_ngram(config)
    if n <= 0:
        return None
    return MedusaCopy(int(config.base_hidden_size), n, int(config.copy_hidden), float(config.copy_scale))


def mixed_head_logits(model: Medusa, states: Tensor, logits: Tensor, cand: Tensor, length: Tensor) -> Tensor:
    """Training: logits (..., D, Vd) of every head's mixture with its slot's candidate (differentiable in the heads
    and the gate: `copy_lookup.mix_logits`).

    Args:
        states: (..., D, H) the heads' outputs g_k; logits: (..., D, Vd) their vocabulary logits.
        cand, length: (..., D) each slot's candidate (target ids, -1: none) and match length (0: none).
    """
    assert model.copy is not None, "mixed_head_logits(): the heads have no copy gate (copy_ngram = 0)"
    draft, lam = model.copy.candidates(model, states, cand, length)
    return mix_logits(logits, draft, lam)


def mixture_ranks(
    top: list[int], top_logp: list[float], cand: int, cand_logp: float, lam: float
) -> list[int]:
    """The k best tokens of the mixture (1 - lam) p + lam onehot(cand), best first, from p's k best.

    Every other token keeps its order (its probability scales by 1 - lam); the candidate's becomes
    (1 - lam) p_c + lam, so it moves up to its place (or enters the list, pushing the last one out).

    Args:
        top: p's k best ids, best first; top_logp: their log-probabilities.
        cand: the candidate's id (in the same vocabulary); cand_logp: its log-probability under p.
        lam: its copy weight (0: the list unchanged).
    """
    if lam <= 0.0:
        return list(top)
    k = len(top)
    lam = min(lam, 1.0 - 1e-12)  # a saturated gate: 1 - lam kept positive, as `mix_log_probs` does
    mixed = math.log((1.0 - lam) * math.exp(cand_logp) + lam)  # its log-probability in the mixture
    shift = math.log1p(-lam)  # every other token's log-probability moves by this
    rest = [(t, lp) for t, lp in zip(top, top_logp, strict=True) if t != cand]
    at = sum(1 for _, lp in rest if lp + shift > mixed)  # tokens still ahead of it
    return ([t for t, _ in rest[:at]] + [cand] + [t for t, _ in rest[at:]])[:k]
