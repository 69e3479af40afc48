"""Medusa's static tree filled through the heads' copy gate (`models/medusa_copy.py`), on the host.

The heads run once per step, as without a gate (as one C call on a CPU where it runs, `eval/medusa_native.py`, else
torch): each head's residual-block output g_k (d, H), its vocabulary logits (d, Vd) with their logsumexp, and its
k best ids. Then depth by depth, every node with children in the tree looks its candidate up on the committed
tokens + the root + its path (`CopyContext`'s `NgramIndex`), the gate weighs all of that depth's candidates in one
call, and the node's children are the ranks the tree asks for in its own mixture (`medusa_copy.mixture_ranks`).
Which tokens are drafted changes, never the output: the verification is the target's (lossless).

One host read per depth (the candidates' log-probabilities and copy weights) plus one for the heads' top-k: for
the CPU's small trees (2-8 nodes); the fixed-shape GPU draft graph is not used with a gate (`MedusaProposer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from specdraft.eval.copy_context import CopyContext
from specdraft.models.medusa_copy import copy_ngram, mixture_ranks

if TYPE_CHECKING:
    from specdraft.eval.medusa_native import MedusaNative
    from specdraft.models.medusa import Medusa


class CopyTreeFill:
    """Fills a static Medusa tree from gated heads.

    Args:
        drafter: the Medusa heads (with `copy`, their gate); search: what runs the heads (the drafter or its int8
            view: `head_states`); linears: int8 copies of the vocabulary Linears (None: the heads' own).
        parents, depth: (N,) the tree's layout (root at index 0, parent -1); rank: (N,) each node's rank among
            its parent's children; device: the drafter's device.
        native: the heads' one-call C copy (`eval/medusa_native.py`: top-k, states and logits through int8
            products) where it runs, else None (torch).
    """

    def __init__(
        self,
        drafter: Medusa,
        search: Medusa,
        linears: Sequence[Callable[[Tensor], Tensor]] | None,
        parents: Tensor,
        depth: Tensor,
        rank: Tensor,
        device: torch.device,
        native: MedusaNative | None = None,
    ) -> None:
        assert drafter.copy is not None, "CopyTreeFill: the heads have no copy gate (copy_ngram = 0)"
        self.drafter, self.search, self.linears, self.native = drafter, search, linears, native
        self.parents, self.depth, self.rank = parents.tolist(), depth.tolist(), rank.tolist()
        self.ctx = CopyContext(copy_ngram(drafter.config), device, 1)

    def reset(self) -> None:
        """Forget the previous prompt's tokens."""
        self.ctx.reset()

    @torch.inference_mode()
    def fill(self, hidden: Tensor, tokens: Tensor, nodes: int, ranks: int, heads: int) -> Tensor:
        """The tree's first `nodes` tokens.

        Args:
            hidden: (H,) the target state at the newest committed position.
            tokens: (n,) the newly committed positions' next tokens; tokens[-1] is the root.
            nodes: N, the nodes proposed; ranks, heads: the k and the heads those nodes need.

        Returns:
            (N,) long target ids on `tokens`' device; node 0 is the root.
        """
        index = self.ctx.update_index(tokens)  # every call: the committed tokens stay in step
        root = int(tokens[-1])
        out = [root] * nodes
        if nodes > 1:
            model = self.drafter
            top, states, logits = self._heads(hidden, tokens[-1], ranks, heads)  # (d, k), (d, H), (d, Vd)
            lse = torch.logsumexp(logits, dim=-1)  # (d,)
            top_ids = top.tolist()
            top_vals = (logits.gather(1, top) - lse[:, None]).tolist()  # their log-probabilities
            kids: dict[int, list[int]] = {}  # node -> its children's draft ids by rank (its mixture's best)
            paths: dict[int, list[int]] = {0: [root]}  # node -> target ids from the root to it
            for d in range(heads):
                level = [i for i in range(1, nodes) if self.depth[i] == d + 1]
                if not level:
                    break
                parents = sorted({self.parents[i] for i in level})
                found = [index.lookup(paths[p]) for p in parents]  # (candidate, match length) each
                dev = states.device
                cand = torch.tensor([c for c, _ in found], dtype=torch.long, device=dev)  # (P,)
                length = torch.tensor([m for _, m in found], dtype=torch.long, device=dev)  # (P,)
                assert model.copy is not None
                g = states[d].expand(len(parents), -1)  # (P, H) the head's state, one per parent
                draft, lam = model.copy.candidates(model, g, cand, length)  # (P,) each
                cand_lp = logits[d].gather(0, draft.to(logits.device)) - lse[d]  # (P,) log-probabilities
                # lam is 0 where there is no candidate or it is outside the draft vocabulary: the head's own ranks
                for p, c, lp, w in zip(parents, draft.tolist(), cand_lp.tolist(), lam.tolist(), strict=True):
                    kids[p] = mixture_ranks(top_ids[d], top_vals[d], c, lp, w)
                ids = [kids[self.parents[i]][self.rank[i]] for i in level]
                targets = cast(
                    Tensor, model.to_target_ids(torch.tensor(ids, device=model.d2t.device))
                ).tolist()
                for i, t in zip(level, targets, strict=True):
                    out[i] = t
                    paths[i] = paths[self.parents[i]] + [t]
        return torch.tensor(out, dtype=torch.long, device=tokens.device)

    def _heads(self, hidden: Tensor, root: Tensor, ranks: int, heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """The first `heads` heads at one position: their `ranks` best draft ids (d, k), states (d, H) and
        float logits (d, Vd), through the C copy where there is one, else torch (int8 vocabulary products where
        there are some)."""
        if self.native is not None and hidden.dtype == torch.float32:
            return self.native.heads_out(hidden, root, ranks, heads)
        states = self.search.head_states(hidden, heads, root)  # (d, H)
        logits = self.search.vocab_logits(states, self.linears).float()  # (d, Vd)
        return logits.topk(ranks, dim=-1).indices, states, logits
