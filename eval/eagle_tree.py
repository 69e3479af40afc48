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
   best first (parents[i] < i) under the committed root as a `DraftTree`, so its first b nodes are the tree a
   budget of b - 1 would keep.

`depth` counts draft tokens below the root, so `depth` = 1 gives a one-level tree of `min(k, total_tokens)`
nodes. Verification (greedy or sampling) is the shared core's, so decoding stays lossless.

`static=True` runs the same expansion and reranking with fixed shapes and no host sync (`eval/eagle_static.py`:
a preallocated head cache with a length counter, device-side masks and positions), so every tree has
1 + min(total_tokens, k + (depth-1)*k*k) nodes and, with `graphs=True` on CUDA, the expansion is one CUDA
graph replay (one graph per size: `fit_budget` picks among the node budget's few sizes). Only the commit
of the n newly accepted positions stays eager (n varies per call).

A head with a copy gate (`models/eagle_copy.py`, the family's declared `copy_ngram` > 0) mixes every expanded
node's distribution with its prompt-lookup candidate, looked up on the committed tokens + the root + the node's
path: on the host in the dynamic expansion (`NgramIndex`, one sync per level), on the device in the fixed-shape
one (`copy_lookup.lookup_fixed_rows` over a buffer of the committed tokens: no sync, so a CUDA graph captures it).
Batch rows drafted together look up in their own committed tokens (`host_lookups` over each row's index, or
`lookup_fixed_rows` over the rows' stacked buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor
from transformers import DynamicCache

from specdraft.data.ngrams import NO_CANDIDATE, NgramIndex
from specdraft.eval.copy_context import CopyContext
from specdraft.eval.eagle_chain import ChainLog, EagleChain, make_chain
from specdraft.eval.eagle_static import StaticHeadState, fixed_ancestors
from specdraft.eval.kv import rollback
from specdraft.eval.tree import DraftTree, ProposerSpec
from specdraft.models.attention import varying_shape_sdpa
from specdraft.models.copy_lookup import lookup_fixed_rows
from specdraft.models.eagle_common import DraftBlock, causal_tree_mask
from specdraft.models.eagle_copy import mixed_log_probs
from specdraft.models.registry import spec_of

if TYPE_CHECKING:
    from specdraft.eval.decode import Proposer
    from specdraft.eval.eagle_rows import RowGroup
    from specdraft.eval.eagle_static_rows import StaticRows
    from specdraft.models.eagle import EagleDrafter
    from specdraft.models.eagle3 import Eagle3Drafter

# one expansion level: (level, rows (k, s) ancestors-or-self among draft entries, feats (k, H), toks (k,)) -> (k, H)
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
# the same for G rows at once: (level, rows (G, k, s), feats (G, k, H), toks (G, k)) -> (G, k, H)
AttendRows = Callable[[int, Tensor, Tensor, Tensor], Tensor]
# a copy gate's lookups of G rows: chains (G, j, c) -> candidates and match lengths (G, j) each, or None where
# no chain has a candidate (the gate would be 0 everywhere)
Lookup = Callable[[Tensor], "tuple[Tensor, Tensor] | None"]
# how the head's decoder layer runs while drafting (`eval.draft_block`; `eval/draft_block.py`)
DRAFT_BLOCKS = ("auto", "hf", "fused", "int8")


def select_nodes(
    tok: Tensor, par: Tensor, score: Tensor, depth: Tensor, total: int
) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-2 reranking with fixed shapes: the `total` best candidates, best first, of one pool or of a batch
    of pools (leading dimensions `...`, one per row).

    Best first (score descending, ties shallower first) puts every parent before its children (a child never
    outscores its parent) and makes the first b nodes the tree EAGLE-2 keeps for a budget of b - 1
    (`DraftTree.truncated`: the decoder's node budget on the static path).

    Args:
        tok, par, score, depth: (..., P) the candidate pool (`grow`); par = pool index, -1 = root.
        total: nodes kept (root excluded).

    Returns:
        tokens (..., N) and parents (..., N) of the kept nodes, N = min(total, P), and their pool indices
        (..., N); parents are tree node indices (0 = root, nodes numbered from 1), -1 where a parent was not
        kept (impossible for monotone scores).
    """
    p = tok.shape[-1]
    order = torch.sort(depth, dim=-1, stable=True).indices  # ties in score: shallower first, then pool order
    by_score = torch.sort(score.gather(-1, order), dim=-1, descending=True, stable=True).indices
    keep = order.gather(-1, by_score)[..., : min(total, p)]  # (..., N) best first: parents before children
    numbers = torch.arange(1, keep.shape[-1] + 1, device=tok.device).expand_as(keep)  # (..., N)
    node = torch.full_like(tok, -1).scatter(-1, keep, numbers)  # (..., P)
    kp = par.gather(-1, keep)
    parents = torch.where(kp < 0, torch.zeros_like(kp), node.gather(-1, kp.clamp_min(0)))
    return tok.gather(-1, keep), parents, keep


class EagleTreeProposer:
    """EAGLE-2 dynamic tree over an EAGLE head (`EagleDrafter` or `Eagle3Drafter`).

    Args:
        drafter: exposes `encode_target`, `step`, `draft_logits`, `to_target_ids` (models/eagle.py contract).
        total_tokens: N, draft nodes kept after reranking (root excluded).
        depth: maximum draft depth below the root.
        top_k: children per expanded node and nodes expanded per depth.
        int8_head: on CPU, draft with a dynamic-int8 copy of the vocabulary head (`proposers.Int8Linear`).
        static: fixed-shape, host-sync-free expansion and reranking over a preallocated head cache (see the
            module docstring); trees of 1 + min(total_tokens, pool) nodes, fixed per budget size.
        graphs: with `static` and the head on CUDA, capture the expansion once as a CUDA graph.
        early_stop: stop expanding once no deeper node can enter the kept set (`grow_rows`; the same tree with
            fewer head passes, one host sync per level, so never inside a CUDA graph).
        draft_block: "hf" runs the head's HF decoder layer; "fused" / "int8" a decode-time copy with fused
            (and int8) products on a CPU (`eval/draft_block.py`; other devices and layers: "hf"); "auto" int8
            where the family declares `int8_draft_layer`, else fused.

    Attributes:
        target_layers: target `hidden_states` indices the decoder must pass instead of the last layer
            (EAGLE-3; empty for EAGLE-1).
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        total_tokens: int,
        depth: int,
        top_k: int,
        int8_head: bool = False,
        static: bool = False,
        graphs: bool = False,
        early_stop: bool = True,
        draft_block: str = "hf",
    ) -> None:
        if min(total_tokens, depth, top_k) < 1:
            raise ValueError(
                f"EagleTreeProposer: total_tokens={total_tokens}, depth={depth}, top_k={top_k} must be >= 1"
            )
        drafter = cast("EagleDrafter | Eagle3Drafter", drafter)  # duck-typed: the EAGLE head contract
        self.drafter = drafter
        self.total_tokens, self.depth, self.top_k = int(total_tokens), int(depth), int(top_k)
        self._full = (self.total_tokens, self.depth)  # the sizes `fit_budget` caps (and restores)
        # the intermediate layers the family declares it reads (EAGLE-3: `config.target_layers`; EAGLE-1: none)
        self.target_layers: tuple[int, ...] = spec_of(drafter).layers_for(drafter.config)
        self.spec = ProposerSpec(
            feature_layers=self.target_layers, max_depth=self.depth, node_budget=1 + self.total_tokens
        )
        self.last_compression: float | None = None  # trees are built node by node, not packed from beams
        self.cache = DynamicCache()
        self.committed = 0
        self.last_pool: dict[str, Tensor] | None = None  # candidates of the latest call (tests, analysis)
        self.early_stop = bool(early_stop)
        self.last_levels = 0  # head passes of the latest expansion (early stop: fewer than depth - 1)
        # rows drafted together (`propose_rows`): the group whose buffer holds this row's positions, its slot
        self.group: RowGroup | None = None
        self.slot = 0
        # static rows drafted together (`eval/eagle_static_rows.py`): the batch's shared state, this row's slot
        self.static_rows: StaticRows | None = None
        self.rows_slot = 0
        # int8 copy of the draft vocabulary head (CPU): only the drafts change, never the output
        self.int8: tuple[torch.nn.Module, torch.nn.Module] | None = None
        if int8_head and next(drafter.parameters()).device.type == "cpu":
            from specdraft.eval.proposers import int8_copy, int8_supported

            pre, head = drafter.draft_head()
            self.int8 = (pre, int8_copy(head)) if int8_supported() else None
        self.block = _draft_block(drafter, draft_block)  # the head's layer as fused products (CPU) or None
        # the int8 search on a CPU drafts capped budgets as one chain through C (`eval/eagle_chain.py`)
        self.chain: EagleChain | None = None
        if not static and self.int8 is not None and _int8_layers(drafter, draft_block):
            self.chain = make_chain(drafter)
        self.chain_log = ChainLog()
        # copy gate (declared by the family): the committed tokens before the root, indexed on the host
        # (dynamic expansion) or in a device buffer (fixed shape: a graph input, doubled when full: recapture)
        self.copy_ngram = spec_of(drafter).copy_ngram_of(drafter.config)
        room = (2048 if graphs else 256) if self.copy_ngram and static else 1
        self.copy_ctx = CopyContext(self.copy_ngram, next(drafter.parameters()).device, room)
        slots = (self.depth - 1) * self.top_k  # draft entries one expansion writes to the head cache
        # under graphs the head cache starts with room for 2,048 positions: each growth recaptures every size
        room = 2048 if graphs else 256
        self.fixed = (
            StaticHeadState(
                drafter,
                slots,
                self.top_k,
                graphs,
                capacity=room,
                block=self.block,
                commit_rows=self._full[1] + 1,
            )
            if static
            else None
        )
        self.static, self.graphs = static, self.fixed is not None and self.fixed.graphs

    def reset(self) -> None:
        """Forget the previous prompt's cache."""
        self.cache = DynamicCache()
        self.committed = 0
        self.copy_ctx.reset()
        self.chain_log.reset()
        if self.chain is not None:
            self.chain.reset()
        if self.fixed is not None:
            self.fixed.reset()
        if self.group is not None:  # stays a member, with an empty slot
            self.group.reset(self)

    def fit_budget(self, nodes: int) -> None:
        """Keep at most `nodes - 1` draft nodes and a depth of `nodes - 1` (fewer head passes); a larger cap
        (a refit: `budget.FULL`) restores the full sizes. In the static mode each size is its own fixed
        shape (and CUDA graph, captured once per size): a budget cut to 2 nodes runs no head pass past the
        commit instead of expanding the full tree and dropping most of it."""
        self.total_tokens = min(self._full[0], max(nodes - 1, 1))
        self.depth = min(self._full[1], max(nodes - 1, 1))

    @torch.inference_mode()
    def commit(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Append the newly committed pairs to the head's cache (`DynamicCache`, or the static `HeadKVCache`).

        Args:
            hidden: (n, F) target features (last layer, or the concatenated `target_layers` for EAGLE-3).
            tokens: (n,) the token each position predicts.

        Returns:
            (n, H) the head's outputs at those positions.
        """
        if self.group is not None:  # drafting alone again: its positions come back from the group
            self.group.leave(self)
        if self.fixed is not None:  # the preallocated head cache (eager: n varies per call)
            out = self.fixed.commit(hidden, tokens)
            self.committed = self.fixed.cache.length
            return out
        d = self.drafter
        dev = next(d.parameters()).device
        rollback(self.cache, self.committed)  # drop the previous call's draft entries
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_zeros(0, d.config.base_hidden_size)
        pos = torch.arange(self.committed, self.committed + n, device=dev)[None]  # (1, n)
        mask = causal_tree_mask(n, self.committed + n, dev)  # (n, C + n)
        g = d.encode_target(hidden.to(dev), self.block)[None]  # (1, n, H)
        with varying_shape_sdpa(dev):  # n and the cache length change every call
            out = d.step(g, tokens.to(dev)[None], self.cache, pos, mask, self.block)[0]
        self.committed += n
        return out

    @torch.inference_mode()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """Commit the new positions, grow the dynamic tree, rerank, pack (fixed shapes with `static`).

        Args:
            hidden: (n, F) target features of the newly committed positions.
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            DraftTree of 1 + min(total_tokens, candidates) nodes, root = tokens[-1].
        """
        if self.fixed is not None:  # commit + expansion in one fixed-shape step (a CUDA graph under graphs)
            size = (self.total_tokens, self.depth)
            if self.copy_ngram and self.copy_ctx.commit(tokens):  # the buffer moved: capture again
                self.fixed.captured, self.fixed.graph = {}, None
            res = self.fixed.run(self._expand_fixed, hidden, tokens, size)
            self.committed = self.fixed.cache.length
            self.graphs = self.fixed.graph is not None
            tree_tok, parents, depth, anc = (t.clone() for t in res)  # graph outputs are overwritten
            return DraftTree(tree_tok, parents, depth, anc).to(tokens.device)
        if self.copy_ngram:  # index the committed tokens before the new root: the previous root, tokens[:-1]
            self.copy_ctx.update_index(tokens)
        if self.chain is not None:  # both caches take the positions they have not seen from one log
            self.chain_log.add(hidden, tokens)
            native = self.chain_now()
            lag = self.chain_log.take("native" if native else "torch")
            assert lag is not None  # (at least this call's positions)
            if native:
                if self.group is not None:  # after rows drafted together: its positions back from the group
                    self.group.leave(self)
                index = self.copy_ctx.index if self.copy_ngram else None
                chain, cum = self.chain.propose(lag[0], lag[1].tolist(), self.depth, index)
                self.last_pool, self.last_levels = None, self.depth - 1
                return self.chain.tree(chain, cum).to(tokens.device)
            hidden, tokens = lag
        out = self.commit(hidden, tokens)  # (n, H)
        tok, par, score, depth = self.grow(out[-1], root=tokens[-1:])
        return self.rerank(tokens[-1:], tok, par, score, depth, tokens.device)

    def chain_now(self) -> bool:
        """Whether `propose` drafts through the native chain: one is built and a node budget capped the tree
        (`fit_budget` below the full sizes: a chain of `depth` tokens, its probes and refits included); full-size
        trees are EAGLE-2's, in torch."""
        return self.chain is not None and (self.total_tokens, self.depth) != self._full

    def sync_rows(self, hidden: Tensor, tokens: Tensor) -> None:
        """Before this row drafts with others in torch (`propose_rows`): its torch cache takes the positions only
        the native chain has seen, and this call's positions (hidden (n, F), tokens (n,)), which the rows' step
        commits, are logged as the torch cache's, for the chain's next call when the row drafts alone."""
        if self.chain is None:
            return
        lag = self.chain_log.take("torch")
        if lag is not None:  # positions only the native chain has seen
            self.commit(*lag)
        self.chain_log.add(hidden, tokens, seen_by="torch")

    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """Every row's `propose`: in the dynamic mode each expansion level one head pass for all rows
        (`eval/eagle_rows.py`); in the static mode one fixed-shape step for all rows, one CUDA graph under
        `graphs` (`eval/eagle_static_rows.py`). None (nothing changed) unless every row is an
        `EagleTreeProposer` of this head, mode, tree size and draft block. With int8 products
        (`draft_block="int8"`, `int8_head`) activations are quantised per call, so a row's tree may differ at
        rounding level from its own `propose`'s (the output never does).

        Args:
            rows: R proposers (this one among them); hidden: R of (n_i, F); tokens: R of (n_i,).
        """
        same = all(
            isinstance(p, EagleTreeProposer)
            and (p.fixed is None) == (self.fixed is None)
            and p.graphs == self.graphs
            and p.drafter is self.drafter
            and (p.total_tokens, p.depth, p.top_k, p._full)
            == (self.total_tokens, self.depth, self.top_k, self._full)
            and (p.int8[1] if p.int8 else None) is (self.int8[1] if self.int8 else None)  # one int8 head
            and p.block is self.block
            for p in rows
        )
        if not same:
            return None
        ps = cast("list[EagleTreeProposer]", list(rows))
        if len(ps) == 1 and ps[0].chain_now():  # a row drafting alone (batch 1, a queue's tail): its chain
            return [ps[0].propose(hidden[0], tokens[0])]
        for p, h, t in zip(ps, hidden, tokens, strict=True):  # rows together draft in torch
            p.sync_rows(h, t)
        if self.fixed is not None:
            from specdraft.eval.eagle_static_rows import propose_static_rows

            return propose_static_rows(self, ps, list(hidden), list(tokens))
        from specdraft.eval.eagle_rows import propose_rows

        return propose_rows(self, ps, list(hidden), list(tokens))

    def _expand_fixed(self, last: Tensor, root: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Fixed-shape expansion + reranking (what the CUDA graph captures): last (H,), root (1,) ->
        tokens (N,), parents (N,), depth (N,), ancestors (N, N) with N = 1 + min(total_tokens, P)."""
        assert self.fixed is not None
        tok, par, score, depth = self.grow(last, self.fixed.attend, root=root if self.copy_ngram else None)
        kept, kept_par, _ = select_nodes(tok, par, score, depth, self.total_tokens)  # (N - 1,) each
        tokens = torch.cat([root, kept])  # (N,)
        parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=last.device), kept_par])  # (N,)
        anc, node_depth = fixed_ancestors(parents, self.depth)
        return tokens, parents, node_depth, anc

    def _topk(
        self, out: Tensor, chains: Tensor | None = None, lookup: Lookup | None = None
    ) -> tuple[Tensor, Tensor]:
        """(G * j, H) head outputs -> top-k log-probs (G * j, k) float32 and target token ids (G * j, k); with a
        copy gate, `chains` (G, j, c) are each node's root + path (its lookup candidate's context after its
        row's committed tokens), looked up by `lookup` (None: this proposer's own, one row, `_lookup`)."""
        cand = length = None  # (G * j,) each: the nodes' lookup candidates (a copy gate)
        if chains is not None:
            found = (lookup or self._lookup)(chains)
            if found is not None:
                cand, length = found[0].reshape(-1), found[1].reshape(-1)
        if cand is not None and length is not None:  # the gate's mixture
            pre, head = self.int8 if self.int8 is not None else self.drafter.draft_head()
            state = pre(out)  # (m, H) what the vocabulary head and the gate read
            logp = mixed_log_probs(self.drafter, state, head(state), cand, length)
        elif self.int8 is not None:
            logp = torch.log_softmax(self.int8[1](self.int8[0](out)).float(), dim=-1)  # (m, Vd)
        else:
            logp = torch.log_softmax(self.drafter.draft_logits(out).float(), dim=-1)  # (m, Vd)
        sc, ix = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        return sc, self.drafter.to_target_ids(ix)

    def _lookup(self, chains: Tensor) -> tuple[Tensor, Tensor] | None:
        """This proposer's own lookups (one row, G = 1): chains (1, j, c) -> (1, j) candidates and lengths, on
        the device with fixed shapes (no sync), or on the host, None when no chain has a candidate."""
        ctx = self.copy_ctx
        if self.fixed is not None:
            return lookup_fixed_rows(ctx.buf[None], ctx.length.reshape(1), chains, self.copy_ngram)
        assert ctx.index is not None, "the dynamic expansion indexes the committed tokens first"
        return host_lookups([ctx.index], chains)

    def grow(
        self, last: Tensor, attend: Attend | None = None, root: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Candidate pool from the newest committed output `last` (H,); fixed shapes, no host sync (but one
        per level with a copy gate).

        Args:
            last: (H,) head output at the newest committed position.
            attend: runs one frontier through the head (None: the dynamic `DynamicCache` step).
            root: (1,) the committed root (a copy gate's lookups start from it; None: no gate).

        Returns:
            tokens, parents (pool index, -1 = root), scores (cumulative log-prob), depths: each
            (P,) with P = k + (levels run) * k * k <= k + (depth - 1) * k * k (see `grow_rows`).
        """
        one = attend or self._attend_dynamic

        def attend_one(level: int, rows: Tensor, feats: Tensor, toks: Tensor) -> Tensor:
            return one(level, rows[0], feats[0], toks[0])[None]  # one row: (1, k, ...) <-> (k, ...)

        pool = [x[0] for x in self.grow_rows(last[None], attend_one, [0], root)]
        self.last_pool = dict(zip(("tokens", "parents", "scores", "depths"), pool))
        return pool[0], pool[1], pool[2], pool[3]

    def grow_rows(
        self,
        last: Tensor,
        attend: AttendRows,
        drafting: list[int],
        roots: Tensor | None = None,
        lookup: Lookup | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The candidate pools of G rows at once (one head pass per level for all of them).

        Early stop (`early_stop`, not while a CUDA graph captures): after a level, when in every row of
        `drafting` the best frontier score is <= the `total_tokens`-th best score in its pool, no deeper node
        can be kept (a child never outscores its parent, and ties go to the shallower node), so the expansion
        ends there: reranking keeps exactly the nodes the full expansion would (the same trees), for fewer
        head passes on unsure steps.

        Args:
            last: (G, H) head outputs at each row's newest committed position.
            attend: one frontier level of every row, (level, rows (G, k, s), feats (G, k, H), toks (G, k))
                -> (G, k, H).
            drafting: the rows whose trees are wanted (the others ride along).
            roots: (G,) each row's committed root, for a copy gate's lookups (None: no gate).
            lookup: a copy gate's lookups in each row's committed tokens (None: this proposer's own, G = 1).

        Returns:
            tokens, parents (pool index, -1 = root), scores (cumulative log-prob), depths: each (G, P) with
            P = k + (levels run) * k * k, and P >= total_tokens whenever the expansion stopped early (so
            static trees keep their size).
        """
        dev, g = last.device, last.shape[0]
        stop = self.early_stop and (self.fixed is None or not self.fixed.graphs)  # a host sync per level
        start = roots.reshape(g, 1) if self.copy_ngram and roots is not None else None  # (G, 1)
        sc, ids = self._topk(last, None if start is None else start[:, None], lookup)  # (G, k)
        k = sc.shape[1]
        paths = (  # (G, k, 2) root + path of every frontier node (copy gate only)
            None if start is None else torch.stack([start.expand(g, k), ids], dim=-1)
        )
        self.last_levels = 0
        toks, pars, scores = [ids], [torch.full((g, k), -1, device=dev)], [sc]
        depths = [torch.ones(g, k, dtype=torch.long, device=dev)]
        front = torch.arange(k, device=dev).expand(g, k)  # pool indices of the frontier
        front_score, front_tok, front_in = (
            sc,
            ids,
            last[:, None].expand(g, k, -1),
        )  # (G, k), (G, k), (G, k, H)
        front_slot = torch.full((g, k), -1, device=dev)  # draft-entry slot of each frontier node's parent
        s = (self.depth - 1) * k  # draft entries: level l's frontier at slots (l-1)*k .. l*k - 1
        anc = torch.zeros(g, s, s, dtype=torch.bool, device=dev)  # ancestor-or-self among draft entries
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        at = torch.arange(g, device=dev)[:, None]  # (G, 1)
        size = k
        for level in range(1, self.depth):
            base = (level - 1) * k
            rows = anc[at, front_slot.clamp_min(0)] & (front_slot >= 0)[..., None]  # (G, k, s) parents' rows
            rows[:, :, base : base + k] |= eye  # each node sees itself
            anc[:, base : base + k] = rows
            out = attend(level, rows[:, :, : base + k], front_in, front_tok)  # (G, k, H)
            csc, cids = self._topk(out.reshape(g * k, -1), paths, lookup)
            csc, cids = csc.reshape(g, k * k), cids.reshape(g, k * k)  # (G, k*k) children, parent-major
            cum = front_score.repeat_interleave(k, dim=1) + csc  # (G, k*k)
            toks.append(cids)
            pars.append(front.repeat_interleave(k, dim=1))
            scores.append(cum)
            depths.append(torch.full((g, k * k), level + 1, dtype=torch.long, device=dev))
            front_score, best = cum.topk(k, dim=-1)  # (G, k)
            front, front_tok = size + best, cids.gather(1, best)
            front_in = out.gather(1, (best // k)[..., None].expand(-1, -1, out.shape[-1]))  # (G, k, H)
            front_slot = base + best // k
            if paths is not None:  # (G, k, level + 2) the new frontier's paths
                parent = paths.gather(1, (best // k)[..., None].expand(-1, -1, paths.shape[-1]))
                paths = torch.cat([parent, front_tok[..., None]], dim=-1)
            size += k * k
            self.last_levels = level
            if stop and level < self.depth - 1 and size >= self.total_tokens:
                nth = torch.cat(scores, dim=1).topk(self.total_tokens, dim=-1).values[:, -1]  # (G,)
                if bool((front_score.amax(-1) <= nth)[drafting].all()):
                    break  # every deeper candidate scores <= nth and is deeper: none would be kept
        pool = [torch.cat(x, dim=1) for x in (toks, pars, scores, depths)]
        return pool[0], pool[1], pool[2], pool[3]

    def _attend_dynamic(self, level: int, rows: Tensor, feats: Tensor, toks: Tensor) -> Tensor:
        """One frontier (k nodes at depth `level`) through the head, appended to the `DynamicCache`.

        rows (k, s) ancestors-or-self among the s draft entries cached so far + this frontier; feats (k, H);
        toks (k,) -> (k, H)."""
        c, m = self.committed, rows.shape[0]
        mask = torch.cat([torch.ones(m, c, dtype=torch.bool, device=rows.device), rows], dim=1)  # (k, C + s)
        pos = torch.full((1, m), c - 1 + level, device=rows.device)  # frontier nodes sit at depth `level`
        with varying_shape_sdpa(feats.device):  # the dynamic cache grows every level
            return self.drafter.step(feats[None], toks[None], self.cache, pos, mask, self.block)[0]

    def rerank(
        self, root: Tensor, tok: Tensor, par: Tensor, score: Tensor, depth: Tensor, device: torch.device | str
    ) -> DraftTree:
        """Keep the `total_tokens` best candidates and lay them out depth by depth under the root (1,); the
        ancestors in `depth` fixed steps (`fixed_ancestors`: no host reads beyond the parent check)."""
        kept, parents, keep = select_nodes(tok, par, score, depth, self.total_tokens)
        if bool((parents < 0).any()):
            raise RuntimeError("EAGLE-2 rerank kept a node without its parent (non-monotone scores)")
        tokens = torch.cat([root.to(tok.device), kept])
        parents = torch.cat([torch.full((1,), -1, dtype=parents.dtype, device=tok.device), parents])
        anc, node_depth = fixed_ancestors(parents, self.depth)
        scores = torch.cat([score.new_zeros(1), score[keep]]).float().exp()  # (N,) path probabilities
        return DraftTree(
            tokens.to(device),
            parents.to(device),
            node_depth.to(device),
            anc.to(device),
            scores=scores.to(device),
        )


def _int8_layers(drafter: torch.nn.Module, kind: str) -> bool:
    """Whether `eval.draft_block` `kind` drafts `drafter`'s layer through int8 products ("int8", or "auto" where
    the family declares `int8_draft_layer`)."""
    from specdraft.eval.draft_block import resolve_kind

    return kind in DRAFT_BLOCKS and resolve_kind(kind, spec_of(drafter)) == "int8"


def _draft_block(drafter: torch.nn.Module, kind: str) -> DraftBlock | None:
    """The head's decode-time `FastBlock` for `kind` ("hf": None; "auto": "int8" where the family declares
    `int8_draft_layer`, else "fused"; "fused"/"int8": None off a CPU or for an unsupported layer)."""
    if kind not in DRAFT_BLOCKS:
        raise ValueError(f"draft_block={kind!r}: use one of {', '.join(DRAFT_BLOCKS)}")
    if kind == "hf":
        return None
    from specdraft.eval.draft_block import draft_block, resolve_kind

    kind = resolve_kind(kind, spec_of(drafter))
    layer, extra = cast("EagleDrafter | Eagle3Drafter", drafter).draft_layer()
    return draft_block(drafter, layer, extra, int8=kind == "int8")


def host_lookups(indexes: Sequence[NgramIndex | None], chains: Tensor) -> tuple[Tensor, Tensor] | None:
    """Host lookups of G rows (one sync): chains (G, j, c) -> candidates and match lengths (G, j) each on the
    chains' device, row g's in `indexes[g]` (None: a slot that does not draft, no candidates); None when no
    chain has a candidate (the gate would be 0 everywhere)."""
    looked = [
        [ix.lookup(c) if ix is not None else (NO_CANDIDATE, 0) for c in row]
        for ix, row in zip(indexes, chains.tolist(), strict=True)
    ]
    if not any(n for row in looked for _, n in row):
        return None
    cand = torch.tensor([[c for c, _ in row] for row in looked], dtype=torch.long, device=chains.device)
    length = torch.tensor([[n for _, n in row] for row in looked], dtype=torch.long, device=chains.device)
    return cand, length
