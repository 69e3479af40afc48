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

import numpy as np
import torch
from torch import Tensor

from specdraft.eval.copy_context import CopyContext
from specdraft.models.layers import CopyCache, weights_key
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
        self._by_count: dict[int, list[tuple[list[int], list[int]]]] = {}  # `_levels` per node count
        self.ctx = CopyContext(copy_ngram(drafter.config), device, 1)
        self.host = host_gate(drafter) if native is not None else None  # the gate beside the C call

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
            for d, (level, parents) in enumerate(self._levels(nodes)):
                found = [index.lookup(paths[p]) for p in parents]  # (candidate, match length) each
                draft, lam = self._gate(states[d], [c for c, _ in found], [m for _, m in found])  # (P,) each
                cand_lp = (logits[d, draft] - lse[d]).tolist()  # (P,) log-probabilities under the head
                # lam is 0 where there is no candidate or it is outside the draft vocabulary: the head's own ranks
                for p, c, lp, w in zip(parents, draft, cand_lp, lam, strict=True):
                    kids[p] = mixture_ranks(top_ids[d], top_vals[d], c, lp, w)
                ids = [kids[self.parents[i]][self.rank[i]] for i in level]
                targets = cast(
                    Tensor, model.to_target_ids(torch.tensor(ids, device=model.d2t.device))
                ).tolist()
                for i, t in zip(level, targets, strict=True):
                    out[i] = t
                    paths[i] = paths[self.parents[i]] + [t]
        return torch.tensor(out, dtype=torch.long, device=tokens.device)

    def _levels(self, nodes: int) -> list[tuple[list[int], list[int]]]:
        """Per depth 1, 2, ... of the first `nodes` nodes: (its nodes, their parents, sorted), made once per node
        count (the layout is static)."""
        if nodes not in self._by_count:
            levels = []
            for d in range(1, max(self.depth[:nodes]) + 1):
                level = [i for i in range(1, nodes) if self.depth[i] == d]
                levels.append((level, sorted({self.parents[i] for i in level})))
            self._by_count[nodes] = levels
        return self._by_count[nodes]

    def _gate(self, state: Tensor, cand: list[int], length: list[int]) -> tuple[list[int], list[float]]:
        """One head's copy weights for P candidates: state (H,) its output g_k; cand, length (P,) target ids
        (-1: none) and match lengths -> draft ids and lam (0: no candidate or outside the draft vocabulary), on the
        host next to the C call (`HostGate`), else through the gate's torch modules."""
        if self.host is not None and state.device.type == "cpu":
            return self.host(state.numpy(), cand, length)
        model = self.drafter
        assert model.copy is not None
        dev = state.device
        c = torch.tensor(cand, dtype=torch.long, device=dev)  # (P,)
        m = torch.tensor(length, dtype=torch.long, device=dev)  # (P,)
        draft, lam = model.copy.candidates(model, state.expand(len(cand), -1), c, m)  # (P,) each
        return draft.tolist(), lam.tolist()

    def _heads(self, hidden: Tensor, root: Tensor, ranks: int, heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """The first `heads` heads at one position: their `ranks` best draft ids (d, k), states (d, H) and
        float logits (d, Vd), through the C copy where there is one, else torch (int8 vocabulary products where
        there are some)."""
        if self.native is not None and hidden.dtype == torch.float32:
            return self.native.heads_out(hidden, root, ranks, heads)
        states = self.search.head_states(hidden, heads, root)  # (d, H)
        logits = self.search.vocab_logits(states, self.linears).float()  # (d, Vd)
        return logits.topk(ranks, dim=-1).indices, states, logits


class HostGate:
    """The heads' copy gate in numpy, for the fp32 states the C call hands back (`CopyGate`'s arithmetic: a few
    torch calls per depth cost more than the math on a P x 64 block). fc([g; E[c]]) splits into W_g g, one
    (G, H) product per head, and (E W_e^T)[c] + b, a row of a table made once per gate (V x G floats).

    Args:
        drafter: fp32 Medusa heads on the CPU with a copy gate, attached to their target.
    """

    def __init__(self, drafter: Medusa) -> None:
        assert drafter.copy is not None, "HostGate: the heads have no copy gate (copy_ngram = 0)"
        gate = drafter.copy.gate
        h = int(drafter.config.base_hidden_size)
        w = gate.fc.weight.detach().float()  # (G, 2H)
        emb = drafter.copy.borrowed.weight("embed", gate.fc.weight).detach().float()  # (V, H)
        self.wg = w[:, :h].contiguous().numpy()  # (G, H)
        self.table = (emb @ w[:, h:].T + gate.fc.bias.detach().float()).numpy()  # (V, G)
        self.out = gate.out.weight.detach().float()[0].numpy()  # (G,)
        self.out_b = float(gate.out.bias.detach()[0])
        self.length_bias = gate.length_bias.detach().float().numpy()  # (n + 1,)
        self.scale = float(gate.scale)
        v = int(drafter.config.vocab_size)
        self.t2d = drafter.to_draft_ids(torch.arange(v), missing=-1).cpu().numpy()  # (V,) draft id or -1

    def __call__(
        self, state: np.ndarray, cand: list[int], length: list[int]
    ) -> tuple[list[int], list[float]]:
        """state (H,) float32, cand (P,) target ids (-1: none), length (P,) -> draft ids (0 where none) and lam."""
        c = np.asarray(cand, dtype=np.int64)
        d = np.where(c >= 0, self.t2d[np.maximum(c, 0)], -1)  # (P,)
        m = np.where(d >= 0, np.asarray(length, dtype=np.int64), 0)  # (P,) no match outside the vocabulary
        u = self.wg @ state + self.table[np.maximum(c, 0)]  # (P, G)
        hidden = u * (0.5 + 0.5 * np.tanh(0.5 * u))  # SiLU (the tanh form of the sigmoid: no overflow)
        z = (hidden @ self.out + self.out_b + self.length_bias[m]) * self.scale  # (P,)
        lam = (0.5 + 0.5 * np.tanh(0.5 * z)) * (m > 0)
        return np.maximum(d, 0).tolist(), lam.tolist()


_HOST_GATES: CopyCache[HostGate] = CopyCache()


def host_gate(drafter: Medusa) -> HostGate:
    """The shared `HostGate` of `drafter` (one per gate and draft vocabulary; rebuilt when they change)."""
    assert drafter.copy is not None
    key = weights_key(*drafter.copy.gate.parameters(), drafter.d2t)
    return _HOST_GATES.get(drafter, key, lambda: HostGate(drafter))
