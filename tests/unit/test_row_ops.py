"""The row kernels of a decoder layer (models/row_ops.py): equal to torch's ops (the rotary embedding bit for bit),
row-invariant, taken by the lean forward on panel targets, lossless, and switched off by SPECDRAFT_ROW_OPS=0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import fast_target, row_ops
from specdraft.models.hf_compat import cache_kwargs
from specdraft.models.panel_linear import panel_available, panel_linears, panel_status
from specdraft.testing import (
    RandomTreeProposer,
    check_static_equals_ar,
    random_prompts,
    tiny_target,
)

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not panel_available(), reason=f"panel kernel: {panel_status()[1]}")


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def test_rms_norm_and_the_fused_residual_add_equal_torch_per_row() -> None:
    """The norm equals transformers' (w * F.rms_norm) to rounding; the residual sum is exact; a row's bits do not
    depend on the other rows (one row alone, then among seven)."""
    x, a, w = _rand(7, 96, seed=1) * 3, _rand(7, 96, seed=2), _rand(96, seed=3)
    want = w * F.rms_norm(x, (96,), eps=1e-5)
    got = row_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(row_ops.rms_norm(x[3:4].clone(), w, 1e-5)[0], got[3])
    s, h = row_ops.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(s, x + a)
    torch.testing.assert_close(h, w * F.rms_norm(x + a, (96,), eps=1e-5), rtol=2e-6, atol=1e-6)
    assert torch.equal(row_ops.add_rms_norm(x[5:6].clone(), a[5:6].clone(), w, 1e-5)[1][0], h[5])


def test_rope_equals_the_lean_forwards_rotate_bit_for_bit() -> None:
    """q and k heads at the start of a wider (q | k | v) product, rows strided: rotated in place exactly as
    `fast_target.rotate`, v untouched; a table per position shared by the batch's rows (r % rows)."""
    b, n, d, hq, hk = 2, 3, 8, 4, 2
    qkv = _rand(b, n, (hq + 2 * hk) * d, seed=4)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, d)[None]  # (n, d)
    cos, sin = pos.cos()[None, None], pos.sin()[None, None]  # (1, 1, n, d)
    tables = fast_target.rotary_tables(cos, sin)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    want_q, want_k = (
        fast_target.rotate(t.reshape(b, n, -1, d).transpose(1, 2), *tables).transpose(1, 2).reshape(b, n, -1)
        for t in (q, k)
    )
    v0 = v.clone()
    row_ops.rope_(qkv.view(-1, qkv.shape[-1]), hq + hk, d, *(t.reshape(-1, d) for t in tables))
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v0)
    with pytest.raises(ValueError, match="head_dim"):
        row_ops.rope_(torch.zeros(1, 6), 2, 3, torch.zeros(1, 3), torch.zeros(1, 3))


def test_silu_mul_equals_torch_on_the_halves_of_one_product() -> None:
    gate_up = _rand(5, 2, 40, seed=5).view(5, 80)
    gate, up = gate_up.split(40, dim=-1)  # (5, 40) each, rows 80 apart
    got = row_ops.silu_mul(gate, up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-7)
    assert got.is_contiguous()
    # each element alone: columns 8-12 through the padded tail of a 13-wide row equal the 8-wide vectors' bits
    narrow = row_ops.silu_mul(gate[:, :13].contiguous(), up[:, :13].contiguous())
    assert torch.equal(narrow, got[:, :13])
    big = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]])
    torch.testing.assert_close(row_ops.silu_mul(big, torch.ones(1, 5)), F.silu(big), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="one shape"):
        row_ops.silu_mul(gate, up[:, :20])


@pytest.mark.parametrize("d", [8, 24, 40, 64, 72])
def test_attention_at_every_head_width_equals_torch_and_is_row_invariant(d: int) -> None:
    """The value sums run in chunks of up to 32 columns, the last 8-24 in one more pass: every head width that
    is a multiple of 8 equals torch's SDPA to rounding, and a query alone has the bits it has among others."""
    b, hq, hkv, n, s = 1, 6, 2, 3, 37
    q, k, v = _rand(b, hq, n, d, seed=d), _rand(b, hkv, s, d, seed=d + 1), _rand(b, hkv, s, d, seed=d + 2)
    mask = torch.zeros(b, 1, n, s)
    mask[..., ::5] = torch.finfo(torch.float32).min
    got = row_ops.attention(q, k, v, mask, d**-0.5)
    assert got is not None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
    alone = row_ops.attention(q[:, :, 1:2], k, v, mask[:, :, 1:2], d**-0.5)
    assert alone is not None and torch.equal(alone[:, 0], got[:, 1])


@pytest.mark.parametrize("d", [8, 24, 40, 64, 72])
def test_attention_gives_the_same_bits_on_the_avx512_and_avx2_paths(d: int) -> None:
    """Where the CPU has AVX-512, the attention's key dots run two keys a zmm and its 32-column value sums 16
    columns a zmm (`SPECDRAFT_AVX512`): every head width, key count (4 at a time and the rest), grouped head
    count (3, 2 and 1 a key/value head) and masked key gives the AVX2 path's bits; a no-op check without it."""
    from specdraft.models.exact_panels import set_avx512

    b, hkv, n = 2, 2, 4
    try:
        for hq, s in ((6, 37), (4, 9), (2, 3)):  # 3 / 2 / 1 query heads a key/value head
            q, k, v = (
                _rand(b, hq, n, d, seed=d + s),
                _rand(b, hkv, s, d, seed=d + 1),
                _rand(b, hkv, s, d, seed=2),
            )
            mask = torch.zeros(b, 1, n, s)
            mask[..., ::3] = torch.finfo(torch.float32).min
            got = {}
            for on in (True, False):
                set_avx512(on)
                got[on] = row_ops.attention(q, k, v, mask, d**-0.5)
            assert got[True] is not None and got[False] is not None
            assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))
    finally:
        set_avx512(os.environ.get("SPECDRAFT_AVX512", "1") != "0")


def test_attention_equals_torch_and_a_query_sees_only_its_keys_bit_for_bit() -> None:
    """Grouped heads, a batch, a tree mask: equal to torch's SDPA to rounding. A query's output has the same bits
    alone or among others, and whether the hidden keys sit between its visible ones or not (a tree node and
    the AR step at its position), even when the hidden keys hold NaN; a query that sees nothing gets zeros."""
    b, hq, hkv, n, p, d = 2, 6, 2, 5, 11, 16
    q, k, v = _rand(b, hq, n, d, seed=6), _rand(b, hkv, p + n, d, seed=7), _rand(b, hkv, p + n, d, seed=8)
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(b, 1, n, p + n)
    mask[..., p:] = low
    parents = [-1, 0, 0, 1, 2]  # node i sees the prefix, itself and its ancestors
    for i in range(n):
        j = i
        while j >= 0:
            mask[:, 0, i, p + j] = 0.0
            j = parents[j]
    mask[1, 0, 2] = low  # batch row 1, query 2: nothing visible
    got = row_ops.attention(q, k, v, mask, 0.25)
    assert got is not None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True).transpose(
        1, 2
    )
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert not got[1, 2].any()
    alone = row_ops.attention(q[:, :, 3:4], k, v, mask[:, :, 3:4], 0.25)
    assert alone is not None and torch.equal(alone[:, 0], got[:, 3])
    # node 3 (path 0 -> 1 -> 3) as an AR step: the same keys contiguous, no mask; the hidden ones poisoned
    seen = [*range(p), p + 0, p + 1, p + 3]
    k2, v2 = k[:, :, seen].clone(), v[:, :, seen].clone()
    ar = row_ops.attention(q[:, :, 3:4], k2, v2, None, 0.25)
    k[:, :, p + 2], v[:, :, p + 4] = float("nan"), float("nan")
    tree = row_ops.attention(q, k, v, mask, 0.25)
    assert ar is not None and tree is not None and torch.equal(ar[:, 0], tree[:, 3])
    assert row_ops.attention(q, k, v, mask.bool(), 0.25) is None  # a boolean mask: torch's attention
    assert row_ops.attention(q[..., :12], k[..., :12], v[..., :12], None, 0.25) is None  # d % 8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_lean_forward_takes_them_on_panel_targets_and_stays_lossless(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 tiny panel targets: every layer of a decode step goes through the row kernels, logits as with
    torch's ops to rounding; greedy speculative decoding equals AR (eager and fixed-shape paths) and a batch
    equals batch 1 (packed padding included); `SPECDRAFT_ROW_OPS=0` takes torch's ops. The per-layer loop is
    pinned (`SPECDRAFT_LAYER_ROWS=0`); tests/unit/test_layer_rows.py checks the one-call loop against it."""
    model = tiny_target(arch, CPU).float()
    panel_linears(model)
    monkeypatch.setenv("SPECDRAFT_LAYER_ROWS", "0")
    calls: list[bool] = []  # per row-kernel layer: whether its positions were packed (a batch's padding out)
    layer_rows = fast_target._layer_rows
    monkeypatch.setattr(
        fast_target, "_layer_rows", lambda *a, **k: calls.append(a[-1] is not None) or layer_rows(*a, **k)
    )
    logits = {}
    for env in ("0", "1"):
        monkeypatch.setenv(row_ops.ENV, env)
        dec = StaticDecoder(model, 64)
        logits[env] = dec.cost_probe((4,), 12)(4)[0]  # a 4-node verify after a 12-token prefix
        assert len(calls) == (0 if env == "0" else len(model.model.layers))
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-4, atol=1e-4)
    for static in (False, True):
        check_static_equals_ar(StaticDecoder(model, 64, static=static), model, PromptLookupProposer(4))
    prompts = random_prompts([3, 11, 6])
    refs = [
        StaticDecoder(model, 64).ar_generate(None, torch.tensor(p), 12, stop_ids=set())[0] for p in prompts
    ]
    seeds = iter(range(100))  # trees of other sizes per row: the batched verify packs its padding out
    res = BatchDecoder(model, 2).generate(
        prompts, 12, stop_ids=set(), proposer_factory=lambda: RandomTreeProposer(vocab=128, seed=next(seeds))
    )
    assert [out for out, _ in res] == refs and any(calls)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tree_verify_and_ar_steps_give_the_same_logits_bit_for_bit(arch: str) -> None:
    """On a panel target with the row kernels, a 4-token chain verified in one forward (a tree mask, explicit
    positions) and the same tokens fed one AR step at a time after the same prefill give identical logits at
    every position: every per-token computation of the lean forward is row-invariant."""
    model = tiny_target(arch, CPU).float()
    panel_linears(model)
    g = torch.Generator().manual_seed(4)
    prompt, chain = torch.randint(5, 128, (1, 9), generator=g), torch.randint(5, 128, (1, 4), generator=g)
    with torch.inference_mode():
        ar_cache = DynamicCache()
        model(prompt, **cache_kwargs(model, ar_cache), use_cache=True)  # transformers' prefill, in both
        tree_cache = DynamicCache()
        model(prompt, **cache_kwargs(model, tree_cache), use_cache=True)
        steps = []
        for t in range(4):
            out = fast_target.fast_forward(model, chain[:, t : t + 1], None, None, ar_cache)
            assert out is not None
            steps.append(model.lm_head(out[0])[0, 0])
        p = prompt.shape[1]
        mask = torch.zeros(1, 1, 4, p + 4)
        mask[0, 0, :, p:] = torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)
        out = fast_target.fast_forward(model, chain, mask, torch.arange(p, p + 4)[None], tree_cache)
        assert out is not None
        tree = model.lm_head(out[0])[0]
    for t in range(4):
        assert torch.equal(tree[t], steps[t]), t
