"""The one-call decoder layer loop (models/layer_rows.py, layer_rows.c): `fast_target._layer_rows`' bits for every
layer, the cache written the same, kept layers, where it applies and where it steps aside."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval import static_decode
from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.decode import target_forward
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.static_kv import StaticKVCache
from specdraft.models import fast_target, layer_rows
from specdraft.models.hf_compat import cache_kwargs
from specdraft.models.panel_linear import PanelLinear, panel_available, panel_linears, panel_status
from specdraft.testing import check_static_equals_ar, check_trees_lossless, random_prompts, tiny_target

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not panel_available(), reason=f"panel kernel: {panel_status()[1]}")


def _gguf_like(model: torch.nn.Module) -> None:
    """Every Linear weight made a dequantised Q4_1 (blocks of 32 inputs: w = d u + m, u in 0..15), so
    `panel_linears` stores exact 4-bit panels (the embedded target's kind)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0:
                w = m.weight.view(m.out_features, -1, 32)
                lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                d = ((hi - lo) / 15).half().float().clamp_min(1e-3)
                mn = lo.half().float()
                u = ((w - mn) / d).round().clamp(0, 15)
                m.weight.copy_(torch.addcmul(mn, u, d).view_as(m.weight))


def _forward(model, ids, mask, pos, cache, layers, env, monkeypatch):
    monkeypatch.setenv(layer_rows.ENV, env)
    out = fast_target.fast_forward(model, ids, mask, pos, cache, layers)
    assert out is not None
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("exact", [False, True])
def test_one_call_equals_the_layer_loop_bit_for_bit(
    arch: str, exact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 tiny panel targets (Qwen2: biased q/k/v; fp32 or exact 4-bit panels): a one-token step and a
    5-node tree verify (explicit mask and positions) through the one-call loop give the per-layer loop's final
    states, kept layers and cache contents bit for bit; the call ran (no `_layer` call)."""
    model = tiny_target(arch, CPU).float()
    if exact:
        _gguf_like(model)
    panel_linears(model, exact=exact)
    kinds = {type(m.panels).__name__ for m in model.modules() if isinstance(m, PanelLinear)}
    assert kinds == ({"ExactPanels"} if exact else {"Tensor"})
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 128, (1, 11), generator=g)
    tree = torch.randint(5, 128, (1, 5), generator=g)
    p = prompt.shape[1]
    mask = torch.zeros(1, 1, 5, p + 5)
    parents = [-1, 0, 0, 1, 2]
    for i, par in enumerate(parents):  # a tree: node i sees its ancestors and itself
        seen, j = {i}, par
        while j >= 0:
            seen.add(j)
            j = parents[j]
        for j in range(5):
            if j not in seen:
                mask[0, 0, i, p + j] = torch.finfo(torch.float32).min
    pos = torch.tensor([[p, p + 1, p + 1, p + 2, p + 2]])
    calls: list[int] = []
    layer = fast_target._layer
    monkeypatch.setattr(fast_target, "_layer", lambda *a, **k: calls.append(1) or layer(*a, **k))
    results = {}
    with torch.inference_mode():
        for env in ("0", "1"):
            cache = StaticKVCache(model, 32)
            model(prompt, **cache_kwargs(model, cache), use_cache=True)  # transformers' prefill
            cache.set_length(p)
            calls.clear()
            one = _forward(model, tree[:, :1], None, None, cache, (1, 2), env, monkeypatch)
            many = _forward(model, tree, mask, pos, cache, (2, 3), env, monkeypatch)
            results[env] = (one, many, cache.buffer.clone(), len(calls))
    (one0, many0, buf0, n0), (one1, many1, buf1, n1) = results["0"], results["1"]
    assert n0 == 2 * len(model.model.layers) and n1 == 0
    for a, b in ((one0, one1), (many0, many1)):
        assert torch.equal(a[0], b[0]) and a[1] is not None and b[1] is not None and torch.equal(a[1], b[1])
    assert torch.equal(buf0, buf1)


def test_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan for a panel target (built once, not even checked while no module registers anything, rebuilt when a
    Linear or a norm weight is replaced, holding every tensor it points into); none on another layout or
    with the row kernels off; `fits` refuses a batch of two, a static (CUDA-graph) cache, a full cache, a
    boolean mask and several new tokens without a mask."""
    model = tiny_target("llama", CPU).float()
    dec = model.get_decoder()
    assert layer_rows.plan(dec, fast_target._layer_info) is None  # native Linears
    panel_linears(model)
    plan = layer_rows.plan(dec, fast_target._layer_info)
    assert plan is not None and layer_rows.plan(dec, fast_target._layer_info) is plan
    with monkeypatch.context() as m:  # nothing registered since: no identity check at all
        m.setattr(layer_rows, "_modules", lambda _: pytest.fail("identity checked with nothing registered"))
        assert layer_rows.plan(dec, fast_target._layer_info) is plan
    attn = dec.layers[1].self_attn
    attn.o_proj = PanelLinear(torch.nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False))
    again = layer_rows.plan(dec, fast_target._layer_info)
    assert again is not None and again is not plan
    norm = dec.layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)  # a new tensor
    third = layer_rows.plan(dec, fast_target._layer_info)
    assert third is not None and third is not again and any(t is norm.weight for t in third.held)
    again = third
    monkeypatch.setenv("SPECDRAFT_ROW_OPS", "0")
    assert fast_target._fused_plan(dec) is None
    monkeypatch.setenv("SPECDRAFT_ROW_OPS", "1")
    monkeypatch.setenv(layer_rows.ENV, "0")
    assert fast_target._fused_plan(dec) is None
    h = dec.config.hidden_size
    cache = StaticKVCache(model, 8)
    cache.set_length(3)
    x1, x2 = torch.zeros(1, 1, h), torch.zeros(1, 2, h)
    assert layer_rows.fits(again, x1, None, cache)
    assert not layer_rows.fits(again, torch.zeros(2, 1, h), None, cache)  # two rows
    assert not layer_rows.fits(again, x2, None, cache)  # two new tokens need a mask
    assert layer_rows.fits(again, x2, torch.zeros(1, 1, 2, 5), cache)
    assert not layer_rows.fits(again, x2, torch.zeros(1, 1, 2, 5, dtype=torch.bool), cache)
    assert not layer_rows.fits(again, x2, torch.zeros(1, 1, 2, 6), cache)  # keys the cache does not hold
    assert not layer_rows.fits(again, x1, None, StaticKVCache(model, 8, static=True))
    cache.set_length(8)
    assert not layer_rows.fits(again, x1, None, cache)  # no room


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_prompt_in_causal_chunks_equals_one_token_steps_bit_for_bit(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager decoder's prefill on a panel target runs the prompt as causal chunks through the one call: its
    hidden states, last logits and cache equal feeding the prompt one token at a time, bit for bit, whatever the
    chunk size (4 positions, or all 11 at once); with the loop off it is transformers' causal forward, equal to
    rounding."""
    model = tiny_target(arch, CPU).float()
    _gguf_like(model)
    panel_linears(model)
    ids = torch.tensor([random_prompts([11])[0]])  # (1, 11)
    p = ids.shape[1]
    dec = StaticDecoder(model, 32, static=False)
    assert fast_target.one_call_layers(model)

    def prefill(chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(static_decode, "PREFILL_CHUNK", chunk)
        dec._reserve(p + 1)
        dec.cache.set_length(0)
        logits, hidden = dec._prefill(ids, (), False)  # (1, V), (P, H)
        assert dec.cache.length == p
        return logits, hidden, dec.cache.buffer[..., :p, :].clone()

    chunks, whole = prefill(4), prefill(256)
    dec.cache.set_length(0)
    steps = []
    with torch.inference_mode():
        for t in range(p):  # one-token steps (the AR step's path)
            logits, hidden = target_forward(model, ids[:, t : t + 1], dec.cache, None, None, slice(-1, None))
            dec.cache.advance(1)
            steps.append(hidden)
    stepwise = (logits, torch.cat(steps), dec.cache.buffer[..., :p, :].clone())
    for got in (chunks, whole):
        assert all(torch.equal(a, b) for a, b in zip(got, stepwise, strict=True))
    monkeypatch.setenv(layer_rows.ENV, "0")
    assert not fast_target.one_call_layers(model)
    hf = prefill(4)  # transformers' causal forward, whatever the chunk size
    for a, b in zip(hf, stepwise, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_through_it_stays_lossless(arch: str) -> None:
    """Greedy speculative decoding through the one-call loop (eager path) equals transformers' AR (stop tokens
    included) and the decoder's own AR (random trees, oracle beams); a batch equals batch 1 (both
    through the one-call loop)."""
    model = tiny_target(arch, CPU).float()
    panel_linears(model)
    check_static_equals_ar(StaticDecoder(model, 64, static=False), model, PromptLookupProposer(4))
    check_trees_lossless(
        model
    )  # random trees and oracle beams, eager (one call) and fixed-shape (loop) paths
    prompts = random_prompts([3, 11, 6])
    refs = [
        StaticDecoder(model, 64).ar_generate(None, torch.tensor(p), 12, stop_ids=set())[0] for p in prompts
    ]
    res = BatchDecoder(model, 2).generate(prompts, 12, stop_ids=set())
    assert [out for out, _ in res] == refs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", ["all", "some"])
def test_a_batched_step_equals_the_layer_loop_bit_for_bit(
    arch: str, rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched 4-token chain step over a `BatchKVCache` (rows of other lengths; the padding of a shorter row
    packed out, or rows 2 and 0 of three, not adjacent) through the one-call loop: the per-layer loop's final
    states, kept layer and whole cache bit for bit."""
    from specdraft.eval.batch_kv import BatchKVCache
    from specdraft.models.fast_target import Packing

    model = tiny_target(arch, CPU).float()
    panel_linears(model)
    g = torch.Generator().manual_seed(5)
    base = BatchKVCache(model, 3, 24)
    base.buffer.copy_(
        torch.randn(base.buffer.shape, generator=g)
    )  # committed keys and values (and stale ones)
    lengths = torch.tensor([5, 9, 7])
    n = 4
    pick = torch.tensor([2, 0]) if rows == "some" else None
    lens = lengths[pick] if pick is not None else lengths  # (R,)
    r = lens.shape[0]
    pos = lens[:, None] + torch.arange(n)  # (R, n)
    span = int(lens.max()) + n
    s = torch.arange(span)
    visible = (s[None, None] < lens[:, None, None]) | (
        (s[None, None] >= lens[:, None, None]) & (s[None, None] <= pos[:, :, None])
    )  # (R, n, span): the committed prefix and the chain up to each node
    mask = torch.zeros(r, 1, n, span).masked_fill(~visible[:, None], torch.finfo(torch.float32).min)
    ids = torch.randint(5, 128, (r, n), generator=g)
    valid = torch.ones(r, n, dtype=torch.bool)
    if pick is None:
        valid[0, 2:] = False  # row 0 drafts 1 token: 2 padding positions
    packed = Packing.of(valid)
    assert (packed is None) == (pick is not None)
    results = {}
    with torch.inference_mode():
        for env in ("0", "1"):
            cache = BatchKVCache(model, 3, 24)
            cache.buffer.copy_(base.buffer)
            cache.prepare_write(pick if pick is not None else slice(0, 3), pos, span)
            monkeypatch.setenv(layer_rows.ENV, env)
            if env == "1":
                plan = layer_rows.plan(model.get_decoder(), fast_target._layer_info)
                x = torch.zeros(int(valid.sum()), 32) if packed is not None else torch.zeros(r, n, 32)
                assert plan is not None and layer_rows.fits(plan, x, mask, cache, packed) is not None
            out = fast_target.fast_forward(model, ids, mask, pos, cache, (2,), packed)
            assert out is not None
            results[env] = (out, cache.buffer.clone())
    (a, buf0), (b, buf1) = results["0"], results["1"]
    assert torch.equal(a[0], b[0]) and a[1] is not None and b[1] is not None and torch.equal(a[1], b[1])
    assert torch.equal(buf0, buf1)


def test_a_batch_cache_out_of_bounds_is_refused() -> None:
    """The C loop trusts its write positions and rows: `fits` refuses a `BatchKVCache` step whose write index,
    rows or span fall outside the buffer (the per-layer loop's `index_copy_` then raises, as before)."""
    from specdraft.eval.batch_kv import BatchKVCache

    model = tiny_target("llama", CPU).float()
    panel_linears(model)
    plan = layer_rows.plan(model.get_decoder(), fast_target._layer_info)
    assert plan is not None
    cache = BatchKVCache(model, 2, 8)
    x, mask = torch.zeros(2, 1, 32), torch.zeros(2, 1, 1, 8)
    cache.prepare_write(slice(0, 2), torch.tensor([[3], [5]]), 8)
    assert layer_rows.fits(plan, x, mask, cache) is not None
    cache.prepare_write(slice(0, 2), torch.tensor([[3], [8]]), 8)  # position 8 of 8
    assert layer_rows.fits(plan, x, mask, cache) is None
    cache.prepare_write(torch.tensor([0, 2]), torch.tensor([[3], [5]]), 8)  # row 2 of 2
    assert layer_rows.fits(plan, x, mask, cache) is None
