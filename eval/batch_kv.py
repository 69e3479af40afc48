"""A preallocated KV cache for B rows with per-row lengths: batched tree verification and compaction.

The batched sibling of `static_kv.StaticKVCache` (its `static=True` shape): per layer one
(B, kv_heads, max_len, head_dim) buffer for keys and one for values, all of them views of ONE buffer of every
layer (layers, 2, B, kv_heads, max_len, head_dim), allocated once. Row r holds
`lengths[r]` committed positions. A forward over rows `rows` writes its L new positions of row r at
`write_pos[r]` (set by the decoder, usually [length_r, length_r + L)); attention reads the first `span`
positions of those rows (the decoder passes the longest row's length + L, so attention and the GQA key
expansion scale with what is filled rather than with `max_len`), and the decoder's 4D mask hides every stale
position. Afterwards each row's accepted path is compacted in place (one index_select + index_copy_ over the
one buffer, for every layer and row at once: 2 kernels, not 4 per layer; only the first max_r a_r slots move)
and each length advances by its own accepted count:

    row 0  [ committed (len_0) | node 0 | node 1 | pad ... | stale ]  ->  [ committed | path_0 ... | stale ]
    row 1  [ committed (len_1)      | node 0 | node 1 | node 2 | stale ]  ->  ...
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specdraft.eval.static_kv import kv_geometry


class BatchKVLayer(CacheLayerMixin):
    """One layer's (B, kv_heads, max_len, head_dim) buffers; reads rows and write positions from its owner."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: BatchKVCache, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys: Tensor = keys  # (B, kv_heads, max_len, head_dim)
        self.values: Tensor = values  # (B, kv_heads, max_len, head_dim)
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Buffers are allocated up front; nothing to do."""

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write L new positions per row where the owner's `prepare_write` said (`write_index`); return the rows'
        first `span` positions.

        Args:
            key_states, value_states: (R, kv_heads, L, head_dim), R = the rows of `owner.rows`.

        Returns:
            keys, values: (R, kv_heads, span, head_dim) views of the written rows.
        """
        rows, span = self.owner.rows, self.owner.span
        idx = self.owner.write_index  # (R * kv * L,) rows of the flat buffers
        d = self.keys.shape[-1]
        self.keys.view(-1, d).index_copy_(0, idx, key_states.to(self.keys.dtype).reshape(-1, d))
        self.values.view(-1, d).index_copy_(0, idx, value_states.to(self.values.dtype).reshape(-1, d))
        return self.keys[rows, :, :span], self.values[rows, :, :span]  # views

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): attention reads the first `span` positions."""
        return self.owner.span, 0

    def get_seq_length(self) -> int:
        """Longest committed row (the decoder always passes explicit positions and masks)."""
        return max(self.owner.lengths)

    def get_max_length(self) -> int:
        """Capacity in positions per row."""
        return self.owner.max_len


class BatchKVCache(Cache):
    """Preallocated full-attention KV cache of `batch_size` rows with per-row lengths (module docstring).

    Args:
        model: the HF causal LM whose layers fill it.
        batch_size: B, the number of rows.
        max_len: capacity in positions per row (prompt + new tokens + one tree).
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int) -> None:
        emb = cast(torch.nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
        device, dtype = emb.device, emb.dtype
        n_layers, kv_heads, head_dim = kv_geometry(model)
        self.num_rows, self.max_len = batch_size, max_len
        self.lengths = [0] * batch_size  # host copy of `lengths_t`
        self.lengths_t = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        # the rows the next forward writes: a slice, or (R,) long row indices
        self.rows: slice | Tensor = slice(0, batch_size)
        self.kv_heads = kv_heads
        self.write_index = torch.zeros(0, dtype=torch.long, device=device)  # (R * kv * L,) `prepare_write`'s
        self.span = max_len  # positions the next forward's attention reads per row (<= max_len)
        # (layers, 2, B, kv_heads, max_len, head_dim): every layer's keys and values, one commit for all
        self.buffer = torch.zeros(
            n_layers, 2, batch_size, kv_heads, max_len, head_dim, dtype=dtype, device=device
        )
        layers = [BatchKVLayer(self, self.buffer[i, 0], self.buffer[i, 1]) for i in range(n_layers)]
        super().__init__(layers=list[Any](layers))
        self.kv_layers = layers  # the same objects, typed

    def prepare_write(self, rows: slice | Tensor, write_pos: Tensor, span: int | None = None) -> None:
        """The next forward runs rows `rows` (R of them: a slice, or (R,) long row indices, e.g. a prefill of
        rows that are not adjacent, whose keys are then read as a copy), writes their L positions at `write_pos`
        (R, L) and attends over each row's first `span` positions (None: all `max_len`; every write must fall
        below it)."""
        self.rows = rows
        self.write_index = self.flat_index(rows, write_pos)  # (R * kv * L,): once per forward, not per layer
        self.span = self.max_len if span is None else min(span, self.max_len)

    def flat_index(self, rows: slice | Tensor, pos: Tensor) -> Tensor:
        """Row indices into a layer buffer viewed as (B * kv_heads * max_len, head_dim) of positions `pos`
        (R, L) of rows `rows` (R of them), for every key/value head: (R * kv_heads * L,), laid out as
        (R, kv_heads, L) (`index_copy_` / `index_select` move whole head_dim rows: on a CPU ~100x cheaper
        than `scatter_` / `gather` with an expanded index, which visit every element)."""
        kv = self.kv_heads
        if isinstance(rows, slice):
            start = rows.start or 0
            r = torch.arange(start, start + pos.shape[0], device=pos.device)  # (R,)
        else:
            r = rows.to(pos.device)  # (R,)
        heads = torch.arange(kv, device=pos.device)
        return ((r[:, None, None] * kv + heads[None, :, None]) * self.max_len + pos[:, None, :]).reshape(-1)

    def set_length(self, row: int, length: int) -> None:
        """Declare `length` positions of `row` committed (host and device counters)."""
        self.lengths[row] = length
        self.lengths_t[row] = length

    def commit(self, path: Tensor, accepted: list[int], in_place: bool | None = None) -> None:
        """Keep, in every row r, the first `accepted[r]` entries of `path[r]` right after its committed prefix.

        Args:
            path: (B, k) long node indices per row, ascending, `path[r, i] >= i`; entries past `accepted[r]`
                are ignored (only the first max_r accepted[r] columns are read). A row with `accepted[r] == 0`
                is left as it is.
            accepted: (B,) host counts a_r (root included); `lengths[r]` advances by a_r.
            in_place: whether every row's kept entries are already in place (`path[r, :a_r] == arange(a_r)`),
                when the caller knows it from the host copy of the paths; None: read it from `path` (a host
                sync on a GPU).
        """
        k = max(accepted, default=0)  # slots past every row's accepted count stay where they are
        path = path[:, :k]  # (B, k)
        acc = torch.tensor(accepted, dtype=torch.long, device=path.device)  # (B,)
        slot = torch.arange(k, device=path.device)[None]  # (1, k)
        src = torch.where(slot < acc[:, None], path, slot) + self.lengths_t[:, None]  # (B, k)
        if in_place is None:
            in_place = bool((src == slot + self.lengths_t[:, None]).all())
        if not in_place and k > 0:  # some row's path is not in place
            rows = slice(0, self.num_rows)
            block = self.num_rows * self.kv_heads * self.max_len  # rows of one (B, kv, max_len, d) buffer
            first = (
                torch.arange(self.buffer.shape[0] * 2, device=path.device)[:, None] * block
            )  # (2 layers, 1)
            src_i = (first + self.flat_index(rows, src)).reshape(-1)  # (2 layers * B * kv * k,)
            dst_i = (first + self.flat_index(rows, self.lengths_t[:, None] + slot)).reshape(-1)
            flat = self.buffer.view(-1, self.buffer.shape[-1])
            flat.index_copy_(0, dst_i, flat.index_select(0, src_i))  # index_select copies first
        self.lengths_t += acc
        self.lengths = [n + a for n, a in zip(self.lengths, accepted, strict=True)]
