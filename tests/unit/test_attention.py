"""Grouped-query SDPA without repeat_kv on the CPU (models/attention.py): same outputs, the copy-free path taken."""

from __future__ import annotations

import copy

import pytest
import torch

from specdraft.models import attention
from specdraft.models.attention import NAME, use_gqa_sdpa
from specdraft.models.hf_compat import cache_kwargs, returned_cache
from specdraft.testing import tiny_target

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_same_outputs_as_transformers_sdpa_and_no_repeat_kv(arch, monkeypatch):
    """Padded batches, a tree-shaped 4D mask and one-token steps: bit-identical logits in fp32; masked
    multi-token queries never reach transformers' function (which would copy K/V per group)."""
    ref = tiny_target(arch, CPU).float()
    assert ref.config.num_key_value_heads < ref.config.num_attention_heads  # grouped-query attention
    model = copy.deepcopy(ref)
    assert use_gqa_sdpa(model) and model.config._attn_implementation == NAME
    assert ref.config._attn_implementation == "sdpa"
    calls: list[tuple[int, bool]] = []  # (query length, masked) of every delegated call
    plain = attention.sdpa_attention_forward

    def counted(module, query, key, value, mask, **kw):
        calls.append((query.shape[2], mask is not None))
        return plain(module, query, key, value, mask, **kw)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, 12), generator=g)
    pad = torch.ones(3, 12, dtype=torch.long)
    pad[0, :4] = 0  # left padding
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=pad).logits, ref(ids, attention_mask=pad).logits)
        assert not any(masked and n > 1 for n, masked in calls)
        # a tree after a cached prefix: node i sees the prefix, the root and itself (4D additive mask)
        prefix, n = 7, 4
        allow = torch.zeros(n, prefix + n, dtype=torch.bool)
        allow[:, : prefix + 1] = True
        allow[torch.arange(n), prefix + torch.arange(n)] = True
        mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)[None, None]
        full = torch.randint(0, 100, (1, prefix + n), generator=g)
        out = []
        for m in (model, ref):
            past = returned_cache(m(full[:, :prefix], use_cache=True))
            pos = (prefix + torch.tensor([0, 1, 1, 1]))[None]
            out.append(
                m(full[:, prefix:], attention_mask=mask, position_ids=pos, **cache_kwargs(m, past)).logits
            )
        assert torch.equal(out[0], out[1])
        # as the decoders call it (`forward_with_hidden`: output_hidden_states and a cache): the same path
        from specdraft.models.base_llm import forward_with_hidden

        past = [returned_cache(m(full[:, :prefix], use_cache=True)) for m in (model, ref)]
        got = [
            forward_with_hidden(m, full[:, prefix:], mask, pos, c, layers=(1,), use_cache=True)
            for m, c in zip((model, ref), past, strict=True)
        ]
        assert torch.equal(got[0].logits, got[1].logits) and torch.equal(got[0].layers, got[1].layers)
    assert calls and all(n == 1 or not masked for n, masked in calls)  # prefill and one-token steps delegate


def test_other_attention_implementations_are_left_alone():
    model = tiny_target("llama", CPU)
    model.set_attn_implementation("eager")
    assert not use_gqa_sdpa(model) and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("batch, length, mask_batch", [(3, 2, 3), (4, 8, 4), (2, 3, 1), (1, 4, 1), (3, 9, 3)])
def test_batched_short_queries_packed_per_kv_head(batch, length, mask_batch, monkeypatch):
    """Rows of a few query tokens are packed per key/value head (groups x L query rows, the mask tiled):
    the same attention as repeating K/V (fp64 reference); long queries keep `enable_gqa`."""
    heads, kv_heads, keys, d = 6, 2, 11, 8
    g = torch.Generator().manual_seed(length)
    q = torch.randn(batch, heads, length, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, keys, d, generator=g, dtype=torch.float64) for _ in range(2))
    allow = torch.rand(mask_batch, 1, length, keys, generator=g) < 0.7
    allow[..., 0] = True  # every query sees something
    mask = torch.zeros(allow.shape, dtype=torch.float64).masked_fill(~allow, torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    seen: list[int] = []  # query heads of every SDPA call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *a, **kw):
        seen.append(query.shape[1])
        return sdpa(query, *a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    out, _ = attention.gqa_sdpa_forward(module, q, k, v, mask, scaling=d**-0.5)  # (B, L, heads, d)
    reps = heads // kv_heads
    ref = sdpa(q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    packs = length * reps <= attention.PACK_MAX_ROWS
    assert seen == [kv_heads if packs else heads]


@pytest.mark.parametrize("dtype, batch", [(torch.bfloat16, 1), (torch.float32, 1), (torch.float32, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_one_new_token_attends_per_kv_head(dtype, batch, masked, monkeypatch):
    """A decode step's single query token (no mask: every cached position is visible; or a one-row mask) is
    packed per key/value head too (bf16 at batch 1: ~5x cheaper than torch's per-query-head kernel on a CPU),
    except at batch 1 in float32, where that kernel is faster. Same values as repeating K/V."""
    heads, kv_heads, keys, d = 6, 2, 13, 8
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, heads, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, keys, d, generator=g).to(dtype) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(1, 1, 1, keys, dtype=torch.bool)
        mask[..., 3] = False
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]
    seen: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *a, **kw):
        seen.append(query.shape[1])
        return sdpa(query, *a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    out, _ = attention.gqa_sdpa_forward(module, q, k, v, mask, scaling=d**-0.5)  # (B, 1, heads, d)
    reps = heads // kv_heads
    wide = [x.double() for x in (q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1))]
    ref = sdpa(*wide, attn_mask=mask, scale=d**-0.5).transpose(1, 2)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    packs = not (batch == 1 and dtype == torch.float32)
    assert seen == [kv_heads if packs else heads]


def test_varying_shape_sdpa_leaves_out_cudnn_on_cuda_only():
    """Eager forwards of changing shapes on CUDA avoid cuDNN's SDPA (a graph built per new shape: ~50 ms a call
    on an H100); the other backends stay on, the flags come back afterwards, and a CPU call changes nothing."""
    from specdraft.models.attention import varying_shape_sdpa

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with varying_shape_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with varying_shape_sdpa(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
