"""EAGLE-2's fixed-shape draft step for a whole batch (the batched decoder's static path): every row's commit
of its newest positions, expansion and reranking in one step over G slots, captured as ONE CUDA graph per
tree size.

Row by row, a batch step replayed one ~1.5-2 ms head graph per row (session 32, H100), and EAGLE-1 at batch 16
launched ~5,800 kernels a step outside the target's forwards (`scripts/gpu/kernel_counts.py`). Here the
static proposers of a batch share a `StaticRows` state: one head KV buffer (G, kv_heads, capacity, head_dim)
with a device length per slot, in which each member's own `HeadKVCache` is a view (its slot), so a member
that drafts alone (or commits a prompt eagerly) writes where the batched step reads:

    slot g  [ committed (len_g) | newest m_g <= M | level-1 frontier | level-2 frontier | ... | stale ]

  * positions beyond each drafting row's newest M (a prompt, steps a budget left undrafted) are committed
    first by the row itself (`StaticHeadState.commit`, eager, into its view);
  * the step (fixed shapes, no host reads): the newest m_g pairs of every slot as M rows written at
    len_g .. len_g + M - 1 under a causal mask, lengths advanced on the device, then `grow_rows` for all
    slots (each level's k frontier nodes of slot g at len_g + (level - 1) * k), then every slot's reranking
    (`select_nodes` and `fixed_ancestors` over rows);
  * slots that do not draft this step ride along with m = 0: their writes land past their length (stale),
    their lengths stay;
  * a copy gate: each member's committed tokens (its `copy_ctx` buffer, appended eagerly) are stacked into
    (G, C) step inputs at one capacity, and every slot's nodes look up in its own row (`lookup_fixed_rows`).

Each row's tree equals its own static `propose` (same commits, same expansion; fp rounding of batched
products aside). A batch of B rows captures one graph per tree size (a node budget's few sizes), replayed
for any lengths; new members or a grown buffer recapture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from transformers import DynamicCache

from specdraft.eval.copy_context import commit_rows
from specdraft.eval.eagle_rows import RowsKVCache, level_inputs
from specdraft.eval.eagle_static import commit_mask, fixed_ancestors
from specdraft.eval.eagle_tree import select_nodes
from specdraft.eval.graphs import CudaGraph, replay_or_run
from specdraft.eval.tree import DraftTree
from specdraft.models.copy_lookup import lookup_fixed_rows

if TYPE_CHECKING:
    from specdraft.eval.eagle_static import StaticHeadState
    from specdraft.eval.eagle_tree import EagleTreeProposer

# tokens (G, N), parents (G, N), depth (G, N), ancestors (G, N, N)
TreeTensors = tuple[Tensor, Tensor, Tensor, Tensor]


@dataclass(eq=False)
class StaticRows:
    """What the static proposers of one batch share: the slots' head cache, the step's inputs, its graphs.

    Args:
        members: the proposers, slot = index (a new member rebuilds the state's buffers).
        cache: the G slots' head KV buffers (`RowsKVCache`: writes at `write_pos`, reads `span` positions).
        lengths: (G,) long committed positions per slot (each member's `length_t` is a view of its entry).
    """

    members: list[EagleTreeProposer]
    cache: RowsKVCache
    lengths: Tensor
    hid: Tensor = field(default_factory=lambda: torch.zeros(0))  # (G, M, F) newest committed features
    tok: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (G, M) their tokens
    sizes: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (2, G) base, m
    # copy gate: every slot's committed tokens (G, C) at one capacity C, and their counts (G,)
    ctx: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    ctx_len: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    graphs: dict[tuple[Any, ...], CudaGraph[TreeTensors] | None] = field(default_factory=dict)


def _fixed(p: EagleTreeProposer) -> StaticHeadState:
    """The static state of a member (static proposers only join)."""
    assert p.fixed is not None
    return p.fixed


def _linked(state: StaticRows, slot: int) -> bool:
    """Whether the member in `slot` reads and writes its slot of the shared buffers."""
    c, shared = _fixed(state.members[slot]).cache, state.cache.layer
    if c.length_t.data_ptr() != state.lengths[slot].data_ptr() or c.capacity != state.cache.capacity:
        return False
    if not shared.is_initialized or not c.layer.is_initialized:
        return not shared.is_initialized and not c.layer.is_initialized
    return cast(Tensor, c.layer.keys).data_ptr() == cast(Tensor, shared.keys)[slot].data_ptr()


def _link(state: StaticRows, needed: int) -> None:
    """Room for `needed` positions in every slot, and every member a view of its slot: its committed positions
    copied in where it drafted alone (its own buffers) or the shared buffers grew; each relinked member's own
    single-row graphs are dropped (they read its old buffers), and so are the batched ones when the shared
    buffers were reallocated."""
    rc, layer = state.cache, state.cache.layer
    if needed > rc.capacity:
        rc.reserve(needed)  # reallocated, positions kept
        state.graphs = {}
    if not layer.is_initialized:  # shaped like any member's buffers (none yet: the first step allocates)
        first = next(
            (_fixed(p).cache.layer for p in state.members if _fixed(p).cache.layer.is_initialized), None
        )
        if first is not None:
            layer.lazy_initialization(cast(Tensor, first.keys), cast(Tensor, first.values))
            state.graphs = {}
    keys, values = cast(Tensor, layer.keys), cast(Tensor, layer.values)  # (G, kv_heads, C, d); None: not yet
    for slot, p in enumerate(state.members):
        if _linked(state, slot):
            continue
        c = _fixed(p).cache
        n = c.length
        if layer.is_initialized:
            if c.layer.is_initialized and n:  # before re-pointing: it may be the old shared buffer
                keys[slot : slot + 1, :, :n] = cast(Tensor, c.layer.keys)[:, :, :n]
                values[slot : slot + 1, :, :n] = cast(Tensor, c.layer.values)[:, :, :n]
            c.layer.keys, c.layer.values = keys[slot : slot + 1], values[slot : slot + 1]
            c.layer.is_initialized = True
        c.capacity = rc.capacity
        c.length_t = state.lengths[slot]
        c.set_length(n)
        _fixed(p).captured, _fixed(p).graph = {}, None


def _state_of(rows: list[EagleTreeProposer]) -> StaticRows:
    """The rows' shared state: the first row's, or a new one of its members and the rows that are not members
    yet (G slots, a slot per member; `_link` then copies each member's committed positions in)."""
    old = next((p.static_rows for p in rows if p.static_rows is not None), None)
    if old is not None and all(p.static_rows is old and old.members[p.rows_slot] is p for p in rows):
        return old
    members = list(old.members) if old is not None else []
    members += [p for p in rows if all(p is not m for m in members)]
    dev = _fixed(members[0]).cache.length_t.device
    cap = max(_fixed(p).cache.capacity for p in members)
    lengths = torch.zeros(len(members), dtype=torch.long, device=dev)  # (G,)
    state = StaticRows(members, RowsKVCache(len(members), cap, dev), lengths)
    for slot, p in enumerate(members):  # the old state's buffers go with the last view of them
        p.static_rows, p.rows_slot = state, slot
    return state


def propose_static_rows(
    lead: EagleTreeProposer, rows: list[EagleTreeProposer], hidden: list[Tensor], tokens: list[Tensor]
) -> list[DraftTree]:
    """Every row's static `propose(hidden[i], tokens[i])` in one fixed-shape step (module docstring).

    Args:
        lead: one of `rows`; rows: R static proposers of one head, tree size and draft block
            (`EagleTreeProposer.propose_rows` checks).
        hidden: R of (n_i, F) target features; tokens: R of (n_i,), tokens[i][-1] the root of row i.

    Returns:
        R trees of 1 + min(total_tokens, pool) nodes, each equal to the row's own static `propose`.
    """
    fixed = _fixed(lead)
    m_rows, slots_per_draft = fixed.commit_rows, fixed.draft_slots
    for p, h, t in zip(rows, hidden, tokens, strict=True):  # positions before the newest M: eagerly, alone
        n = h.shape[0]
        if n > m_rows:
            _fixed(p).commit(h[: n - m_rows], t[: n - m_rows])
    state = _state_of(rows)
    g = len(state.members)
    _link(state, max(_fixed(p).cache.length for p in state.members) + m_rows + slots_per_draft)
    rc, dev = state.cache, state.lengths.device
    feat = hidden[0]
    if state.hid.shape != (g, m_rows, feat.shape[-1]) or state.hid.dtype != feat.dtype:
        state.hid = feat.new_zeros(g, m_rows, feat.shape[-1], device=dev)
        state.tok = torch.zeros(g, m_rows, dtype=torch.long, device=dev)
        state.sizes = torch.zeros(2, g, dtype=torch.long, device=dev)
        state.graphs = {}
    # stage the newest m_i pairs of every drafting row at slot * M + j, and (base, m) per slot: one copy from
    # the host, then a scatter (no host reads)
    base = [_fixed(p).cache.length for p in state.members]
    count = [0] * g
    flat: list[int] = []
    for p, h in zip(rows, hidden, strict=True):
        count[p.rows_slot] = min(m_rows, h.shape[0])
        flat += range(p.rows_slot * m_rows, p.rows_slot * m_rows + count[p.rows_slot])
    staged = torch.tensor(base + count + flat, dtype=torch.long).to(dev, non_blocking=True)
    state.sizes.copy_(staged[: 2 * g].view(2, g))
    at = staged[2 * g :]  # (T,) flat slots of the staged pairs
    tails = [h[-count[p.rows_slot] :] for p, h in zip(rows, hidden, strict=True)]
    state.hid.view(g * m_rows, -1).index_copy_(0, at, torch.cat(tails).to(dev, state.hid.dtype))
    state.tok.view(-1).index_copy_(
        0, at, torch.cat([t[-count[p.rows_slot] :] for p, t in zip(rows, tokens, strict=True)]).to(dev)
    )
    drafting = [p.rows_slot for p in rows]
    lookup = _stage_copy(state, rows, tokens) if lead.copy_ngram else None

    def attend(level: int, anc: Tensor, feats: Tensor, toks: Tensor) -> Tensor:
        # (G, k) positions, (G, k) writes, (G, 1, k, C) mask
        pos, write, mask = level_inputs(level, anc, state.lengths, rc.capacity)
        return _forward(state, feats, toks, pos, write, mask)

    def step() -> TreeTensors:
        start, new = state.sizes[0], state.sizes[1]  # (G,) each
        pos = start[:, None] + torch.arange(m_rows, device=dev)  # (G, M)
        mask = commit_mask(m_rows, start, rc.capacity)  # (G, 1, M, C): row j sees its prefix and 0..j
        out = _forward(state, lead.drafter.encode_target(state.hid, lead.block), state.tok, pos, pos, mask)
        state.lengths.copy_(start + new)  # (G,) the members' device lengths (views)
        newest = (new - 1).clamp_min(0)[:, None]  # (G, 1); idle slots: anything
        last = out.gather(1, newest[..., None].expand(-1, -1, out.shape[-1]))[:, 0]  # (G, H)
        root = state.tok.gather(1, newest)  # (G, 1)
        pool = lead.grow_rows(last, attend, drafting, root[:, 0], lookup)  # (G, P) each
        kept, kept_par, _ = select_nodes(*pool, lead.total_tokens)  # (G, N - 1) each
        toks = torch.cat([root, kept], dim=1)  # (G, N)
        parents = torch.cat([torch.full_like(root, -1), kept_par], dim=1)  # (G, N)
        anc, depth = fixed_ancestors(parents, lead.depth)  # (G, N, N), (G, N)
        return toks, parents, depth, anc

    fresh = not rc.layer.is_initialized  # no member has positions yet: the step allocates the buffers
    key = (lead.total_tokens, lead.depth, g, rc.capacity, feat.shape[-1], feat.dtype, state.ctx.shape[-1])
    if lead.graphs:
        out = replay_or_run(state.graphs, key, step, dev, f"the EAGLE-2 draft step of {g} rows")
    else:
        out = step()
    toks, parents, depth, anc = (t.clone() for t in out)  # graph outputs are overwritten by the next replay
    if fresh:  # the members whose first positions the step wrote become views of the new buffers
        _link(state, rc.capacity)
    trees = []
    for p, t in zip(rows, tokens, strict=True):
        s, c = p.rows_slot, _fixed(p).cache
        c.length = base[s] + count[s]  # the host mirror (the step advanced the device length)
        p.committed, p.last_levels = c.length, lead.last_levels
        trees.append(DraftTree(toks[s], parents[s], depth[s], anc[s]).to(t.device))
    return trees


def _forward(
    state: StaticRows, feats: Tensor, toks: Tensor, pos: Tensor, write: Tensor, mask: Tensor
) -> Tensor:
    """One head pass over every slot: feats (G, n, H), toks (G, n), positions (G, n), writes at (G, n), mask
    (G, 1, n, C) over each slot's whole buffer -> (G, n, H)."""
    rc, lead = state.cache, state.members[0]
    rc.rows, rc.write_pos, rc.span = slice(0, rc.slots), write, rc.capacity
    return lead.drafter.step(feats, toks, cast(DynamicCache, rc), pos, mask, lead.block)


def _stage_copy(
    state: StaticRows, rows: list[EagleTreeProposer], tokens: list[Tensor]
) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """Copy gate: append each drafting row's committed tokens to its own buffer, bring every member's buffer to
    one capacity, and stack them into the step's (G, C) inputs (a new capacity: new inputs, graphs dropped; a
    member's own moved buffer: its single-row graphs dropped). Returns the step's lookup: chains (G, j, c) ->
    candidates and lengths (G, j), each slot in its own row, on the device."""
    ctxs = [p.copy_ctx for p in state.members]
    for p, moved in zip(state.members, commit_rows(ctxs, [p.copy_ctx for p in rows], tokens), strict=True):
        if moved:  # its own single-row steps read the old buffer
            _fixed(p).captured, _fixed(p).graph = {}, None
    g, dev, cap = len(state.members), state.lengths.device, ctxs[0].buf.shape[0]
    if state.ctx.shape != (g, cap):
        state.ctx = torch.zeros(g, cap, dtype=torch.long, device=dev)
        state.ctx_len = torch.zeros(g, dtype=torch.long, device=dev)
        state.graphs = {}
    torch.stack([p.copy_ctx.buf for p in state.members], out=state.ctx)  # (G, C)
    torch.stack([p.copy_ctx.length for p in state.members], out=state.ctx_len)  # (G,)
    n = state.members[0].copy_ngram
    return lambda chains: lookup_fixed_rows(state.ctx, state.ctx_len, chains, n)
