"""`eval/int8_clone.py`: a decode-time view of a drafter with int8 products (`eval.draft_block=int8` for the
ReDrafter): it shares the drafter's parameters, leaves the drafter itself untouched, stays close to the float
products, is built once per weights, and the ReDrafter searching through it still decodes losslessly (the
`redrafter_int8` decoder test family covers every path; here the direct checks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdraft.eval.int8_clone import Int8Product, int8_clone
from specdraft.eval.proposers import ReDrafterProposer, int8_supported, make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.testing import random_prompts, tiny_proposer, tiny_target

pytestmark = [
    pytest.mark.usefixtures("one_cpu_thread"),
    pytest.mark.skipif(not int8_supported(), reason="no fbgemm int8 ops in this torch build"),
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 32))
        self.head = nn.Linear(32, 100, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_the_clone_shares_weights_swaps_linears_and_leaves_the_original():
    torch.manual_seed(0)
    net = Net()
    twin = int8_clone(net, keep=("head",))
    assert twin is not net and twin.head is net.head  # kept: the same module
    assert isinstance(twin.inner[0], Int8Product) and isinstance(twin.inner[2], Int8Product)
    assert isinstance(net.inner[0], nn.Linear) and isinstance(net.inner[2], nn.Linear)  # untouched
    assert {id(p) for p in twin.parameters()} <= {id(p) for p in net.parameters()}  # nothing copied
    x = torch.randn(8, 32)
    ref, got = net.inner(x), twin.inner(x)
    assert got.dtype == torch.float32
    assert twin.inner(x.bfloat16()).dtype == torch.float32  # float32 from the first product on: no casts back
    assert (got - ref).norm() / ref.norm() < 0.05  # int8 per-channel weights, activations per call
    assert int8_clone(net, keep=("head",)) is twin  # built once per weights
    with torch.no_grad():
        net.inner[0].weight.mul_(2.0)  # trained further: a new clone with the new weights
    again = int8_clone(net, keep=("head",))
    assert again is not twin
    ref2 = net.inner(x)
    assert (again.inner(x) - ref2).norm() / ref2.norm() < 0.05


def test_the_clone_swaps_the_panel_linears_a_panel_target_layout_made():
    """`match_target_layout` turns a drafter's Linears into `PanelLinear`s (fp32 panels) on a panel target; the
    int8 view must still swap them (before, it found no `nn.Linear` and drafted in fp32 panels)."""
    from specdraft.models.panel_linear import PanelLinear, panel_available, panel_linears

    if not panel_available():
        pytest.skip("the panel kernel does not build here")
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(8, 32)
    ref = net.inner(x)
    panel_linears(net)
    assert isinstance(net.inner[0], PanelLinear)
    twin = int8_clone(net, keep=("head",))
    assert isinstance(twin.inner[0], Int8Product) and isinstance(twin.inner[2], Int8Product)
    assert isinstance(twin.head, PanelLinear) and isinstance(net.inner[0], PanelLinear)  # kept, untouched
    assert (twin.inner(x) - ref).norm() / ref.norm() < 0.05


def test_no_clone_where_int8_does_not_apply():
    only_head = nn.Sequential()
    only_head.add_module("head", nn.Linear(4, 4))
    assert int8_clone(only_head, keep=("head",)) is only_head  # nothing to swap


def test_the_int8_redrafter_drafts_near_the_float_one_and_decodes_losslessly():
    model = tiny_target("llama")
    plain = tiny_proposer("redrafter_copy", model)
    int8 = tiny_proposer("redrafter_int8", model)
    assert isinstance(int8, ReDrafterProposer) and int8._search is not int8.drafter
    assert plain._search is plain.drafter
    # the drafter module itself keeps float Linears: training and exports never see the int8 view
    assert isinstance(int8.drafter.rnn_u, nn.Linear) and isinstance(int8._search.rnn_u, Int8Product)
    assert isinstance(int8._search.copy_gate.fc, Int8Product) and int8._search.head is int8.drafter.head
    prompt = torch.tensor(random_prompts([11], seed=3)[0])
    dec = StaticDecoder(model, 128)
    ar, _ = dec.ar_generate(None, prompt, 40, stop_ids=set())
    out, stats = dec.speculative_generate(None, prompt, int8, 40, stop_ids=set())
    assert out == ar and stats.steps < len(out)


def test_draft_block_selects_the_int8_search_for_the_redrafter():
    model = tiny_target("llama")
    drafter = tiny_proposer("redrafter_copy", model).drafter
    assert make_proposer(drafter, draft_block="int8")._search is not drafter
    assert make_proposer(drafter, draft_block="hf")._search is drafter
    assert make_proposer(drafter, draft_block="fused")._search is drafter


def test_int8_products_quantise_activations_to_8_bits_where_vnni_accumulates_in_32(monkeypatch):
    """`Int8Linear` uses 7-bit activations (fbgemm's `reduce_range`) only without VNNI/AMX dot products; there
    the 8-bit ones halve the error (what made EAGLE-1's int8 layer draft as well as its float one). On a CPU
    without VNNI (AVX2's pairwise sums saturate in 16 bits) 8-bit activations are the worse ones, which is why
    the rule keeps 7 bits there: the test checks whichever the machine can show."""
    from specdraft import hardware
    from specdraft.eval.proposers import Int8Linear

    vnni = hardware.cpu_int8_full_range()  # this machine's real dot products
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    x = torch.randn(8, 64) * 3
    ref = lin(x)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    full = Int8Linear(lin)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    reduced = Int8Linear(lin)
    assert not full.reduce_range and reduced.reduce_range
    err_full, err_reduced = ((q(x) - ref).norm() / ref.norm() for q in (full, reduced))
    if vnni:
        assert err_full < 0.8 * err_reduced < 0.05
    else:
        assert err_reduced < 0.05 < err_full, (err_full, err_reduced)


def test_medusa_int8_layers_keep_the_vocabulary_and_root_products_and_decode_losslessly():
    model = tiny_target("llama")
    drafter = tiny_proposer("medusa_root", model).drafter
    p = make_proposer(drafter, tree_nodes=12, draft_block="int8")
    view = p._search
    assert view is not drafter and view.root_input is drafter.root_input  # slices its weight per call
    for (_, lin), (_, twin) in zip(drafter.vocab_heads(), view.vocab_heads(), strict=True):
        assert twin is lin  # the vocabulary products follow int8_head, not the view
    assert isinstance(view.heads[0][0].linear, Int8Product)
    assert make_proposer(drafter, tree_nodes=12, draft_block="auto")._search is drafter  # not declared
    prompt = torch.tensor(random_prompts([10], seed=6)[0])
    dec = StaticDecoder(model, 128)
    ar, _ = dec.ar_generate(None, prompt, 40, stop_ids=set())
    out, _ = dec.speculative_generate(None, prompt, p, 40, stop_ids=set())
    assert out == ar
