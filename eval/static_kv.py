"""A preallocated KV cache with a length counter: tree verification without `torch.cat` or crops.

Per layer one (1, kv_heads, max_len, head_dim) buffer for keys and one for values, allocated once. The
decoder owns `length` (committed positions). A forward over L new positions writes them at
[length, length + L); afterwards the accepted path is compacted *in place* (an index copy per layer) and
`length` advances by the accepted count - nothing is freed or reallocated:

    buffer [ committed (length) | node 0 | node 1 | ... | node L-1 | stale ... ]
    after  [ committed (length) | path[0] | ... | path[a-1] | stale ... ]          length += a

Two shapes of the same buffers:
  * `static=False` (eager, the CPU default): attention sees the views `[:, :, :length + L]`, so its
    cost follows the real length, and `length` is a Python int.
  * `static=True` (CUDA graphs): attention sees the whole buffer, every stale position masked by the
    decoder's 4D mask; writes go through `write_pos` and `length_t`, device tensors, so a captured graph
    replays for any length. Shapes never change between steps.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin


def kv_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a HF decoder's attention, read from its text config."""
    cfg = cast(PreTrainedModel, model).config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


class StaticKVLayer(CacheLayerMixin):
    """One layer's preallocated buffers; reads the write position from its owning `StaticKVCache`."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: StaticKVCache, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.owner = owner
        self.keys: Tensor = keys  # (1, kv_heads, max_len, head_dim)
        self.values: Tensor = values  # (1, kv_heads, max_len, head_dim)
        self.is_initialized = True
        self.is_compileable = owner.static

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Buffers are allocated up front; nothing to do."""

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write L new positions after the committed ones; return what attention reads.

        Args:
            key_states, value_states: (1, kv_heads, L, head_dim).

        Returns:
            keys, values: (1, kv_heads, length + L, head_dim) views (eager) or the whole buffers (static).
        """
        n = key_states.shape[-2]
        keys, values = self.keys, self.values
        if self.owner.static:
            idx = self.owner.write_pos[:n]  # (L,) device positions length_t + arange(L)
            keys.index_copy_(2, idx, key_states.to(keys.dtype))
            values.index_copy_(2, idx, value_states.to(values.dtype))
            return keys, values
        start = self.owner.length
        keys[:, :, start : start + n] = key_states
        values[:, :, start : start + n] = value_states
        return keys[:, :, : start + n], values[:, :, : start + n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for transformers' own masks (prefill and one-token steps)."""
        if self.owner.static:
            return self.owner.max_len, 0
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        """Committed positions."""
        return self.owner.length

    def get_max_length(self) -> int:
        """Capacity in positions."""
        return self.owner.max_len


class StaticKVCache(Cache):
    """Preallocated full-attention KV cache with a length counter (see module docstring).

    Args:
        model: the HF causal LM whose layers fill it.
        max_len: capacity in positions (prompt + new tokens + one tree).
        static: whole-buffer attention and device-side positions (for CUDA graphs).
    """

    def __init__(self, model: torch.nn.Module, max_len: int, static: bool = False) -> None:
        emb = cast(torch.nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
        device, dtype = emb.device, emb.dtype
        n_layers, kv_heads, head_dim = kv_geometry(model)
        self.static, self.max_len, self.length = static, max_len, 0
        self.length_t = torch.zeros((), dtype=torch.long, device=device)  # mirrors `length` on the device
        self.write_pos = torch.arange(max_len, device=device)  # (max_len,) static write positions
        # every layer's keys and values are views of one buffer, so a commit moves them all in two kernels
        self.buffer = torch.zeros(n_layers, 2, 1, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        layers: list[StaticKVLayer] = [  # (1, kv_heads, max_len, head_dim) views each
            StaticKVLayer(self, self.buffer[i, 0], self.buffer[i, 1]) for i in range(n_layers)
        ]
        super().__init__(layers=list[Any](layers))
        self.kv_layers = layers  # the same objects, typed

    def check_room(self, n: int) -> None:
        """Raise when `n` more positions do not fit."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {n} positions > max_len {self.max_len}")

    def set_length(self, length: int) -> None:
        """Declare `length` positions committed (host and device counters)."""
        self.length = length
        self.length_t.fill_(length)

    def advance(self, n: int) -> None:
        """n positions written after the committed ones are kept as they are (a prefill, an AR step)."""
        self.length += n
        self.length_t += n

    def prepare_write(self, n: int) -> None:
        """Static mode: the next forward writes n positions at [length_t, length_t + n) (device op, no sync)."""
        torch.add(torch.arange(n, device=self.length_t.device), self.length_t, out=self.write_pos[:n])

    def commit(self, path: Tensor, accepted: int, in_place: bool | None = None) -> None:
        """Keep the first `accepted` entries of `path` (tree node indices) right after the committed prefix.

        Args:
            path: (k,) long node indices, ascending, `path[i] >= i`, `path[0] == 0`; entries past `accepted`
                are ignored (a padded, fixed-shape path may fill them with anything in range).
            accepted: a, the number of nodes kept (root included); `length` advances by a.
            in_place: whether `path[:a] == arange(a)` (nothing to move), when the caller already knows it
                from the host copy of the path; None: read it from `path` (a host sync on a GPU).
        """
        start, buf = self.length, self.buffer  # buf: (layers, 2, 1, kv_heads, max_len, head_dim)
        if self.static:  # fixed shape: copy all k slots; slots >= a land past the new length (stale)
            if not in_place:  # (in place: the accepted nodes already sit right after the prefix)
                k = path.shape[0]
                keep = torch.arange(k, device=path.device) < accepted
                src = torch.where(keep, path, torch.arange(k, device=path.device)) + self.length_t  # (k,)
                dst = self.length_t + torch.arange(k, device=path.device)  # (k,)
                buf.index_copy_(4, dst, buf.index_select(4, src))  # index_select copies first
            self.length_t += accepted
            self.length = start + accepted
            return
        path = path[:accepted]
        if in_place is None:
            in_place = not accepted or int(path[-1]) == accepted - 1
        if not in_place:
            src = path + start  # (a,)
            buf[:, :, :, :, start : start + accepted] = buf.index_select(4, src)
        self.set_length(start + accepted)
