"""Int8 activations for 4- and 8-bit exact panels (models/qdot.py, models/qdot.c): the kernel's bits equal the
torch reference on both code paths, a row's result does not depend on the other rows, the option is wired
through the layout and the config, and decoding a q8 target stays lossless (eager, fixed-shape, batched)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import qdot
from specdraft.models.exact_panels import ExactPanels, _to_panels, exact_product, pair, unpack
from specdraft.models.linear_layout import apply_layout, layout_label
from specdraft.models.panel_linear import (
    PanelLinear,
    StackedPanels,
    panel_available,
    panel_linears,
    panel_status,
)
from specdraft.testing import check_static_equals_ar, check_trees_lossless, random_prompts
from tests.unit.test_exact_panels import gguf_like, gguf_target, linear_of

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not panel_available(), reason=f"panel kernel: {panel_status()[1]}")


def random_store(bits: int, n: int, k: int, seed: int) -> ExactPanels:
    """A "q4" / "q8" store of random integers with random fp32 tables (d > 0, m < 0 as a GGUF's Q4_1)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.1
    m = -torch.rand(n, k // 32, generator=g) * 0.5
    return _to_panels(u, d, m, bits)


def weight_of(store: ExactPanels, n: int) -> torch.Tensor:
    """The (N, K) fp32 weight a store holds, u d + m."""
    p, k = store.shape
    u = qdot.integers(store).float().permute(0, 2, 1).reshape(p * 16, k)[:n]
    d, m = (
        t.float().permute(0, 2, 1).reshape(p * 16, -1)[:n].repeat_interleave(32, 1)
        for t in (store.d, store.m)
    )
    return u * d + m


@pytest.fixture(params=[True, False], ids=["vnni", "avx2"])
def vnni(request: pytest.FixtureRequest):
    """qdot.c's AVX-512 VNNI path on (where the CPU has it) or off, restored after the test."""
    yield qdot.set_vnni(request.param)
    qdot.set_vnni(os.environ.get("SPECDRAFT_AVX512", "1") != "0")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (200, 64), (16, 32)])
def test_products_equal_the_reference_bit_for_bit(vnni: bool, bits: int, n: int, k: int) -> None:
    """At 1-20 rows, with and without a bias, paired or not before the conversion: the kernel's outputs equal
    `reference_product` bit for bit, each row equals that row alone, and all stay near the fp32 product."""
    store = random_store(bits, n, k, seed=bits + n)
    w = weight_of(store, n)
    for source in (store, pair(store)):
        dot = qdot.to_dot(source)
        assert dot.dot and dot.code == qdot.QDOT | bits and dot.shape == store.shape
        assert torch.equal(qdot.integers(dot), qdot.integers(store))
        g = torch.Generator().manual_seed(k)
        for rows in (1, 2, 3, 4, 5, 8, 9, 13, 20):
            x = torch.randn(rows, k, generator=g)
            x[0, :32] = 0.0  # a block of zeros: scale 0, q 0
            for bias in (None, torch.randn(n, generator=g)):
                y = exact_product(x, dot, n, bias)
                assert torch.equal(
                    y.view(torch.int32), qdot.reference_product(x, dot, n, bias).view(torch.int32)
                )
                alone = torch.cat([exact_product(x[i : i + 1], dot, n, bias) for i in range(rows)])
                assert torch.equal(y.view(torch.int32), alone.view(torch.int32))
                want = x @ w.T + (bias if bias is not None else 0)
                assert float((y - want).norm()) <= 0.03 * float(want.norm()) + 1e-6


@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_tables_give_the_fp32_tables_bits(vnni: bool, bits: int) -> None:
    """A GGUF's d and m are fp16 values: a dot store keeps them in 2 bytes (kind + 1) and its products equal
    those of the same store with fp32 tables bit for bit."""
    g = torch.Generator().manual_seed(bits)
    u = torch.randint(0, 2**bits, (40, 96), generator=g, dtype=torch.uint8)
    d, m = ((torch.rand(40, 3, generator=g) * s).half().float() for s in (0.1, -0.5))
    half = qdot.to_dot(_to_panels(u, d, m, bits))
    assert half.d.dtype == torch.float16 and half.code == qdot.QDOT | bits | 1
    wide = ExactPanels(half.q, half.d.float(), half.m.float(), half.kind, dot=True)
    assert wide.code == qdot.QDOT | bits
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, 96, generator=g)
        y = exact_product(x, half, 40, None)
        assert torch.equal(y.view(torch.int32), exact_product(x, wide, 40, None).view(torch.int32))
        assert torch.equal(y.view(torch.int32), qdot.reference_product(x, half, 40, None).view(torch.int32))


def test_quantise_follows_the_rule() -> None:
    """Per block of 32: dx = amax / 127, q = round-half-even(x / dx) within +-127, sx = sum(q) dx, zeros stay 0."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([1.0, -0.5, 0.25, 1.0 / 254])  # 1/254 * 127 = 0.5: rounds to even (0)
    q, dx, sx = qdot.quantise(x)
    assert dx[0, 0] == torch.tensor(1.0) / 127 and dx[0, 1] == 0 and sx[0, 1] == 0
    assert q[0, 0, :4].tolist() == [127, -64, 32, 0] and not q[0, 1].any()  # -63.5 -> -64, 31.75 -> 32
    assert sx[0, 0] == torch.tensor(127 - 64 + 32, dtype=torch.float32) * dx[0, 0]


def test_stacked_and_sliced_dot_stores_give_the_separate_bits() -> None:
    """q/k/v with int8 activations stack into one call (one layout per stack) with each product's bits; a dot
    store has no fp32 panels to unpack."""
    g = torch.Generator().manual_seed(3)
    members = [
        PanelLinear(linear_of(gguf_like(torch.randn(n, 64, generator=g), "q4_1"), bias), q8=True)
        for n, bias in ((32, True), (16, False))
    ]
    assert all(isinstance(m.panels, ExactPanels) and m.panels.dot for m in members)
    x = torch.randn(3, 64, generator=g)
    alone = [m(x) for m in members]
    stacked = StackedPanels(members)
    assert isinstance(stacked.panels, ExactPanels) and stacked.panels.dot
    for got, want in zip(stacked(x), alone, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no fp32 panels"):
        unpack(stacked.panels)
    with pytest.raises(ValueError, match="one layout"):
        ExactPanels.cat([members[0].panels, random_store(4, 16, 64, seed=1)])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_q8_target_decodes_losslessly(arch: str) -> None:
    """With `base_model.q8_activations` every 4/8-bit Linear takes int8 activations (logits near the fp32
    ones, not equal); greedy speculative decoding equals this target's own AR on the eager and fixed-shape
    paths (prompt lookup, random trees, oracle beams, stop tokens), and a batch equals batch 1."""
    model = gguf_target(arch)
    fp32 = copy.deepcopy(model)
    panel_linears(fp32)
    assert apply_layout(model, "panel", q8=True) == "panel"
    assert "q4xq8" in layout_label(model, "panel") and "q8xq8" in layout_label(model, "panel")
    ids = torch.randint(5, 128, (1, 19), generator=torch.Generator().manual_seed(4))
    got, want = model(ids).logits, fp32(ids).logits
    assert not torch.equal(got, want) and float((got - want).norm() / want.norm()) < 0.05
    check_trees_lossless(model)
    for static in (False, True):
        check_static_equals_ar(StaticDecoder(model, 64, static=static), model, PromptLookupProposer(4))
    prompts = random_prompts([3, 11, 6])
    refs = [
        StaticDecoder(model, 64).ar_generate(None, torch.tensor(p), 12, stop_ids=set())[0] for p in prompts
    ]
    assert [out for out, _ in BatchDecoder(model, 2).generate(prompts, 12, stop_ids=set())] == refs


def test_q8_needs_the_panel_layout_and_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless asked (config or `SPECDRAFT_Q8_ACTIVATIONS`); asked for with another layout: one clear error
    naming the setting."""
    monkeypatch.delenv("SPECDRAFT_Q8_ACTIVATIONS", raising=False)
    assert not qdot.enabled()
    model = gguf_target("llama")
    with pytest.raises(ValueError, match="base_model.q8_activations=true needs the CPU panel layout"):
        apply_layout(copy.deepcopy(model), "transposed", q8=True)
    plain = copy.deepcopy(model)
    apply_layout(plain, "panel")
    assert "xq8" not in layout_label(plain, "panel")
    monkeypatch.setenv("SPECDRAFT_Q8_ACTIVATIONS", "1")
    assert qdot.enabled()
    apply_layout(model, "panel")
    assert "q4xq8" in layout_label(model, "panel")
