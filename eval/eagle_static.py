"""Fixed-shape pieces of the EAGLE-2 proposer's static mode (`EagleTreeProposer(static=True)`).

The head's own KV cache is one preallocated buffer pair with a length counter, written in two ways:

    buffer [ committed (length) | level-1 frontier | level-2 frontier | ... | stale ... ]
            commit: append n at `length` (eager)   expansion: k slots per level at length_t + (level-1)*k

  * the commit of the newly accepted positions (n varies per call) appends at the host counter `length`
    and attention reads the views `[:length + n]`, as a `DynamicCache` would;
  * the expansion (`fixed = True`) writes each level's k frontier nodes at device positions `write_pos`
    computed from `length_t`, and attention reads the whole buffer under a (1, 1, k, capacity) mask built
    on the device (`draft_mask`). Shapes never change between calls, so the expansion can be captured
    once as a CUDA graph (`StaticHeadState.run`) and replayed for any committed length.

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

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
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


def fixed_ancestors(parents: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """`tree.ancestor_matrix` in a fixed number of steps and without host checks (parents assumed valid).

    Args:
        parents: (N,) long, `parents[0] == -1`, `parents[i] < i`, depth <= max_depth.
        max_depth: deepest node.

    Returns:
        ancestors (N, N) bool (ancestor-or-self), depth (N,) long.
    """
    idx = torch.arange(parents.shape[0], device=parents.device)  # (N,)
    par = parents.clamp_min(0)  # the root points at itself
    anc = idx[:, None] == idx[None, :]  # (N, N)
    cur = idx
    for _ in range(max_depth):
        cur = par[cur]
        anc = anc | (cur[:, None] == idx[None, :])
    return anc, anc.sum(1) - 1


class StaticHeadState:
    """The static mode's state: the head's `HeadKVCache`, the expansion's input buffers and its CUDA graph.

    Args:
        drafter: the EAGLE head (`encode_target`, `step`).
        draft_slots: most draft entries one expansion writes, (depth - 1) * top_k.
        max_write: top_k (nodes per expanded level).
        graphs: capture the expansion as a CUDA graph (head on CUDA; eager when capture fails).
        capacity: initial head-cache room in positions.
        block: the head's decode-time layer (`eval/draft_block.py`) passed to every `step`; None: HF modules.
    """

    def __init__(
        self,
        drafter: Any,
        draft_slots: int,
        max_write: int,
        graphs: bool = False,
        capacity: int = 256,
        block: DraftBlock | None = None,
    ) -> None:
        self.drafter, self.draft_slots, self.block = drafter, int(draft_slots), block
        dev = next(drafter.parameters()).device
        self.cache = HeadKVCache(dev, capacity, max_write)
        self.graphs = graphs and dev.type == "cuda"
        # one CUDA graph per expansion size (a node budget picks among a few: `EagleTreeProposer.fit_budget`)
        self.captured: dict[tuple[int, int], CudaGraph[tuple[Tensor, Tensor, Tensor, Tensor]] | None] = {}
        self.graph: CudaGraph[tuple[Tensor, Tensor, Tensor, Tensor]] | None = None  # the latest call's
        self._last = torch.zeros(0, device=dev)  # (H,) graph input, sized at the first call
        self._root = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) graph input

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

    def run(
        self, expand: Expansion, last: Tensor, root: Tensor, size: tuple[int, int] = (0, 0)
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`expand(last, root)` on persistent inputs: replayed as a CUDA graph when `graphs`, else eager.

        Args:
            expand: the fixed-shape expansion + reranking, (H,), (1,) -> tree tensors.
            last: (H,) the newest committed output; root: (1,) long.
            size: the expansion's (total_tokens, depth): each size is captured once and replayed.

        Returns:
            expand's outputs (graph-owned when replayed: overwritten by the next call).
        """
        if self._last.shape != last.shape or self._last.dtype != last.dtype:
            self._last, self.captured = last.new_zeros(last.shape), {}
        self._last.copy_(last)
        self._root.copy_(root)
        self.cache.fixed = True
        try:
            if not self.graphs:
                self.graph = None
                return expand(self._last, self._root)
            out = replay_or_run(
                self.captured,
                size,
                lambda: expand(self._last, self._root),
                self._root.device,
                "the EAGLE-2 tree expansion",
            )
            self.graph = self.captured[size]
            self.graphs = self.graph is not None  # a failed capture: eager from now on
            return out
        finally:
            self.cache.fixed = False
