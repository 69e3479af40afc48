"""KV cache for tree verification over transformers' `DynamicCache` (5.x layer API).

One verification forward appends the K/V of all N tree nodes after the P cached prefix positions:

    cache  [ prefix (P) | node 0 (root) | node 1 | ... | node N-1 ]

Afterwards only the accepted path (root first, ascending node indices) is kept, moved into place right
after the prefix, and the rest is cut off - a gather + crop per layer, no recomputation:

    cache  [ prefix (P) | path[0] | path[1] | ... | path[a-1] ]           (length P + a)

`DynamicLayer.crop` takes a *negative* count in transformers 5.x (number of positions to drop).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer


def new_cache(model: torch.nn.Module, max_len: int | None = None) -> DynamicCache:
    """An empty cache of full-attention `DynamicLayer`s for `model`.

    Sliding-window layers are not used (their ring buffers cannot be compacted); a model with a sliding
    window is accepted only while the whole sequence fits in the window (`max_len`), where both agree.
    """
    cfg = cast(PreTrainedModel, model).config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window and max_len is not None and max_len > window:
        raise NotImplementedError(
            f"sequence of up to {max_len} tokens exceeds the model's sliding window ({window}); "
            "the tree decoder supports full attention only"
        )
    return DynamicCache()


def cache_len(cache: DynamicCache) -> int:
    """Positions currently held (taken from layer 0)."""
    return cache.get_seq_length()


def check_supported(cache: DynamicCache) -> None:
    """Refuse caches whose layers are not plain full-attention `DynamicLayer`s (e.g. sliding windows)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"tree decoding needs full-attention DynamicLayer caches; layer {i} is {type(layer).__name__}"
            )


def keep_accepted(cache: DynamicCache, prefix_len: int, path: Tensor) -> None:
    """Keep the prefix plus the accepted tree nodes' K/V, compacted into place (in place).

    Args:
        cache: holds P + N positions (prefix + the tree of the last forward).
        prefix_len: P.
        path: (a,) long node indices, ascending, `path[0] == 0` (the root).
    """
    a = path.shape[0]
    n_drop = cache_len(cache) - prefix_len - a  # tree nodes to drop
    if n_drop < 0:
        raise ValueError(f"keep_accepted: cache holds {cache_len(cache)} < prefix {prefix_len} + path {a}")
    contiguous = int(path[-1]) == a - 1  # path == arange(a): nothing to move
    src = path + prefix_len  # (a,) absolute positions
    for layer in cast("list[DynamicLayer]", cache.layers):  # `check_supported`: plain DynamicLayers
        if not contiguous:
            k, v = layer.keys, layer.values  # (B, heads, P+N, head_dim)
            assert k is not None and v is not None  # filled by the forward that appended the tree
            k[:, :, prefix_len : prefix_len + a] = k.index_select(2, src)  # index_select copies first
            v[:, :, prefix_len : prefix_len + a] = v.index_select(2, src)
        if n_drop:
            layer.crop(-n_drop)


def rollback(cache: DynamicCache, length: int) -> None:
    """Crop the cache back to `length` positions."""
    n_drop = cache_len(cache) - length
    if n_drop > 0:
        cache.crop(-n_drop)
