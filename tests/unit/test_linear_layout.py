"""Transposed Linear weights (models/linear_layout.py): same function, same greedy decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from specdraft.eval.decode import ar_generate
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import linear_layout
from specdraft.models.linear_layout import (
    PackedLinear,
    TransposedLinear,
    apply_layout,
    match_target_layout,
    mkl_packing_available,
    pack_bytes,
    pack_linears,
    resolve_layout,
    transpose_linears,
    weight_bytes,
)
from specdraft.models.panel_linear import panel_available
from specdraft.testing import (
    OracleBeamProposer,
    RandomTreeProposer,
    check_static_equals_ar,
    check_trees_lossless,
    tiny_target,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_linear_equals_linear(bias: bool) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 10, bias=bias).double()
    t = TransposedLinear(lin)
    x = torch.randn(2, 3, 6, dtype=torch.float64)  # (B, L, in)
    torch.testing.assert_close(t(x), lin(x), rtol=0, atol=1e-12)
    assert t.wt.shape == (6, 10) and t.wt.is_contiguous()
    assert torch.equal(t.weight, lin.weight)  # (out, in) view, as borrowers of an LM head read it
    assert not t.wt.requires_grad


def test_lm_head_keeps_native_weight_for_two_or_three_rows() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 40, bias=False).double()
    t = TransposedLinear(lin, keep_native=True)
    assert t.native is lin.weight  # shared, not copied
    for rows in range(1, 6):
        x = torch.randn(1, rows, 6, dtype=torch.float64)
        torch.testing.assert_close(t(x), lin(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_transposed_target_same_logits_and_greedy(arch: str) -> None:
    model = tiny_target(arch, CPU)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    emb = model.get_input_embeddings().weight.clone()
    moved = copy.deepcopy(model)
    assert transpose_linears(moved) == linears > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in moved.modules())
    assert transpose_linears(moved) == 0  # idempotent
    assert torch.equal(moved.get_input_embeddings().weight, emb)  # a tied head keeps the embedding as it was
    head = moved.get_output_embeddings()
    assert head.native is not None and not any(
        m.native is not None for m in moved.modules() if isinstance(m, TransposedLinear) and m is not head
    )
    ids = torch.randint(5, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moved(ids).logits, model(ids).logits, rtol=0, atol=1e-9)
    prompt = ids[0, :7]
    assert (
        ar_generate(moved, None, prompt, 24, stop_ids=set())[0]
        == ar_generate(model, None, prompt, 24, stop_ids=set())[0]
    )


@pytest.mark.parametrize("shape", ["eager", "fixed"])
def test_static_decode_lossless_on_transposed_target(shape: str) -> None:
    """Random trees (mostly rejected), oracle beams (long accepted paths) and prompt lookup, both paths."""
    model = tiny_target("llama", CPU)
    transpose_linears(model)
    dec = StaticDecoder(model, 48, static=shape == "fixed")
    for prompt_len in (1, 6, 23):
        prompt = torch.randint(0, 96, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 30, stop_ids=set())
        assert dec.ar_generate(None, prompt, 30, stop_ids=set())[0] == ref
        out, _ = dec.speculative_generate(
            None, prompt, RandomTreeProposer(96, seed=prompt_len), 30, stop_ids=set()
        )
        assert out == ref
        oracle = OracleBeamProposer(ref, prompt_len, vocab=96)
        out, stats = dec.speculative_generate(None, prompt, oracle, 30, stop_ids=set())
        assert out == ref and stats.tokens_per_step > 1.8
    check_static_equals_ar(dec, model, PromptLookupProposer(4))


def test_resolve_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_layout, "panel_available", lambda: False)  # test_panel_linear: with it
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "Intel(R) Xeon(R) CPU @ 2.50GHz")
    monkeypatch.setattr(linear_layout, "mkl_packing_available", lambda: True)
    monkeypatch.setattr(linear_layout, "free_memory_bytes", lambda: 8 << 30)
    assert resolve_layout("auto", CPU, torch.float32, packs=1 << 30) == "packed"
    assert resolve_layout("auto", CPU, torch.float32, packs=3 << 30) == "transposed"  # > 1/4 of free memory
    assert resolve_layout("auto", CPU, torch.bfloat16) == "native"  # not measured to pay
    assert resolve_layout("auto", torch.device("cuda"), torch.float32) == "native"
    assert resolve_layout("transposed", torch.device("cuda"), torch.bfloat16) == "transposed"
    assert resolve_layout("native", CPU, torch.float32) == "native"
    with pytest.raises(ValueError, match="linear layout 'sideways'"):
        resolve_layout("sideways", CPU, torch.float32)
    with pytest.raises(ValueError, match="'packed' needs an fp32 target on a CPU"):
        resolve_layout("packed", CPU, torch.float64)
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "AMD EPYC 7B13")  # packing measured on Intel only
    assert resolve_layout("auto", CPU, torch.float32, packs=1) == "transposed"
    assert resolve_layout("packed", CPU, torch.float32) == "packed"  # forced
    monkeypatch.setattr(linear_layout, "mkl_packing_available", lambda: False)  # e.g. an ARM build
    with pytest.raises(ValueError, match="MKL False"):
        resolve_layout("packed", CPU, torch.float32)


def test_apply_layout_follows_the_model_dtype_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_target("llama", CPU)  # fp64: auto keeps the native layout
    assert apply_layout(model, "auto") == "native"
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)
    monkeypatch.setattr(linear_layout, "free_memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(linear_layout, "cpu_model", lambda: "AMD EPYC 7B13")
    monkeypatch.setattr(linear_layout, "panel_available", lambda: False)  # no kernel here: transposed
    amd = copy.deepcopy(model).float()
    assert apply_layout(amd, "auto") == "transposed"
    assert isinstance(amd.get_output_embeddings(), TransposedLinear)
    if mkl_packing_available():
        monkeypatch.setattr(linear_layout, "cpu_model", lambda: "Intel(R) Xeon(R) CPU @ 2.50GHz")
        intel = copy.deepcopy(model).float()
        assert apply_layout(intel, "auto") == "packed"
        assert isinstance(intel.get_output_embeddings(), PackedLinear)
        assert not any(isinstance(m, torch.nn.Linear) for m in intel.modules())


needs_mkl = pytest.mark.skipif(not mkl_packing_available(), reason="torch without MKL's packed GEMM")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_for_every_row_count(bias: bool) -> None:
    """Rows 0..20 cover one row (transposed copy), 2-3 rows (native weight), exact packs, padded packs and more
    rows than any pack."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    p = PackedLinear(lin, rows=(4, 8))
    assert sorted(p.packs) == [4, 8] and "packs" not in dict(p.state_dict())
    assert p.native is lin.weight or p.native.data_ptr() == lin.weight.data_ptr()  # shared, not copied
    assert torch.equal(p.weight, lin.weight)  # (out, in) view, as borrowers of an LM head read it
    for rows in range(21):
        x = torch.randn(2, rows, 24)  # (B, L, in): 2 * rows rows in all
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p(x[0]), lin(x[0]), rtol=1e-5, atol=1e-5)


def test_packed_linear_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="needs an fp32 CPU weight"):
        PackedLinear(torch.nn.Linear(4, 4).double())


@needs_mkl
def test_packed_target_decodes_losslessly_on_both_paths() -> None:
    """fp32 tiny target with packed weights: same logits as native to float rounding, and greedy speculative
    decoding equal to its own AR on the eager and the fixed-shape paths (trees of 1..32 nodes: packs, padding and
    the fallback)."""
    model = tiny_target("llama", CPU).float()
    native = copy.deepcopy(model)
    assert pack_bytes(model) == 4 * sum(  # 3 packs + the transposed copy
        m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    assert pack_linears(model) > 0 and pack_linears(model) == 0
    assert weight_bytes(model) - weight_bytes(native) == pack_bytes(native)  # what `auto` budgets for
    twin = copy.deepcopy(model)  # the opaque packs are shared, everything else copied
    assert (
        twin.lm_head.packs is model.lm_head.packs
        and twin.lm_head.wt.data_ptr() != model.lm_head.wt.data_ptr()
    )
    ids = torch.randint(5, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, native(ids).logits, rtol=1e-4, atol=1e-4)
    check_trees_lossless(model)


needs_panel = pytest.mark.skipif(not panel_available(), reason="no panel kernel here")


@pytest.mark.parametrize(
    "layout", [pytest.param("packed", marks=needs_mkl), pytest.param("panel", marks=needs_panel)]
)
def test_a_drafter_is_laid_out_like_its_target_and_decodes_the_same(layout: str) -> None:
    """A ReDrafter over a packed / panel fp32 target: its own Linear layers are laid out the same way, the output
    stays AR's."""
    from specdraft.eval.proposers import ReDrafterProposer
    from specdraft.models import redrafter
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.testing import tiny_tokenizer
    from specdraft.train.config import ReDrafterSchema

    model = tiny_target("llama", CPU).float()
    fp = target_fingerprint(model, tiny_tokenizer())
    drafter = (
        redrafter.build(ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1), model, fp).float().eval()
    )
    assert match_target_layout(drafter, model) == 0  # a native target: nothing to match
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3))
    dec = StaticDecoder(model, 64)
    before, _ = dec.speculative_generate(None, prompt, ReDrafterProposer(drafter, 4, 4), 24, stop_ids=set())
    assert apply_layout(model, layout) == layout
    assert match_target_layout(drafter, model) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    dec = StaticDecoder(model, 64)
    ref, _ = dec.ar_generate(None, prompt, 24, stop_ids=set())
    out, _ = dec.speculative_generate(None, prompt, ReDrafterProposer(drafter, 4, 4), 24, stop_ids=set())
    assert out == ref == before


def test_free_memory_is_read_on_linux() -> None:
    from pathlib import Path

    from specdraft.models.linear_layout import free_memory_bytes

    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo")
    assert 0 < free_memory_bytes() < 1 << 50
