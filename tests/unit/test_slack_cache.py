"""distill/slack_cache.py: appends in place, holds what `DynamicLayer` holds, adopts replaced tensors."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from specdraft.distill import generate
from specdraft.distill.generate import GenerationSettings, generate_batched
from specdraft.distill.slack_cache import SLACK, SlackLayer, slack_cache
from specdraft.testing import tiny_llama


def _kv(b: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(b, 2, n, 4, dtype=torch.float64, generator=g),
        torch.randn(b, 2, n, 4, dtype=torch.float64, generator=g),
    )  # (B, heads, n, d) each


def test_slack_layer_equals_dynamic_layer_and_appends_in_place():
    g = torch.Generator().manual_seed(0)
    ours, ref = slack_cache(), DynamicCache()
    ptrs = []
    for n in [7] + [1] * (SLACK + 3) + [5]:  # a prefill, decode steps past the room, a multi-token step
        k, v = _kv(3, n, g)
        for layer in (0, 1):
            a, b = ours.update(k, v, layer), ref.update(k, v, layer)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        layer0 = ours.layers[0]
        assert isinstance(layer0, SlackLayer) and layer0._buffers is not None
        ptrs.append(layer0._buffers[0].data_ptr())
    assert ours.get_seq_length() == ref.get_seq_length() == 7 + SLACK + 3 + 5
    # one buffer for the prefill and the first SLACK decode steps, a fresh one when the room ran out
    assert len(set(ptrs[: SLACK + 1])) == 1 and ptrs[SLACK + 1] != ptrs[0]


def test_slack_layer_adopts_keys_replaced_from_outside():
    """Rows leaving (index + trimmed columns) or joining (a new tensor): the next update starts from them."""
    g = torch.Generator().manual_seed(1)
    ours, ref = slack_cache(), DynamicCache()
    k, v = _kv(3, 6, g)
    ours.update(k, v, 0), ref.update(k, v, 0)
    for cache in (ours, ref):  # as distill.generate._select does
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys[[0, 2], :, 2:], layer.values[[0, 2], :, 2:]
    k, v = _kv(2, 1, g)
    a, b = ours.update(k, v, 0), ref.update(k, v, 0)
    assert a[0].shape == (2, 2, 5, 4) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for cache in (ours, ref):  # a view into its own buffer, but narrower rows: never written through
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys[:1], layer.values[:1]
    k, v = _kv(1, 1, g)
    a, b = ours.update(k, v, 0), ref.update(k, v, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_decode_steps_run_the_lean_forward(monkeypatch):
    """Only prefills reach transformers' forward: every decode step takes `fast_forward` on the slack cache."""
    model = tiny_llama(dtype=torch.float64)
    calls: list[int] = []
    orig = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return orig(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    caches: list[object] = []
    inner = generate._forward

    def seen(model, ids, mask, pos, cache, capture):
        caches.append(cache)
        return inner(model, ids, mask, pos, cache, capture)

    monkeypatch.setattr(generate, "_forward", seen)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    out = generate_batched(model, prompts, GenerationSettings(max_batch_size=2), max_new_tokens=[6, 6, 6])
    assert all(g.length == 6 for g in out)
    assert calls and all(n > 1 for n in calls)  # prefills only (every prompt has > 1 token)
    assert len(caches) > len(calls)  # decode steps happened, none through model.forward
    assert all(isinstance(layer, SlackLayer) for c in caches for layer in getattr(c, "layers", []))
