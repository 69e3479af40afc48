"""A KV cache for distill's batched generation that appends a decode step in place instead of copying itself.

transformers' `DynamicLayer.update` grows the keys and values by `torch.cat`: every decode step copies each
layer's whole cache to add one column. On a 2-core AMD EPYC (Zen 3, fp32) that copy was the largest op of a
distill decode step: SmolLM2-135M, 16 rows over 400 cached positions, `aten::cat` took ~1.5 of the ~2 s
the profiler saw over six steps (docs/experiments.md, "Session 39"). `SlackLayer` keeps each layer in a
buffer with room past its length and exposes the filled part as a view:

    buffer (B, heads, capacity, d):  k k k k k k k . . . . .      k = cached columns, . = room
    layer.keys = buffer[:, :, :length]                            (a view: what attention reads)
    update(n new columns)          -> written into the room, the view widened (no copy of the k's)

When the room runs out, or the generation loop replaced `keys` / `values` (rows leaving or joining a batch,
`distill.generate._select` / `_merge`), the next update moves the cache into a fresh buffer with
`SLACK` columns of room (one copy, which the replacing already paid in kind). Values are the same as
`DynamicLayer`'s: the same tensors in the same order, only stored with room after them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

SLACK = 64  # columns of room a fresh buffer gets past what it holds (one copy per this many decode steps)


class SlackLayer(DynamicLayer):
    """A `DynamicLayer` whose keys / values are views of buffers with room for `SLACK` more columns."""

    def __init__(self) -> None:
        super().__init__()
        self._buffers: tuple[Tensor, Tensor] | None = None  # (B, heads, capacity, d) each
        self._views: tuple[Tensor, Tensor] | None = (
            None  # the keys / values this layer last set (of `_buffers`)
        )

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Append key/value states (B, heads, n, d) after the cached columns; returns the (B, heads, S + n, d)
        views attention reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._fits(key_states.shape[-2]):
            self._move(key_states, value_states)
        assert self._buffers is not None and self.keys is not None  # set by `_move`
        kbuf, vbuf = self._buffers
        s, n = self.keys.shape[-2], key_states.shape[-2]
        kbuf[:, :, s : s + n].copy_(key_states)
        vbuf[:, :, s : s + n].copy_(value_states)
        self.keys, self.values = kbuf[:, :, : s + n], vbuf[:, :, : s + n]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def _fits(self, n: int) -> bool:
        """Whether `keys` / `values` are still the views this layer set (no one replaced them) and the room
        takes n more columns."""
        if self._buffers is None or self._views is None or self.keys is None:
            return False
        own = self.keys is self._views[0] and self.values is self._views[1]
        return own and self.keys.shape[-2] + n <= self._buffers[0].shape[-2]

    def _move(self, key_states: Tensor, value_states: Tensor) -> None:
        """Copy the cached columns into fresh buffers with room for the n new ones + `SLACK` more."""
        n, moved = key_states.shape[-2], []
        for old, states in ((self.keys, key_states), (self.values, value_states)):
            s = old.shape[-2] if old is not None and old.ndim == 4 else 0  # lazy init leaves an empty 1-D
            buf = states.new_empty((*states.shape[:2], s + n + SLACK, states.shape[-1]))  # (B, h, cap, d)
            if old is not None and s:
                buf[:, :, :s].copy_(old)
            moved.append((buf, s))
        (kbuf, ks), (vbuf, vs) = moved
        self._buffers = (kbuf, vbuf)
        self.keys, self.values = kbuf[:, :, :ks], vbuf[:, :, :vs]

    def reset(self) -> None:
        """Drop the cache and its buffers."""
        self._buffers = self._views = None
        super().reset()


def slack_cache() -> DynamicCache:
    """An empty `DynamicCache` whose layers (made on first use) are `SlackLayer`s."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = SlackLayer
    return cache
