"""EAGLE-2 trees for several batch rows from one head call per level (`EagleTreeProposer.propose_rows`).

The batched decoder keeps one `EagleTreeProposer` per row. Drafting them one by one runs the head
(1 + levels) times per row and step; here the rows' proposers share a `RowGroup`: one head KV buffer
(G, kv_heads, capacity, head_dim) with a committed length per slot, in which every member's positions live
while it is grouped, so each level of every row's expansion is one head pass over (G, k) nodes:

    slot 0  [ committed (len_0) | level-1 frontier | level-2 frontier | ... | stale ]
    slot 1  [ committed (len_1)      | level-1 frontier | ...                  | stale ]

  * commit: the newly committed positions of the rows that draft, padded to the longest (n <= `SOLO`), are
    written at len_g + j in one pass (query j of slot g sees positions <= len_g + j); a row with more (its
    prompt, after a refill) commits alone first. Padding writes land past len_g: stale, never attended.
  * expansion: `EagleTreeProposer.grow` run for all slots at once (the same candidate pool per row), each
    level's k frontier nodes of slot g written at len_g + (level - 1) * k under a (G, 1, k, S) mask, S = the
    longest slot's committed positions + the draft entries (attention never reads the buffer's empty tail);
  * reranking: each row's own `rerank` on its own pool, so every row gets the tree its `propose` would give
    (same pool; int8 heads quantise the rows' activations together, which may move a near tie);
  * a copy gate: each row's nodes look their candidates up in that row's own committed tokens (its
    `copy_ctx` index, `eagle_tree.host_lookups`: one host sync per level for all rows).

Slots that do not draft this step (idle rows, a lookup chain drafting alone) ride along with dummy inputs
whose writes are stale. A member that is asked to `propose` alone leaves the group with its positions
(`leave`); a set of rows that is not one group's members is regrouped (each member's positions copied in).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from specdraft.data.ngrams import NgramIndex
from specdraft.eval.eagle_tree import host_lookups
from specdraft.eval.tree import DraftTree
from specdraft.models.attention import varying_shape_sdpa

if TYPE_CHECKING:
    from specdraft.eval.eagle_tree import EagleTreeProposer

SOLO = 16  # a row committing more new positions than this commits alone (a prompt): no padding to it


class RowsKVLayer(CacheLayerMixin):
    """The head's one attention layer for G slots: writes at the owner's per-slot positions, reads the first
    `owner.span` positions of every slot."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: RowsKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate (G, kv_heads, capacity, head_dim) zero buffers like `key_states`."""
        _, h, _, d = key_states.shape
        g, cap = self.owner.slots, self.owner.capacity
        self.keys = key_states.new_zeros(g, h, cap, d)
        self.values = value_states.new_zeros(g, h, cap, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write n new positions per slot of `owner.rows` at `owner.write_pos`; return those slots' buffers.

        Args:
            key_states, value_states: (R, kv_heads, n, head_dim), R = the slots of `owner.rows`.

        Returns:
            keys, values: (R, kv_heads, span, head_dim) views.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = cast(Tensor, self.keys)[self.owner.rows], cast(Tensor, self.values)[self.owner.rows]
        r, n = self.owner.write_pos.shape  # (R, n)
        at = torch.arange(r, device=keys.device)[:, None].expand(r, n)  # (R, n)
        keys[at, :, self.owner.write_pos] = key_states.transpose(1, 2).to(keys.dtype)  # (R, n, kv, d)
        values[at, :, self.owner.write_pos] = value_states.transpose(1, 2).to(values.dtype)
        span = self.owner.span
        return keys[:, :, :span], values[:, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the attended span (the head always passes explicit masks)."""
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        """Longest committed slot."""
        return max(self.owner.lengths, default=0)

    def get_max_length(self) -> int:
        """Capacity in positions."""
        return self.owner.capacity


class RowsKVCache(Cache):
    """One-layer head KV cache of G slots with per-slot committed lengths (`lengths`, on the host)."""

    def __init__(self, slots: int, capacity: int, device: torch.device) -> None:
        self.layer = RowsKVLayer(self)
        super().__init__(layers=list[Any]([self.layer]))
        self.slots, self.capacity = int(slots), int(capacity)
        self.lengths = [0] * self.slots
        self.rows = slice(0, self.slots)  # the slots the next forward covers
        self.write_pos = torch.zeros(self.slots, 1, dtype=torch.long, device=device)  # (R, n)
        self.span = self.capacity  # positions the next forward attends per slot (the mask's width)

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions in every slot (reallocated, committed positions kept)."""
        if needed <= self.capacity:
            return
        self.capacity = max(needed, 2 * self.capacity)
        if self.layer.is_initialized:
            for name in ("keys", "values"):
                old = cast(Tensor, getattr(self.layer, name))
                new = old.new_zeros(*old.shape[:2], self.capacity, old.shape[-1])
                new[:, :, : old.shape[2]] = old
                setattr(self.layer, name, new)


class RowGroup:
    """G row proposers (same head and tree sizes) whose head positions share one `RowsKVCache`.

    Args:
        members: the proposers; each one's committed positions are copied in, and it points at its slot.
    """

    def __init__(self, members: list[EagleTreeProposer]) -> None:
        lead = members[0]
        self.members: list[EagleTreeProposer | None] = list(members)
        self.drafter: Any = lead.drafter  # the head every member shares
        self.block = lead.block  # and its decode-time layer (None: HF modules)
        self.device = next(lead.drafter.parameters()).device
        need = max(p.committed for p in members) + (lead.depth - 1) * lead.top_k + SOLO
        self.cache = RowsKVCache(len(members), max(need, 64), self.device)
        self.lengths_t = torch.zeros(len(members), dtype=torch.long, device=self.device)  # set by `commit`
        for slot, p in enumerate(members):
            if p.group is not None:
                p.group.leave(p)  # back to its own cache first
            kv = _committed_kv(p)
            if kv is not None:
                self.cache.write_pos = torch.arange(p.committed, device=self.device)[None]  # (1, C)
                self.cache.rows = slice(slot, slot + 1)
                self.cache.layer.update(kv[0], kv[1])
            self.cache.lengths[slot] = p.committed
            p.group, p.slot = self, slot

    def covers(self, rows: list[EagleTreeProposer]) -> bool:
        """Every one of `rows` is a current member."""
        return all(p.group is self and self.members[p.slot] is p for p in rows)

    def reset(self, p: EagleTreeProposer) -> None:
        """`p` starts a new request: its slot is emptied (membership kept)."""
        self.cache.lengths[p.slot] = 0

    def leave(self, p: EagleTreeProposer) -> None:
        """`p` drafts alone from now on: its committed positions go back into its own `DynamicCache`."""
        c = self.cache
        p.cache = DynamicCache()
        n = c.lengths[p.slot]
        if n and c.layer.is_initialized:
            keys, values = cast(Tensor, c.layer.keys), cast(Tensor, c.layer.values)
            s = slice(p.slot, p.slot + 1)
            p.cache.update(keys[s, :, :n].clone(), values[s, :, :n].clone(), 0)
        p.committed = n
        self.members[p.slot] = None
        p.group = None

    def _forward(
        self, rows: slice, feats: Tensor, toks: Tensor, pos: Tensor, write: Tensor, mask: Tensor
    ) -> Tensor:
        """One head pass over slots `rows`: feats (R, n, F'), toks (R, n), positions (R, n), writes at (R, n),
        mask (R, 1, n, S) bool over each slot's first S positions (S <= capacity, past every write) -> (R, n, H)."""
        self.cache.rows, self.cache.write_pos, self.cache.span = rows, write, mask.shape[-1]
        with varying_shape_sdpa(feats.device):  # the rows' caches grow every call
            return self.drafter.step(feats, toks, cast(DynamicCache, self.cache), pos, mask, self.block)

    def _append(self, rows: slice, hidden: Tensor, toks: Tensor, lengths: Tensor, longest: int) -> Tensor:
        """Commit n positions in each slot of `rows` after its `lengths` committed ones (causal among them).

        Args:
            rows: R slots; hidden: (R, n, F) target features; toks: (R, n); lengths: (R,) committed so far,
                `longest` the largest of them (host value: attention reads longest + n positions per slot).

        Returns:
            (R, n, H) head outputs.
        """
        pos = lengths[:, None] + torch.arange(hidden.shape[1], device=self.device)  # (R, n)
        cap = torch.arange(longest + hidden.shape[1], device=self.device)  # (S,)
        mask = cap[None, None, None] <= pos[:, None, :, None]  # (R, 1, n, S): query j sees <= len + j
        return self._forward(rows, self.drafter.encode_target(hidden, self.block), toks, pos, pos, mask)

    def commit(
        self, slots: list[int], hidden: list[Tensor], tokens: list[Tensor], draft_slots: int
    ) -> Tensor:
        """Append each drafting slot's new positions; returns (G, H) the newest output per slot (zeros elsewhere).

        Args:
            slots: R drafting slots; hidden: R of (n_i, F) target features; tokens: R of (n_i,).
            draft_slots: entries the expansion that follows writes per slot ((depth - 1) * top_k).
        """
        c, dev = self.cache, self.device
        g = c.slots
        longest = max((h.shape[0] for h in hidden), default=1)
        c.reserve(max(c.lengths) + max(longest, SOLO) + draft_slots)
        last = torch.zeros(
            g, self.drafter.config.base_hidden_size, device=dev, dtype=self.drafter.fc.weight.dtype
        )
        small = [i for i, h in enumerate(hidden) if h.shape[0] <= SOLO]
        for i in (i for i, h in enumerate(hidden) if h.shape[0] > SOLO):  # long (a prompt): alone, unpadded
            s = slots[i]
            start = torch.tensor([c.lengths[s]], device=dev)  # (1,)
            last[s] = self._append(
                slice(s, s + 1), hidden[i].to(dev)[None], tokens[i].to(dev)[None], start, c.lengths[s]
            )[0, -1]
            c.lengths[s] += hidden[i].shape[0]
        if small:
            n = max(hidden[i].shape[0] for i in small)
            first = hidden[small[0]]
            feats = first.new_zeros(g, n, first.shape[-1], device=dev)  # (G, n, F) dummies elsewhere
            toks = torch.zeros(g, n, dtype=torch.long, device=dev)  # (G, n)
            for i in small:
                m = hidden[i].shape[0]
                feats[slots[i], :m], toks[slots[i], :m] = hidden[i].to(dev), tokens[i].to(dev)
            lengths = torch.tensor(c.lengths, device=dev)  # (G,)
            out = self._append(slice(0, g), feats, toks, lengths, max(c.lengths))  # (G, n, H)
            for i in small:
                s, m = slots[i], hidden[i].shape[0]
                last[s] = out[s, m - 1]
                c.lengths[s] += m
        self.lengths_t = torch.tensor(c.lengths, device=dev)  # (G,) what the expansion's levels read
        return last

    def attend(self, level: int, rows: Tensor, feats: Tensor, toks: Tensor) -> Tensor:
        """One expansion level for all G slots (`EagleTreeProposer.grow_rows`).

        Args:
            level: depth of the frontier nodes; rows: (G, k, s) ancestors-or-self among the s draft entries;
            feats: (G, k, H); toks: (G, k).

        Returns:
            (G, k, H) head outputs.
        """
        # every slot's committed positions and its draft entries
        span = max(self.cache.lengths) + rows.shape[2]
        pos, write, mask = level_inputs(level, rows, self.lengths_t, span)
        return self._forward(slice(0, rows.shape[0]), feats, toks, pos, write, mask)


def level_inputs(level: int, rows: Tensor, lengths: Tensor, span: int) -> tuple[Tensor, Tensor, Tensor]:
    """Positions, write positions and mask of one expansion level over G slots (no host reads).

    Args:
        level: depth of the frontier nodes (1 .. depth - 1).
        rows: (G, k, s) bool, each frontier node's ancestors-or-self among the s draft entries (its own last k).
        lengths: (G,) long, each slot's committed positions (the draft entries follow them).
        span: S, the positions attention reads per slot (>= every slot's length + s).

    Returns:
        pos (G, k) rotary positions, write (G, k) where the frontier's entries go, mask (G, 1, k, S) bool: each
        node sees its slot's committed prefix and its own drafted ancestors.
    """
    g, k, s = rows.shape
    dev = rows.device
    write = lengths[:, None] + (s - k) + torch.arange(k, device=dev)  # (G, k)
    pos = (lengths - 1 + level)[:, None].expand(g, k)  # (G, k) every frontier node sits at depth `level`
    rel = torch.arange(span, device=dev)[None] - lengths[:, None]  # (G, S) offset from the draft region
    drafted = (rel >= 0) & (rel < s)
    sees = rows.gather(2, rel.clamp(0, s - 1)[:, None, :].expand(g, k, span))  # (G, k, S)
    mask = ((sees & drafted[:, None]) | (rel < 0)[:, None])[:, None]  # (G, 1, k, S)
    return pos, write, mask


def _committed_kv(p: EagleTreeProposer) -> tuple[Tensor, Tensor] | None:
    """(1, kv_heads, C, head_dim) keys and values of `p`'s committed positions in its own cache (None: none)."""
    layer = cast(Any, p.cache.layers[0]) if len(p.cache.layers) else None  # a DynamicLayer
    if p.committed == 0 or layer is None or not layer.is_initialized:
        return None
    return cast(Tensor, layer.keys)[:, :, : p.committed], cast(Tensor, layer.values)[:, :, : p.committed]


def propose_rows(
    lead: EagleTreeProposer, rows: list[EagleTreeProposer], hidden: list[Tensor], tokens: list[Tensor]
) -> list[DraftTree]:
    """Every row's `propose(hidden[i], tokens[i])` with one head pass per level for all rows (module docstring).

    Args:
        lead: one of `rows`; rows: R dynamic-mode proposers of one head and tree size.
        hidden: R of (n_i, F); tokens: R of (n_i,), tokens[i][-1] the root of row i.
    """
    group = lead.group
    if group is None or not group.covers(rows):  # first call, or a row drafted alone since: regroup
        mine = {id(p) for p in rows}
        others = {id(m): m for p in rows if p.group is not None for m in p.group.members if m is not None}
        keep = [m for key, m in others.items() if key not in mine]
        group = RowGroup([*rows, *keep])  # their positions copied into one buffer, other members kept
    slots = [p.slot for p in rows]
    last = group.commit(slots, hidden, tokens, (lead.depth - 1) * lead.top_k)  # (G, H)
    roots, lookup = None, None
    if lead.copy_ngram:  # each row's committed tokens indexed on the host, its root where its chains start
        g = last.shape[0]
        indexes: list[NgramIndex | None] = [None] * g  # slots that do not draft: no candidates
        roots = torch.zeros(g, dtype=torch.long, device=last.device)  # (G,)
        for p, t in zip(rows, tokens, strict=True):
            indexes[p.slot] = p.copy_ctx.update_index(t)
            roots[p.slot] = t[-1]
        lookup = partial(host_lookups, indexes)
    tok, par, score, depth = lead.grow_rows(last, group.attend, slots, roots, lookup)  # (G, P) each
    out = []
    for i, p in enumerate(rows):
        s = p.slot
        p.committed = group.cache.lengths[s]
        p.last_levels = lead.last_levels
        out.append(p.rerank(tokens[i][-1:], tok[s], par[s], score[s], depth[s], tokens[i].device))
    return out
