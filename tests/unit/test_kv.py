"""KV compaction over transformers' DynamicCache: gather the accepted path into place, crop the rest."""

import pytest
import torch
from transformers import DynamicCache

from specdraft.eval.kv import cache_len, keep_accepted, rollback


def _filled_cache(num_layers: int, length: int) -> DynamicCache:
    """Layer l, position t holds the value 1000*l + t in every head/channel (keys) and its negative (values)."""
    cache = DynamicCache()
    for layer in range(num_layers):
        pos = torch.arange(length, dtype=torch.float32) + 1000 * layer
        k = pos.view(1, 1, length, 1).expand(1, 2, length, 3).clone()  # (B, heads, L, head_dim)
        cache.update(k, -k, layer)
    return cache


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ([0], [5]),  # nothing accepted: only the root survives
        ([0, 1, 2], [5, 6, 7]),  # contiguous: crop only
        ([0, 2, 5], [5, 7, 10]),  # scattered: gather into place
        ([0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10]),  # everything accepted
    ],
)
def test_keep_accepted_compacts_in_place(path, kept):
    prefix, n = 5, 6
    cache = _filled_cache(num_layers=3, length=prefix + n)
    keep_accepted(cache, prefix, torch.tensor(path))
    assert cache_len(cache) == prefix + len(path)
    for layer_idx, layer in enumerate(cache.layers):
        expect = torch.tensor(list(range(prefix)) + kept, dtype=torch.float32) + 1000 * layer_idx
        assert torch.equal(layer.keys[0, 1, :, 2], expect)
        assert torch.equal(layer.values[0, 0, :, 0], -expect)


def test_cache_keeps_growing_after_compaction():
    cache = _filled_cache(num_layers=2, length=8)
    keep_accepted(cache, 4, torch.tensor([0, 3]))
    k = torch.full((1, 2, 1, 3), 99.0)
    cache.update(k, -k, 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 99]


def test_keep_accepted_rejects_short_cache():
    cache = _filled_cache(num_layers=1, length=4)
    with pytest.raises(ValueError, match="cache holds"):
        keep_accepted(cache, 3, torch.tensor([0, 1, 2]))


def test_rollback():
    cache = _filled_cache(num_layers=2, length=9)
    rollback(cache, 4)
    assert cache_len(cache) == 4
