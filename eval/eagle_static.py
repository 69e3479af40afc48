"""Fixed-shape pieces of the EAGLE-2 proposer's static mode (`EagleTreeProposer(static=True)`).

The head's own KV cache is one preallocated buffer pair with a length counter, written in two ways:

    buffer [ committed (length) | newest m | level-1 frontier | level-2 frontier | ... | stale ... ]
            eager commit: n - M at `length`     step: M rows, then k slots per level at length_t + ...

  * a draft step commits the newest m <= M accepted positions itself, as M rows (the rest padding) written
    at device positions from the committed length, under a whole-buffer causal mask (`commit_mask`), then
    advances the device counter by m; positions beyond the newest M (a prompt, the steps a node budget left
    undrafted) are committed first, eagerly, at the host counter `length` (attention reads the views
    `[:length + n]`, as a `DynamicCache` would);
  * the expansion (`fixed = True`) writes each level's k frontier nodes at device positions `write_pos`
    computed from `length_t`, and attention reads the whole buffer under a (1, 1, k, capacity) mask built
    on the device (`draft_mask`).
Shapes never change between calls, so the step (commit of the newest M + expansion) is captured once per
size as a CUDA graph (`StaticHeadState.run`) and replayed for any committed length: on a GPU an eager commit
cost ~2 ms of launches (H100, session 32), the graph-replayed expansion 1.5-2 ms.

The next call's commit simply overwrites the previous call's draft entries (no rollback needed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from specdraft.eval.graphs import CudaGraph, replay_or_run
from specdraft.models.attention import varying_shape_sdpa
from specdraft.models.eagle_common import DraftBlock, causal_tree_mask

Expansion = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]


class HeadKVLayer(CacheLayerMixin):
    """The head's one attention layer: buffers allocated at the first write (their shape is the head's)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: HeadKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate (1, kv_heads, capacity, head_dim) buffers like `key_states`."""
        b, h, _, d = key_states.shape
        self.keys = key_states.new_zeros(b, h, self.owner.capacity, d)
        self.values = value_states.new_zeros(b, h, self.owner.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write L new positions; return what attention reads.

        Args:
            key_states, value_states: (1, kv_heads, L, head_dim).

        Returns:
            keys, values: (1, kv_heads, length + L, head_dim) views (commit) or the whole buffers (fixed).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = cast(Tensor, self.keys), cast(Tensor, self.values)
        n = key_states.shape[-2]
        if self.owner.fixed:
            idx = self.owner.write_pos[:n]  # (L,) device positions
            keys.index_copy_(2, idx, key_states.to(keys.dtype))
            values.index_copy_(2, idx, value_states.to(values.dtype))
            return keys, values
        start = self.owner.length
        keys[:, :, start : start + n] = key_states
        values[:, :, start : start + n] = value_states
        return keys[:, :, : start + n], values[:, :, : start + n]

    def regrow(self, capacity: int, keep: int) -> None:
        """Reallocate with room for `capacity` positions, keeping the first `keep`."""
        if not self.is_initialized:
            return
        old = (cast(Tensor, self.keys), cast(Tensor, self.values))
        new = [x.new_zeros(*x.shape[:2], capacity, x.shape[-1]) for x in old]
        for dst, src in zip(new, old, strict=True):
            dst[:, :, :keep] = src[:, :, :keep]
        self.keys, self.values = new

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset); the head always passes explicit masks."""
        return (self.owner.capacity if self.owner.fixed else self.owner.length + query_length), 0

    def get_seq_length(self) -> int:
        """Committed positions."""
        return self.owner.length

    def get_max_length(self) -> int:
        """Capacity in positions."""
        return self.owner.capacity


class HeadKVCache(Cache):
    """Preallocated one-layer KV cache of an EAGLE head with host and device length counters.

    Args:
        device: where the counters live (the head's device).
        capacity: initial room in positions (grown by `reserve`).
        max_write: most positions one fixed-shape write covers (top_k: one frontier).
    """

    def __init__(self, device: torch.device, capacity: int, max_write: int) -> None:
        self.layer = HeadKVLayer(self)
        super().__init__(layers=list[Any]([self.layer]))
        self.capacity, self.length, self.fixed = int(capacity), 0, False
        self.length_t = torch.zeros((), dtype=torch.long, device=device)  # mirrors `length` on the device
        self.write_pos = torch.zeros(max(max_write, 1), dtype=torch.long, device=device)  # (max_write,)

    def reserve(self, needed: int) -> bool:
        """Make room for `needed` positions; True when the buffers were reallocated (graphs are stale)."""
        if needed <= self.capacity:
            return False
        self.capacity = max(needed, 2 * self.capacity)
        self.layer.regrow(self.capacity, self.length)
        return True

    def set_length(self, length: int) -> None:
        """Declare `length` positions committed (host and device counters)."""
        self.length = length
        self.length_t.fill_(length)

    def prepare_write(self, offset: int, n: int) -> None:
        """The next fixed write covers [length_t + offset, length_t + offset + n) (device op, no sync)."""
        arange = torch.arange(offset, offset + n, device=self.length_t.device)
        torch.add(arange, self.length_t, out=self.write_pos[:n])


def draft_mask(rows: Tensor, length_t: Tensor, capacity: int) -> Tensor:
    """Whole-buffer boolean mask of m draft queries (True = attend), built on the device.

    Args:
        rows: (m, s) bool, each query's ancestors-or-self among the s draft entries at [length, length + s).
        length_t: () long, committed positions.
        capacity: buffer length.

    Returns:
        (1, 1, m, capacity): the committed prefix, then each query's ancestors; stale positions masked.
    """
    s = rows.shape[1]
    rel = torch.arange(capacity, device=rows.device) - length_t  # (capacity,) offset from the draft region
    drafted = (rel >= 0) & (rel < s)
    sees = rows[:, rel.clamp(0, s - 1)] & drafted  # (m, capacity)
    return (sees | (rel < 0))[None, None]


def commit_mask(rows: int, length_t: Tensor, capacity: int) -> Tensor:
    """Whole-buffer causal mask of `rows` new positions written at [length, length + rows) (True = attend), of
    one buffer or of G slots (`eval/eagle_static_rows.py`).

    Args:
        rows: M, the new positions (padding rows included: they only see what a real row would).
        length_t: () or (G,) long, committed positions before them (per slot).
        capacity: buffer length.

    Returns:
        (1 or G, 1, M, capacity): row i sees the committed prefix and new rows 0..i.
    """
    rel = torch.arange(capacity, device=length_t.device)[None] - length_t.reshape(-1, 1)  # (1 or G, capacity)
    return (rel[:, None, :] <= torch.arange(rows, device=length_t.device)[None, :, None])[:, None]


def fixed_ancestors(parents: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """`tree.ancestor_matrix` in a fixed number of steps and without host checks (parents assumed valid), for
    one tree or a batch of them (leading dimensions `...`).

    Args:
        parents: (..., N) long, `parents[..., 0] == -1`, `parents[..., i] < i`, depth <= max_depth.
        max_depth: deepest node.

    Returns:
        ancestors (..., N, N) bool (ancestor-or-self), depth (..., N) long.
    """
    idx = torch.arange(parents.shape[-1], device=parents.device)  # (N,)
    par = parents.clamp_min(0)  # the root points at itself
    anc = (idx[:, None] == idx[None, :]).expand(*parents.shape, idx.shape[0])  # (..., N, N)
    cur = idx.expand_as(par)  # (..., N)
    for _ in range(max_depth):
        cur = par.gather(-1, cur)
        anc = anc | (cur[..., :, None] == idx)
    return anc, anc.sum(-1) - 1


class StaticHeadState:
    """The static mode's state: the head's `HeadKVCache`, the expansion's input buffers and its CUDA graph.

    Args:
        drafter: the EAGLE head (`encode_target`, `step`).
        draft_slots: most draft entries one expansion writes, (depth - 1) * top_k.
        max_write: top_k (nodes per expanded level).
        graphs: capture the expansion as a CUDA graph (head on CUDA; eager when capture fails).
        capacity: initial head-cache room in positions.
        block: the head's decode-time layer (`eval/draft_block.py`) passed to every `step`; None: HF modules.
        commit_rows: M, the newest committed positions a draft step commits itself (inside its graph); a step
            accepts at most depth + 1 new positions, more only after undrafted steps or a prompt.
    """

    def __init__(
        self,
        drafter: Any,
        draft_slots: int,
        max_write: int,
        graphs: bool = False,
        capacity: int = 256,
        block: DraftBlock | None = None,
        commit_rows: int = 8,
    ) -> None:
        self.drafter, self.draft_slots, self.block = drafter, int(draft_slots), block
        self.commit_rows = max(int(commit_rows), 1)
        dev = next(drafter.parameters()).device
        self.cache = HeadKVCache(dev, capacity, max(max_write, self.commit_rows))
        self.graphs = graphs and dev.type == "cuda"
        # one CUDA graph per expansion size (a node budget picks among a few: `EagleTreeProposer.fit_budget`)
        self.captured: dict[tuple[int, int], CudaGraph[tuple[Tensor, Tensor, Tensor, Tensor]] | None] = {}
        self.graph: CudaGraph[tuple[Tensor, Tensor, Tensor, Tensor]] | None = None  # the latest call's
        # graph inputs: the newest m <= M committed pairs (rows past m: padding), m, the length before them
        self._hid = torch.zeros(0, device=dev)  # (M, F), sized at the first call
        self._tok = torch.zeros(self.commit_rows, dtype=torch.long, device=dev)  # (M,)
        self._n = torch.ones((), dtype=torch.long, device=dev)  # () m
        self._base = torch.zeros((), dtype=torch.long, device=dev)  # () committed length before them

    def reset(self) -> None:
        """Forget the committed positions (buffers and graph are kept: the graph reads `length_t`)."""
        self.cache.set_length(0)

    def commit(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Append n newly committed pairs (eager; n varies per call): hidden (n, F), tokens (n,) -> (n, H)."""
        d, c = self.drafter, self.cache
        dev = c.length_t.device
        n = hidden.shape[0]
        if n == 0:
            return hidden.new_zeros(0, d.config.base_hidden_size)
        if c.reserve(c.length + n + self.draft_slots):
            self.captured, self.graph = {}, None  # new buffers: recapture
        pos = torch.arange(c.length, c.length + n, device=dev)[None]  # (1, n)
        mask = causal_tree_mask(n, c.length + n, dev)  # (n, C + n)
        g = d.encode_target(hidden.to(dev), self.block)[None]  # (1, n, H)
        with varying_shape_sdpa(dev):  # n and the cache length change every call
            out = d.step(g, tokens.to(dev)[None], c, pos, mask, self.block)[0]
        c.set_length(c.length + n)
        return out

    def attend(self, level: int, rows: Tensor, feats: Tensor, toks: Tensor) -> Tensor:
        """One fixed-shape expansion level (inside `run`).

        Args:
            level: depth of the frontier nodes (1 .. depth - 1).
            rows: (k, s) ancestors-or-self of the frontier among the s draft entries so far (its own last).
            feats: (k, H) input features; toks: (k,) the frontier tokens.

        Returns:
            (k, H) head outputs.
        """
        c, k = self.cache, rows.shape[0]
        c.prepare_write(rows.shape[1] - k, k)
        pos = (c.length_t - 1 + level).expand(1, k)  # (1, k) every frontier node sits at depth `level`
        mask = draft_mask(rows, c.length_t, c.capacity)  # (1, 1, k, capacity)
        return self.drafter.step(feats[None], toks[None], c, pos, mask, self.block)[0]

    def _commit_newest(self) -> tuple[Tensor, Tensor]:
        """The staged newest m pairs through the head as M fixed rows at [base, base + M), then the device
        length becomes base + m (idempotent: a capture's warm-up runs repeat it). Inside `run`'s step.

        Returns:
            last (H,): the head's output at the newest position; root (1,) long: its token.
        """
        d, c, rows = self.drafter, self.cache, self.commit_rows
        c.length_t.copy_(self._base)
        c.prepare_write(0, rows)
        pos = (self._base + torch.arange(rows, device=self._base.device))[None]  # (1, M)
        mask = commit_mask(rows, self._base, c.capacity)  # (1, 1, M, capacity)
        g = d.encode_target(self._hid, self.block)[None]  # (1, M, H)
        out = d.step(g, self._tok[None], c, pos, mask, self.block)[0]  # (M, H)
        c.length_t.copy_(self._base + self._n)
        newest = (self._n - 1).reshape(1)  # (1,)
        return out.index_select(0, newest)[0], self._tok.index_select(0, newest)

    def run(
        self, expand: Expansion, hidden: Tensor, tokens: Tensor, size: tuple[int, int] = (0, 0)
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Commit the new pairs and `expand(last, root)`: positions before the newest M eagerly (`commit`), the
        newest m <= M and the expansion as one fixed-shape step, replayed as a CUDA graph when `graphs`.

        Args:
            expand: the fixed-shape expansion + reranking, (H,), (1,) -> tree tensors.
            hidden: (n, F) target features of the newly committed positions, n >= 1.
            tokens: (n,) long, the token each predicts; tokens[-1] is the root.
            size: the expansion's (total_tokens, depth): each size is captured once and replayed.

        Returns:
            expand's outputs (graph-owned when replayed: overwritten by the next call).
        """
        c, n = self.cache, hidden.shape[0]
        m = min(self.commit_rows, n)
        if n > m:
            self.commit(hidden[: n - m], tokens[: n - m])
        if c.reserve(c.length + self.commit_rows + self.draft_slots):
            self.captured, self.graph = {}, None  # new buffers: recapture
        if self._hid.shape[-1] != hidden.shape[-1] or self._hid.dtype != hidden.dtype:
            self._hid, self.captured = (
                hidden.new_zeros(self.commit_rows, hidden.shape[-1]).to(self._n.device),
                {},
            )
        self._hid[:m].copy_(hidden[n - m :])
        self._tok[:m].copy_(tokens[n - m :])
        self._n.fill_(m)
        self._base.fill_(c.length)
        start = c.length

        def step() -> tuple[Tensor, Tensor, Tensor, Tensor]:
            return expand(*self._commit_newest())

        self.cache.fixed = True
        try:
            if not self.graphs:
                self.graph = None
                return step()
            out = replay_or_run(self.captured, size, step, self._n.device, "the EAGLE-2 draft step")
            self.graph = self.captured[size]
            self.graphs = self.graph is not None  # a failed capture: eager from now on
            return out
        finally:
            self.cache.fixed = False
            c.length = start + m  # the host mirror (the step set length_t)
