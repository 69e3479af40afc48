"""The panel kernel (models/panel_linear.py): same product as nn.Linear, row-invariant, lossless decoding."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdraft import hardware
from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import linear_layout, panel_linear
from specdraft.models.exact_panels import ExactPanels
from specdraft.models.linear_layout import resolve_layout, weight_bytes
from specdraft.models.panel_linear import (
    PANEL,
    PanelLinear,
    StackedPanels,
    pack_panels,
    panel_available,
    panel_bytes,
    panel_linears,
    panel_product,
    panel_status,
)
from specdraft.testing import (
    RandomTreeProposer,
    check_static_equals_ar,
    check_trees_lossless,
    random_prompts,
    tiny_target,
)

CPU = torch.device("cpu")
needs_panel = pytest.mark.skipif(not panel_available(), reason=f"panel kernel: {panel_status()[1]}")


@pytest.fixture
def fresh_status() -> Iterator[None]:
    """Forget the cached build result before and after a test that changes how the kernel is built."""
    panel_status.cache_clear()
    yield
    panel_status.cache_clear()


def test_pack_panels_layout() -> None:
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # (out 40, in 3): 3 panels, the last one padded
    p = pack_panels(w)
    assert p.shape == (3, 3, PANEL) and p.is_contiguous()
    for b in range(3):
        for c in range(PANEL):
            n = PANEL * b + c
            expect = w[n] if n < 40 else torch.zeros(3)
            assert torch.equal(p[b, :, c], expect)


@needs_panel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [16, 40, 7])
def test_panel_linear_equals_linear_for_every_row_count(bias: bool, out: int) -> None:
    """Rows 0..20 (partial and whole register chunks of 6), output widths under, at and past one panel."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, out, bias=bias)
    p = PanelLinear(lin)
    assert p.native.data_ptr() == lin.weight.data_ptr()  # shared, not copied
    assert torch.equal(p.weight, lin.weight) and "panels" not in dict(p.state_dict())
    for rows in range(21):
        x = torch.randn(2, rows, 24)  # (B, L, in)
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="fp32"):
        p(torch.randn(3, 24, dtype=torch.float64))


@needs_panel
def test_panel_linear_is_row_invariant() -> None:
    """A row's output has the same bits alone, in any batch and beside any other rows."""
    torch.manual_seed(0)
    p = PanelLinear(torch.nn.Linear(200, 70))
    x = torch.randn(17, 200)
    full = p(x)
    for i in range(17):
        assert torch.equal(p(x[i : i + 1]), full[i : i + 1])
        assert torch.equal(p(torch.cat([torch.randn(i % 7, 200), x[i : i + 1]]))[-1], full[i])


@needs_panel
def test_fp32_panels_give_the_same_bits_on_the_avx512_and_avx2_paths() -> None:
    """fp32 panels (a drafter's weights) at 2+ rows take the AVX-512 two-panel loop where the CPU has it (12 rows
    a pass): every row count 0-30, an odd panel count (a lone last panel) and a partial last panel, with and
    without a bias, give the AVX2 loop's bits; a no-op check on a CPU without AVX-512."""
    from specdraft.models.exact_panels import set_avx512

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 70)  # 5 panels, the last holding 6 columns
    p, panels = PanelLinear(lin), pack_panels(lin.weight.detach())
    assert not isinstance(p.panels, ExactPanels)  # random weights: fp32 panels
    x = torch.randn(30, 96)
    try:
        for rows in range(31):
            for bias in (None, lin.bias):
                got = {}
                for on in (True, False):
                    set_avx512(on)
                    got[on] = panel_product(x[:rows], panels, 70, bias)
                assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))
                if rows:
                    torch.testing.assert_close(
                        got[True], torch.nn.functional.linear(x[:rows], lin.weight, bias)
                    )
    finally:
        set_avx512(os.environ.get("SPECDRAFT_AVX512", "1") != "0")


def test_panel_linear_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="needs an fp32 CPU weight"):
        PanelLinear(torch.nn.Linear(4, 4).double())


@needs_panel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_panel_target_decodes_losslessly_on_both_paths(arch: str) -> None:
    """fp32 tiny targets (Qwen2: biased q/k/v) in panels: logits as native to float rounding; greedy speculative
    decoding equal to AR on the eager and fixed-shape paths (random trees, oracle beams, prompt lookup)."""
    model = tiny_target(arch, CPU).float()
    native = copy.deepcopy(model)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert panel_linears(model) == linears > 0 and panel_linears(model) == 0
    assert weight_bytes(model) - weight_bytes(native) >= panel_bytes(native)  # padded to whole panels
    ids = torch.randint(5, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, native(ids).logits, rtol=1e-4, atol=1e-4)
    check_trees_lossless(model)
    for static in (False, True):
        check_static_equals_ar(StaticDecoder(model, 64, static=static), model, PromptLookupProposer(4))


@needs_panel
def test_stacked_panels_equal_the_separate_products() -> None:
    """q/k/v (Qwen2-style: biased, one without a bias) as one kernel call give each product's bits; each member
    still runs alone from its view of the one buffer (no extra memory); widths not a multiple of PANEL, another
    input width or another layout do not stack."""
    g = torch.Generator().manual_seed(0)
    lins = [torch.nn.Linear(24, out, bias=bias) for out, bias in ((32, True), (16, False), (48, True))]
    for lin in lins:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g)
    panels = [PanelLinear(lin) for lin in lins]
    x = torch.randn(2, 3, 24, generator=g)
    alone = [m(x) for m in panels]
    before = sum(m.panels.numel() for m in panels)
    stacked = StackedPanels(panels)
    for got, want, m in zip(stacked(x), alone, panels, strict=True):
        assert torch.equal(got, want) and torch.equal(m(x), want)
        assert m.panels.untyped_storage().data_ptr() == stacked.panels.untyped_storage().data_ptr()
    assert stacked.panels.numel() == before
    assert StackedPanels.stackable(panels)
    assert not StackedPanels.stackable([PanelLinear(torch.nn.Linear(24, 20)), panels[0]])  # 20 % PANEL
    assert not StackedPanels.stackable([PanelLinear(torch.nn.Linear(16, 32)), panels[0]])  # input widths
    assert not StackedPanels.stackable([lins[0], panels[1]])  # a plain Linear


@needs_panel
def test_panel_target_batched_equals_batch1() -> None:
    """Continuous batching over a panel target: each request's output equals its own batch-1 AR output."""
    model = tiny_target("llama", CPU).float()
    panel_linears(model)
    prompts = random_prompts([3, 11, 6, 17, 2])
    single = StaticDecoder(model, 64)
    refs = [single.ar_generate(None, torch.tensor(p), 20, stop_ids=set())[0] for p in prompts]
    seeds = iter(range(100))
    for factory in (None, lambda: RandomTreeProposer(vocab=128, seed=next(seeds))):
        res = BatchDecoder(model, 3).generate(prompts, 20, stop_ids=set(), proposer_factory=factory)
        assert [out for out, _ in res] == refs


@needs_panel
def test_kernel_is_built_into_the_cache(
    fresh_status: None, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold cache compiles the kernel once, atomically (no temp file left), and a second process-level
    lookup reuses the build."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    assert panel_status()[1] == "ok"
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("panel_linear-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    panel_status.cache_clear()
    assert panel_status()[1] == "ok" and built[0].stat().st_mtime_ns == stamp


@needs_panel
def test_a_baseline_source_replaces_the_source_it_is_named_after(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`baseline_library` (a kernel A/B): a file named row_ops.c or layer_rows.c stands for that source, any
    other name for panel_linear.c; `replaces` names it outright and must be one of them."""
    assert panel_linear.panel_lib() is not None  # the real library first (panel_status builds it once)
    built: list[tuple[str, ...]] = []

    def library(srcs: tuple[Path, ...]) -> tuple[None, str]:  # records what would be built, builds nothing
        built.append(tuple(map(str, srcs)))
        return None, "x"

    monkeypatch.setattr(panel_linear, "_library", library)
    rows = tmp_path / "row_ops.c"
    other = tmp_path / "base.c"
    for src, replaces, slot in ((rows, None, 1), (other, None, 0), (other, "layer_rows.c", 2)):
        with pytest.raises(RuntimeError, match="x"):
            panel_linear.baseline_library(src, replaces)
        assert built[-1][slot] == str(src)
        assert [p for i, p in enumerate(built[-1]) if i != slot] == [
            str(p) for i, p in enumerate(panel_linear.SOURCES) if i != slot
        ]
    with pytest.raises(RuntimeError, match="'kernel.c' is not a kernel source"):
        panel_linear.baseline_library(other, "kernel.c")


def test_no_compiler_falls_back_and_forcing_says_why(
    fresh_status: None, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc-specdraft")
    fn, why = panel_status()
    assert fn is None and ("no-such-cc-specdraft" in why or "x86-64" in why or "AVX2" in why)
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "AMD EPYC 7B13")
    monkeypatch.setattr(linear_layout, "free_memory_bytes", lambda: 8 << 30)
    assert resolve_layout("auto", CPU, torch.float32) == "transposed"
    with pytest.raises(ValueError, match="linear layout 'panel': .*use linear_layout=transposed or auto"):
        resolve_layout("panel", CPU, torch.float32)


def test_a_failing_compiler_is_named(fresh_status: None, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that exits non-zero: the reason names it, and nothing is left in the cache."""
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'badcc: error: no such thing' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    fn, why = panel_status()
    assert fn is None and "failed to build panel_linear.c" in why and "badcc: error" in why
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def test_resolve_layout_picks_panel_on_amd_and_intel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_layout, "free_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(linear_layout, "panel_available", lambda: True)
    monkeypatch.setattr(linear_layout, "mkl_packing_available", lambda: True)
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "AMD EPYC 7B13")
    assert resolve_layout("auto", CPU, torch.float32, packs=1 << 30, panels=1 << 28) == "panel"
    assert resolve_layout("auto", CPU, torch.float32, panels=3 << 30) == "transposed"  # > 1/4 of free memory
    assert resolve_layout("auto", CPU, torch.bfloat16) == "native"
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    # an AMX Xeon: one panel forward 10.7 ms against 51.5 packed (session 60)
    assert resolve_layout("auto", CPU, torch.float32, packs=1 << 30, panels=1 << 28) == "panel"
    # panels too large for memory: MKL's packs where they fit (measured on a Xeon against transposed)
    assert resolve_layout("auto", CPU, torch.float32, packs=1 << 30, panels=3 << 30) == "packed"
    assert resolve_layout("panel", CPU, torch.float32) == "panel"  # forced
    monkeypatch.setattr(linear_layout, "panel_available", lambda: False)  # e.g. no C compiler
    assert resolve_layout("auto", CPU, torch.float32, packs=1 << 30) == "packed"
    with pytest.raises(ValueError, match="linear layout 'panel': it computes fp32 on a CPU"):
        resolve_layout("panel", CPU, torch.float64)
