"""EAGLE-2 dynamic draft trees (arXiv 2406.16858) from an EAGLE-1 or EAGLE-3 head, as a `Proposer`.

Each `propose` call:

1. Feeds the newly committed pairs (f_i, x_{i+1}) into the head's own KV cache (after dropping the previous
   call's draft entries): the cache always holds exactly the committed positions, position i at rotary
   position i. The newest pair's output predicts the root's children.
2. Expansion: the root's top-k children form depth 1. At every further depth the current *frontier* (k nodes)
   runs through the head in one call (each node attends to the committed cache, its drafted ancestors and
   itself; position = that of its depth), every frontier node proposes its top-k children, all k*k children
   join the candidate pool with score = parent score + log p(child), and the k best by score become the next
   frontier. A node's input feature is its parent's output (EAGLE feeds predicted features back).
3. Reranking: the `total_tokens` best candidates by cumulative log-prob (ties: shallower first, then earlier)
   are kept. A child never outscores its parent, so the kept set is closed under ancestors; it is laid out
   depth by depth (parents[i] < i) under the committed root as a `DraftTree`.

`depth` counts draft tokens below the root, so `depth` = 1 gives a one-level tree of `min(k, total_tokens)`
nodes. Verification (greedy or sampling) is the shared core's, so decoding stays lossless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from transformers import DynamicCache

from specdraft.eval.kv import rollback
from specdraft.eval.tree import DraftTree, ProposerSpec
from specdraft.models.eagle_common import causal_tree_mask

if TYPE_CHECKING:
    from specdraft.models.eagle import EagleDrafter
    from specdraft.models.eagle3 import Eagle3Drafter


class EagleTreeProposer:
    """EAGLE-2 dynamic tree over an EAGLE head (`EagleDrafter` or `Eagle3Drafter`).

    Args:
        drafter: exposes `encode_target`, `step`, `draft_logits`, `to_target_ids` (models/eagle.py contract).
        total_tokens: N, draft nodes kept after reranking (root excluded).
        depth: maximum draft depth below the root.
        top_k: children per expanded node and nodes expanded per depth.
        int8_head: on CPU, draft with a dynamic-int8 copy of the vocabulary head (`proposers.Int8Linear`).

    Attributes:
        target_layers: target `hidden_states` indices the decoder must pass instead of the last layer
            (EAGLE-3; empty for EAGLE-1).
    """

    def __init__(
        self, drafter: torch.nn.Module, total_tokens: int, depth: int, top_k: int, int8_head: bool = False
    ) -> None:
        if min(total_tokens, depth, top_k) < 1:
            raise ValueError(
                f"EagleTreeProposer: total_tokens={total_tokens}, depth={depth}, top_k={top_k} must be >= 1"
            )
        drafter = cast("EagleDrafter | Eagle3Drafter", drafter)  # duck-typed: the EAGLE head contract
        self.drafter = drafter
        self.total_tokens, self.depth, self.top_k = int(total_tokens), int(depth), int(top_k)
        self.target_layers: tuple[int, ...] = tuple(
            int(i) for i in getattr(drafter.config, "target_layers", ()) or ()
        )
        self.spec = ProposerSpec(
            feature_layers=self.target_layers, max_depth=self.depth, node_budget=1 + self.total_tokens
        )
        self.last_compression: float | None = None  # trees are built node by node, not packed from beams
        self.cache = DynamicCache()
        self.committed = 0
        self.last_pool: dict[str, Tensor] | None = None  # candidates of the latest call (tests, analysis)
        # int8 copy of the draft vocabulary head (CPU): only the drafts change, never the output
        self.int8: tuple[torch.nn.Module, torch.nn.Module] | None = None
        if int8_head and next(drafter.parameters()).device.type == "cpu":
            from specdraft.eval.proposers import Int8Linear, int8_supported

            pre, head = drafter.draft_head()
            self.int8 = (pre, Int8Linear(head)) if int8_supported() else None

    def reset(self) -> None:
        """Forget the previous prompt's cache."""
        self.cache = DynamicCache()
        self.committed = 0

    @torch.inference_mode()
    def commit(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Append the newly committed pairs to the head's cache.

        Args:
            hidden: (n, F) target features (last layer, or the concatenated `target_layers` for EAGLE-3).
            tokens: (n,) the token each position predicts.

        Returns:
            (n, H) the head's outputs at those positions.
        """
        d = self.drafter
        dev = next(d.parameters()).device
        rollback(self.cache, self.committed)  # drop the previous call's draft entries
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_zeros(0, d.config.base_hidden_size)
        pos = torch.arange(self.committed, self.committed + n, device=dev)[None]  # (1, n)
        mask = causal_tree_mask(n, self.committed + n, dev)  # (n, C + n)
        out = d.step(d.encode_target(hidden.to(dev))[None], tokens.to(dev)[None], self.cache, pos, mask)[0]
        self.committed += n
        return out

    @torch.inference_mode()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """Commit the new positions, grow the dynamic tree, rerank, pack.

        Args:
            hidden: (n, F) target features of the newly committed positions.
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            DraftTree of 1 + min(total_tokens, candidates) nodes, root = tokens[-1].
        """
        out = self.commit(hidden, tokens)
        tok, par, score, depth = self.grow(out[-1])
        return self.rerank(int(tokens[-1]), tok, par, score, depth, tokens.device)

    def _topk(self, out: Tensor) -> tuple[Tensor, Tensor]:
        """(m, H) head outputs -> top-k log-probs (m, k) float32 and target token ids (m, k)."""
        if self.int8 is not None:
            logits = self.int8[1](self.int8[0](out))  # (m, Vd)
        else:
            logits = self.drafter.draft_logits(out)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (m, Vd)
        sc, ix = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        return sc, self.drafter.to_target_ids(ix)

    def grow(self, last: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Candidate pool from the newest committed output `last` (H,).

        Returns:
            tokens, parents (pool index, -1 = root), scores (cumulative log-prob), depths: each (P,).
        """
        dev, c = last.device, self.committed
        sc, ids = self._topk(last[None])  # (1, k)
        k = sc.shape[1]
        toks, pars, scores = [ids[0]], [torch.full((k,), -1, device=dev)], [sc[0]]
        depths = [torch.ones(k, dtype=torch.long, device=dev)]
        front = torch.arange(k, device=dev)  # pool indices of the frontier
        front_score, front_tok, front_in = sc[0], ids[0], last[None].expand(k, -1)  # (m,), (m,), (m, H)
        front_slot = torch.full(
            (k,), -1, device=dev
        )  # cache slot (among draft entries) of each node's parent
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # ancestor-or-self among cached draft entries
        size = k
        for level in range(1, self.depth):
            m, base = front.shape[0], anc.shape[0]
            rows = torch.zeros(m, base + m, dtype=torch.bool, device=dev)  # (m, base + m)
            has = front_slot >= 0
            rows[has, :base] = anc[front_slot[has]]
            rows[torch.arange(m, device=dev), base + torch.arange(m, device=dev)] = True
            anc = torch.cat([torch.nn.functional.pad(anc, (0, m)), rows], dim=0)  # (base + m, base + m)
            mask = torch.cat(
                [torch.ones(m, c, dtype=torch.bool, device=dev), rows], dim=1
            )  # (m, C + base + m)
            pos = torch.full((1, m), c - 1 + level, device=dev)  # frontier nodes sit at depth `level`
            out = self.drafter.step(front_in[None], front_tok[None], self.cache, pos, mask)[0]  # (m, H)
            csc, cids = self._topk(out)  # (m, k)
            cum = (front_score[:, None] + csc).reshape(-1)  # (m*k,)
            toks.append(cids.reshape(-1))
            pars.append(front.repeat_interleave(k))
            scores.append(cum)
            depths.append(torch.full((m * k,), level + 1, dtype=torch.long, device=dev))
            front_score, best = cum.topk(min(k, m * k))
            front, front_tok = size + best, cids.reshape(-1)[best]
            front_in, front_slot = out[best // k], base + best // k
            size += m * k
        pool = [torch.cat(x) for x in (toks, pars, scores, depths)]
        self.last_pool = dict(zip(("tokens", "parents", "scores", "depths"), pool))
        return pool[0], pool[1], pool[2], pool[3]

    def rerank(self, root: int, tok: Tensor, par: Tensor, score: Tensor, depth: Tensor, device) -> DraftTree:
        """Keep the `total_tokens` best candidates and lay them out depth by depth under the root."""
        p = tok.shape[0]
        order = torch.sort(depth, stable=True).indices  # ties in score: shallower first, then pool order
        order = order[torch.sort(score[order], descending=True, stable=True).indices]
        keep = order[: min(self.total_tokens, p)]
        keep = keep[torch.sort(depth[keep] * p + keep).indices]  # depth-major, parents before children
        node = torch.full((p,), -1, dtype=torch.long, device=tok.device)
        node[keep] = torch.arange(1, keep.shape[0] + 1, device=tok.device)
        kp = par[keep]
        parents = torch.where(kp < 0, torch.zeros_like(kp), node[kp.clamp_min(0)])
        if bool((parents < 0).any()):
            raise RuntimeError("EAGLE-2 rerank kept a node without its parent (non-monotone scores)")
        tokens = torch.cat([torch.tensor([root], device=tok.device), tok[keep]])
        parents = torch.cat([torch.tensor([-1], device=tok.device), parents])
        return DraftTree(tokens.to(device), parents.to(device))
