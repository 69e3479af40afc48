"""Exact block panels (models/exact_panels.py): dequantised GGUF weights stored as their integers, the panel
kernel's outputs bit for bit, lossless decoding."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import exact_panels as ep
from specdraft.models.exact_panels import ExactPanels, exact_panels, unpack
from specdraft.models.linear_layout import layout_label, weight_bytes
from specdraft.models.panel_linear import (
    PanelLinear,
    StackedPanels,
    pack_panels,
    panel_available,
    panel_linears,
    panel_status,
    storage_summary,
)
from specdraft.testing import check_static_equals_ar, check_trees_lossless, tiny_target

CPU = torch.device("cpu")
needs_panel = pytest.mark.skipif(not panel_available(), reason=f"panel kernel: {panel_status()[1]}")


def gguf_like(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` (N, K) quantised and dequantised as ggml does it (blocks of 32 along K; d, m stored as fp16):
    Q4_1 (u in 0..15, w = d u + m), Q4_0 (w = d (u - 8), d = signed extreme / -8) or Q8_0 (w = d q); or
    rounded to "bf16" / "f16" and back."""
    if kind in ("bf16", "f16"):
        return w.to(torch.bfloat16 if kind == "bf16" else torch.float16).float()
    n, k = w.shape
    b = w.double().view(n, k // 32, 32)

    def f16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).double()

    if kind == "q4_1":
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        u = ((b - lo) / torch.where(d == 0, 1.0, d) + 0.5).floor().clamp(0, 15)
        out = u * f16(d) + f16(lo)
    elif kind == "q4_0":
        ext = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude
        d = ext / -8
        u = (b / torch.where(d == 0, 1.0, d) + 8.5).floor().clamp(0, 15)
        out = (u - 8) * f16(d)
    else:
        d = b.abs().amax(-1, keepdim=True) / 127
        out = torch.round(b / torch.where(d == 0, 1.0, d)) * f16(d)
    return out.float().view(n, k)


def gguf_target(arch: str) -> torch.nn.Module:
    """A tiny fp32 target whose Linear weights are Q4_1 and LM head Q8_0, as a dequantised GGUF is."""
    model = tiny_target(arch, CPU).float()
    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0:
                m.weight.copy_(gguf_like(m.weight, "q8_0" if m is head else "q4_1"))
    return model


def linear_of(weight: torch.Tensor, bias: bool = False) -> torch.nn.Linear:
    """An fp32 nn.Linear holding `weight` (out, in)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    lin.weight.data = weight.clone()
    return lin


@needs_panel
@pytest.mark.parametrize(
    ("kind", "stored"), [("q4_1", "q4"), ("q4_0", "q4"), ("q8_0", "q8"), ("bf16", "bf16"), ("f16", "f16")]
)
@pytest.mark.parametrize("out", [16, 40, 200])
def test_exact_weights_are_found_and_give_the_fp32_panels_bits(kind: str, stored: str, out: int) -> None:
    """Q4_1 / Q4_0 / Q8_0 weights and bf16 / fp16 values (a partial last panel at 40 and 200 outputs, an all-zero
    block) become exact panels of their kind; rebuilt they are the fp32 panels, and every row count (the register
    path up to 6 rows, two register chunks at 7-8, the per-thread rebuilt panel past it) gives the fp32 panel
    kernel's bits."""
    g = torch.Generator().manual_seed(0)
    w = gguf_like(torch.randn(out, 96, generator=g), kind)
    w[3, 32:64] = 0.0  # a block of zeros: d = m = 0
    store = exact_panels(w, pack_panels(w))
    assert isinstance(store, ExactPanels) and store.kind == stored
    assert store.shape == (-(-out // 16), 96)
    assert torch.equal(unpack(store), pack_panels(w))
    for bias in (False, True):
        lin = linear_of(w, bias)
        exact, plain = PanelLinear(lin, exact=True), PanelLinear(lin, exact=False)
        assert isinstance(exact.panels, ExactPanels) and isinstance(plain.panels, torch.Tensor)
        for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 20):
            x = torch.randn(rows, 96, generator=g)
            assert torch.equal(exact(x).view(torch.int32), plain(x).view(torch.int32)), rows
            torch.testing.assert_close(exact(x), lin(x), rtol=1e-5, atol=1e-5)
    assert f"exact {stored}" in repr(exact)


@needs_panel
def test_other_weights_keep_fp32_panels() -> None:
    """A trained (random) fp32 weight, an input width that is not a multiple of 32, a Q4_1 weight with one
    weight nudged by an ulp (no exact panels, or none that would change a bit) and one with a NaN; an input
    width that is not a multiple of 32 still takes bf16 panels."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    assert exact_panels(w, pack_panels(w)) is None
    odd = gguf_like(torch.randn(32, 64, generator=g), "q4_1")[:, :48].contiguous()
    assert exact_panels(odd, pack_panels(odd)) is None
    odd16 = gguf_like(torch.randn(20, 40, generator=g), "bf16")  # 16-bit kinds take any input width
    store = exact_panels(odd16, pack_panels(odd16))
    assert store is not None and store.kind == "bf16" and torch.equal(unpack(store), pack_panels(odd16))
    nudged = gguf_like(torch.randn(32, 64, generator=g), "q4_1")
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(10.0))
    found = exact_panels(nudged, pack_panels(nudged))
    assert found is None or torch.equal(unpack(found), pack_panels(nudged))
    nan = gguf_like(torch.randn(16, 32, generator=g), "q4_1")
    nan[2, 3] = float("nan")
    assert exact_panels(nan, pack_panels(nan)) is None


@needs_panel
def test_a_negative_zero_weight_changes_no_output_bit() -> None:
    """Q4_0 dequantises u = 8 with d < 0 to -0.0, which the exact panels rebuild as +0.0: every output has the
    fp32 panels' bits all the same (each sum starts at +0.0), also for inputs of +-0 and rows of zeros."""
    g = torch.Generator().manual_seed(5)
    w = gguf_like(torch.randn(32, 64, generator=g), "q4_0")
    assert bool((w.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any())  # -0.0 weights present
    lin = linear_of(w)
    exact, plain = PanelLinear(lin, exact=True), PanelLinear(lin, exact=False)
    assert isinstance(exact.panels, ExactPanels)
    x = torch.randn(9, 64, generator=g)
    x[0] = 0.0
    x[1] = -0.0
    x[2, ::2] = -0.0
    assert torch.equal(exact(x).view(torch.int32), plain(x).view(torch.int32))


@needs_panel
def test_switch_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SPECDRAFT_EXACT_PANELS=0` keeps fp32 panels; exact ones hold 0.625 bytes a weight (4 bits and a GGUF's
    fp16 d and m per 32) and `weight_bytes` counts what they hold."""
    w = gguf_like(torch.randn(64, 128, generator=torch.Generator().manual_seed(2)), "q4_1")
    model = torch.nn.Sequential(linear_of(w))
    monkeypatch.setenv("SPECDRAFT_EXACT_PANELS", "0")
    assert not ep.enabled()
    off = copy.deepcopy(model)
    panel_linears(off)
    assert isinstance(off[0].panels, torch.Tensor)
    monkeypatch.delenv("SPECDRAFT_EXACT_PANELS")
    panel_linears(model)
    store = model[0].panels
    assert isinstance(store, ExactPanels) and store.nbytes() == 64 * 128 * 5 // 8
    assert weight_bytes(off) - weight_bytes(model) == 64 * 128 * 4 - store.nbytes()
    assert storage_summary(model) == "q4:1" and storage_summary(off) == "fp32:1"
    assert layout_label(model, "panel") == "panel (stored q4:1)" and layout_label(model, "native") == "native"


@needs_panel
def test_stacked_exact_panels_equal_the_separate_products() -> None:
    """q/k/v as exact panels stack into one call with each product's bits (one store, views of it); exact and
    fp32 members do not stack."""
    g = torch.Generator().manual_seed(3)
    lins = [
        linear_of(gguf_like(torch.randn(n, 64, generator=g), "q4_1"), bias)
        for n, bias in ((32, True), (16, False))
    ]
    members = [PanelLinear(lin) for lin in lins]
    assert all(isinstance(m.panels, ExactPanels) for m in members)
    x = torch.randn(3, 64, generator=g)
    alone = [m(x) for m in members]
    stacked = StackedPanels(members)
    assert isinstance(stacked.panels, ExactPanels)
    for got, want, m in zip(stacked(x), alone, members, strict=True):
        assert torch.equal(got, want) and torch.equal(m(x), want)
        assert m.panels.q.untyped_storage().data_ptr() == stacked.panels.q.untyped_storage().data_ptr()
    plain = PanelLinear(linear_of(torch.randn(16, 64, generator=g)))
    assert not StackedPanels.stackable([members[0], plain])


@needs_panel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_target_in_exact_panels_decodes_losslessly(arch: str) -> None:
    """A tiny target whose Linear weights are Q4_1 (its LM head Q8_0), as a dequantised GGUF is: every Linear
    becomes exact panels, logits equal the fp32 panels' bit for bit, and greedy speculative decoding equals AR
    on the eager and fixed-shape paths."""
    model = gguf_target(arch)
    plain = copy.deepcopy(model)
    panel_linears(plain, exact=False)
    panel_linears(model, exact=True)
    stores = [m.panels for m in model.modules() if isinstance(m, PanelLinear)]
    assert stores and all(isinstance(s, ExactPanels) for s in stores)
    ids = torch.randint(5, 128, (1, 19), generator=torch.Generator().manual_seed(4))
    assert torch.equal(model(ids).logits, plain(ids).logits)
    check_trees_lossless(model)
    from specdraft.eval.proposers import PromptLookupProposer

    for static in (False, True):
        check_static_equals_ar(StaticDecoder(model, 64, static=static), model, PromptLookupProposer(4))


@needs_panel
@pytest.mark.parametrize("form", ["q4_1", "q4_0", "q8_0"])
def test_fp16_tables_give_the_fp32_tables_bits(form: str) -> None:
    """A GGUF's d and m are fp16: exact panels hold them in 2 bytes (kernel kinds 5 / 9), and the products and
    the rebuilt panels equal those of the same store with fp32 tables bit for bit, at 1-20 rows, with a bias;
    tables that are not fp16 values stay fp32 (kinds 4 / 8)."""
    g = torch.Generator().manual_seed(5)
    w = gguf_like(torch.randn(40, 96, generator=g), form)
    found = exact_panels(w, pack_panels(w))
    assert found is not None
    if form == "q4_0":  # found as u d + m with m = -8 d, which need not be an fp16: fp32 tables
        assert found.d.dtype == torch.float32 and found.code == ep.KINDS["q4"]
    store = ExactPanels(found.q, found.d.half(), found.m.half(), found.kind)
    if form != "q4_0":
        assert found.d.dtype == found.m.dtype == torch.float16 and torch.equal(found.m, store.m)
    else:  # fp16 tables made by hand: the kernel rebuilds from what they hold, which the check compares
        w = unpack(store).transpose(1, 2).reshape(-1, 96)[:40]
    assert store.code == ep.KINDS[store.kind] + ep.HALF_TABLES
    wide = ExactPanels(store.q, store.d.float(), store.m.float(), store.kind)
    assert wide.code == ep.KINDS[store.kind] and wide.nbytes() - store.nbytes() == 2 * 2 * 3 * 3 * 16
    assert torch.equal(unpack(store), unpack(wide)) and torch.equal(unpack(store), pack_panels(w))
    bias = torch.randn(40, generator=g)
    for rows in (1, 2, 3, 5, 7, 8, 13, 20):
        x = torch.randn(rows, 96, generator=g)
        y = ep.exact_product(x, store, 40, bias)
        assert torch.equal(y.view(torch.int32), ep.exact_product(x, wide, 40, bias).view(torch.int32))
    u = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    d = torch.full((16, 2), 0.1)  # 0.1 is no fp16 value: the tables stay fp32
    assert ep._to_panels(u, d, torch.zeros(16, 2), 4).d.dtype == torch.float32


@pytest.fixture(params=["vbmi", "avx512", "avx2"])
def avx512(request: pytest.FixtureRequest):
    """The kernel's AVX-512 paths on (where the CPU has them) with the 4-bit VBMI rebuild (where the CPU has
    it) or without, or off; restored after the test."""
    on = ep.set_avx512(request.param != "avx2")
    ep.set_vbmi(request.param == "vbmi")
    yield on
    ep.set_avx512(os.environ.get("SPECDRAFT_AVX512", "1") != "0")
    ep.set_vbmi(os.environ.get("SPECDRAFT_VBMI", "1") != "0")


@needs_panel
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
@pytest.mark.parametrize("half", [True, False])
def test_paired_panels_give_the_unpaired_bits(
    form: str, half: bool, avx512: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4- or 8-bit store of an even panel count is paired (`SPECDRAFT_PAIRED_PANELS`, on by default): panels 2g
    and 2g + 1 side by side. Its rebuilt panels and its products at 0-20 rows (with a bias, a partial last panel)
    equal the unpaired store's bit for bit, with fp16 or fp32 block tables, through the AVX-512 paths (where the
    CPU has them; 4-bit pairs rebuilt with and without VBMI) and the AVX2 ones; `unpair` inverts `pair`; an odd
    panel count stays unpaired; slices take whole pairs; mixed stores stack unpaired."""
    monkeypatch.setenv("SPECDRAFT_PAIRED_PANELS", "1")  # on any CPU (`auto`: where the AVX-512 paths run)
    g = torch.Generator().manual_seed(11)
    w = gguf_like(torch.randn(60, 96, generator=g), form)  # 4 panels, the last holding 12 columns
    store = exact_panels(w, pack_panels(w))
    assert store is not None and store.paired and store.shape == (4, 96) and store.code & ep.PAIRED
    flat = ep.unpair(store)
    assert not flat.paired and torch.equal(ep.pair(flat).q, store.q) and torch.equal(ep.pair(flat).d, store.d)
    if not half:
        store, flat = (ExactPanels(s.q, s.d.float(), s.m.float(), s.kind, s.paired) for s in (store, flat))
    assert torch.equal(unpack(store), unpack(flat)) and torch.equal(unpack(store), pack_panels(w))
    bias = torch.randn(60, generator=g)
    for rows in range(21):
        x = torch.randn(rows, 96, generator=g)
        for b in (None, bias):
            y = ep.exact_product(x, store, 60, b)
            assert torch.equal(y.view(torch.int32), ep.exact_product(x, flat, 60, b).view(torch.int32))
    odd = gguf_like(torch.randn(48, 96, generator=g), form)  # 3 panels
    assert not exact_panels(odd, pack_panels(odd)).paired
    assert store[2:4].shape == (2, 96) and torch.equal(unpack(store[2:4]), unpack(flat)[2:4])
    with pytest.raises(ValueError, match="whole pairs"):
        store[1:3]
    mixed = ExactPanels.cat([store, flat])
    assert not mixed.paired and torch.equal(unpack(mixed), torch.cat([unpack(flat), unpack(flat)]))


@needs_panel
def test_pairing_follows_the_switch_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SPECDRAFT_PAIRED_PANELS`: 0 stores panels one after the other, 1 pairs them, auto (the default) pairs
    where the CPU has AVX-512 F, BW and VL and `SPECDRAFT_AVX512` is not 0 (the kernel's AVX-512 paths)."""
    from specdraft import hardware

    w = gguf_like(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), "q4_1")
    monkeypatch.setenv("SPECDRAFT_PAIRED_PANELS", "0")
    assert not ep.pairing() and not exact_panels(w, pack_panels(w)).paired
    monkeypatch.setenv("SPECDRAFT_PAIRED_PANELS", "1")
    assert ep.pairing() and exact_panels(w, pack_panels(w)).paired
    monkeypatch.delenv("SPECDRAFT_PAIRED_PANELS")
    monkeypatch.delenv("SPECDRAFT_AVX512", raising=False)
    for flags, paired in ((("avx2", "avx512f", "avx512bw", "avx512vl"), True), (("avx2", "avx512f"), False)):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert ep.pairing() is paired
    monkeypatch.setenv("SPECDRAFT_AVX512", "0")  # the kernel keeps its AVX2 code: no pairing under auto
    assert not ep.pairing()
