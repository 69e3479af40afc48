"""The decoders' lean target forward (`models/fast_target.py`): the same hidden states, intermediate layers and
KV cache as transformers' forward on tiny Llama / Qwen2 / Mistral targets (fp64) for one-token steps, tree
masks and batched rows; transformers' forward where it does not apply; the decoders take it by default."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from specdraft.models import fast_target
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.panel_linear import panel_available, panel_linears
from specdraft.testing import random_prompts, tiny_proposer, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
ARCHS = ["llama", "qwen2", "mistral"]


def _prefix(model, rows: int, length: int, seed: int) -> tuple[DynamicCache, torch.Tensor]:
    """A DynamicCache of `rows` x `length` random tokens (transformers' causal prefill) and its ids."""
    ids = torch.randint(5, 120, (rows, length), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    forward_with_hidden(model, ids, past_key_values=cache, use_cache=True, logits=False)
    return cache, ids


def _both(model, cache, ids, mask, pos, layers):
    """(HF, fast) forwards of the same step on copies of `cache`: outputs and the caches after."""
    hf_cache, fast_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    hf = forward_with_hidden(model, ids, mask, pos, hf_cache, layers, use_cache=True, logits=False)
    lean = fast_target.fast_forward(model, ids, mask, pos, fast_cache, layers)
    assert lean is not None
    return hf, lean, hf_cache, fast_cache


def _same(hf, lean, hf_cache, fast_cache, layers) -> None:
    torch.testing.assert_close(lean[0], hf.hidden, rtol=0, atol=1e-12)
    if layers:
        torch.testing.assert_close(lean[1], hf.layers, rtol=0, atol=1e-12)
    for a, b in zip(hf_cache.layers, fast_cache.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_step_equals_transformers(arch):
    """A decode step without a mask (every cached position visible), positions implied or given, with the
    embeddings, a middle layer and the final normed states as extra layers (transformers' numbering)."""
    model = tiny_target(arch)
    assert fast_target.unsupported(model) is None
    n_layers = model.config.num_hidden_layers
    cache, _ = _prefix(model, 1, 9, seed=0)
    step = torch.tensor([[17]])
    for pos, layers in ((None, ()), (torch.tensor([[9]]), (0, 1, n_layers))):
        _same(*_both(model, cache, step, None, pos, layers), layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_and_batched_masks_equal_transformers(arch):
    """A 4-node tree under an additive mask at tree positions (one row), then 3 rows of 3 new tokens each under
    their own boolean masks and positions (a batched step)."""
    model = tiny_target(arch)
    cache, _ = _prefix(model, 1, 6, seed=1)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    visible = torch.cat([torch.ones(4, 6, dtype=torch.bool), anc], dim=1)  # (4, 10)
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(
        ~visible, torch.finfo(torch.float64).min
    )
    mask = mask[None, None]  # (1, 1, 4, 10) additive
    pos = (6 + anc.sum(1) - 1)[None]  # (1, 4) depths
    tree = torch.tensor([[11, 12, 13, 14]])
    _same(*_both(model, cache, tree, mask, pos, (1,)), (1,))
    cache, _ = _prefix(model, 3, 5, seed=2)
    rows = torch.randint(5, 120, (3, 3), generator=torch.Generator().manual_seed(3))
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, :2] = False  # row 1 sees less of its prefix (as a padded row would)
    bmask = torch.cat([keep[:, None].expand(3, 3, 5), causal.expand(3, 3, 3)], dim=2)[:, None]  # (3, 1, 3, 8)
    bpos = 5 + torch.arange(3).expand(3, 3)
    _same(*_both(model, cache, rows, bmask, bpos, (0, 2)), (0, 2))


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_step_equals_the_padded_one_at_the_wanted_positions(arch):
    """`packed` (a batched verify's padding left out of the per-token products): at the wanted positions the
    hidden states, the requested layers and the cache entries equal the unpacked forward's (fp64), though
    the padding positions carried other tokens there; the padding outputs are zeros. A step where every
    position is wanted needs no packing (`Packing.of` -> None)."""
    model = tiny_target(arch)
    cache, _ = _prefix(model, 3, 5, seed=5)
    ids = torch.randint(5, 120, (3, 4), generator=torch.Generator().manual_seed(6))
    valid = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)  # (3, 4) real nodes
    # per row a chain over its real nodes; padding nodes see the prefix and themselves (as `_pack_trees`)
    anc = torch.eye(4, dtype=torch.bool).expand(3, 4, 4) | (
        torch.ones(4, 4, dtype=torch.bool).tril() & valid[:, None, :] & valid[:, :, None]
    )
    anc = anc | (torch.arange(4) == 0)  # every node sees the root
    mask = torch.cat([torch.ones(3, 4, 5, dtype=torch.bool), anc], dim=2)[:, None]  # (3, 1, 4, 9)
    pos = 5 + anc.sum(2) - 1  # (3, 4)
    pack = fast_target.Packing.of(valid)
    assert pack is not None and pack.rows.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert fast_target.Packing.of(torch.ones(2, 3, dtype=torch.bool)) is None
    full_cache, packed_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    full = fast_target.fast_forward(model, ids, mask, pos, full_cache, (0, 2))
    other = ids.masked_fill(~valid, 7)  # the padding's tokens do not matter
    lean = fast_target.fast_forward(model, other, mask, pos, packed_cache, (0, 2), packed=pack)
    assert full is not None and lean is not None and full[1] is not None and lean[1] is not None
    torch.testing.assert_close(lean[0][valid], full[0][valid], rtol=0, atol=1e-12)
    torch.testing.assert_close(lean[1][valid], full[1][valid], rtol=0, atol=1e-12)
    assert not lean[0][~valid].any() and not lean[1][~valid].any()
    keep = torch.cat([torch.ones(3, 5, dtype=torch.bool), valid], dim=1)  # (3, 9) cache positions compared
    for a, b in zip(full_cache.layers, packed_cache.layers, strict=True):
        torch.testing.assert_close(
            b.keys.transpose(1, 2)[keep], a.keys.transpose(1, 2)[keep], rtol=0, atol=1e-12
        )
        torch.testing.assert_close(
            b.values.transpose(1, 2)[keep], a.values.transpose(1, 2)[keep], rtol=0, atol=1e-12
        )


def test_the_batch_decoder_packs_its_padded_trees_on_a_cpu(monkeypatch):
    """The eager batched verify hands `fast_forward` the real nodes only when rows' trees differ in size, and
    every row's output equals its own AR output (fp64, trees of mixed sizes: random proposers)."""
    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.eval.decode import ar_generate
    from specdraft.testing import RandomTreeProposer

    model = tiny_target("llama")
    prompts = random_prompts([4, 9, 6, 13], seed=9)
    seen: list[tuple[int, int]] = []  # (wanted positions, all positions) per packed call
    inner = fast_target.fast_forward

    def spy(*args, **kwargs):
        pack = kwargs.get("packed") if "packed" in kwargs else (args[6] if len(args) > 6 else None)
        if pack is not None:
            seen.append((pack.rows.numel(), pack.shape[0] * pack.shape[1]))
        return inner(*args, **kwargs)

    monkeypatch.setattr("specdraft.models.base_llm.fast_forward", spy)
    seeds = iter(range(100))
    dec = BatchDecoder(model, 3)
    outs = dec.generate(
        prompts, 16, set(), proposer_factory=lambda: RandomTreeProposer(128, seed=next(seeds))
    )
    for p, (out, _) in zip(prompts, outs, strict=True):
        ref, _ = ar_generate(model, None, torch.tensor(p), 16, stop_ids=set())
        assert out == ref
    assert seen and all(t < n for t, n in seen)


def test_where_it_does_not_apply():
    """A causal prefill (several tokens, no mask), a 2D padding mask, keys past a sliding window, another attention function or
    layer type: None (transformers' forward runs), each with its reason where `unsupported` says one."""
    model = tiny_target("mistral")
    cache, _ = _prefix(model, 1, 6, seed=4)
    assert fast_target.fast_forward(model, torch.tensor([[5, 6]]), None, None, cache, ()) is None
    padding = torch.ones(1, 8, dtype=torch.long)  # a (B, S) padding mask
    assert fast_target.fast_forward(model, torch.tensor([[5, 6]]), padding, None, cache, ()) is None
    windowed = copy.deepcopy(model)
    windowed.config.sliding_window = 6
    assert (
        fast_target.fast_forward(windowed, torch.tensor([[5]]), None, None, copy.deepcopy(cache), ()) is None
    )
    assert fast_target.fast_forward(
        windowed, torch.tensor([[5]]), None, torch.tensor([[6]]), DynamicCache(), ()
    )
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert fast_target.fast_forward(eager, torch.tensor([[5]]), None, None, copy.deepcopy(cache), ()) is None
    other = copy.deepcopy(model)
    other.get_decoder().layers[1] = nn.Identity()
    assert "Identity is not one of" in str(fast_target.unsupported(other))
    other.get_decoder().norm = nn.LayerNorm(32)
    assert "final norm LayerNorm" in str(fast_target.unsupported(other))


@pytest.mark.parametrize("family", ["ar", "eagle3"])
def test_the_decoders_take_it_and_the_switch_turns_it_off(family, monkeypatch):
    """The static decoder's verify and AR steps run the lean forward (the prefill does not: no mask); with
    `SPECDRAFT_TARGET_FORWARD=hf` none does, and the tokens are the same."""
    from specdraft.eval.static_decode import StaticDecoder

    model = tiny_target("llama")
    prompt = torch.tensor(random_prompts([12], seed=8)[0])
    calls: list[int] = []
    inner = fast_target.fast_forward

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("specdraft.models.base_llm.fast_forward", spy)
    outs = []
    for switch in ("fast", "hf"):
        monkeypatch.setenv(fast_target.ENV, switch)
        calls.clear()
        dec = StaticDecoder(model, 96)
        if family == "ar":
            out, _ = dec.ar_generate(None, prompt, 20, stop_ids=set())
        else:
            out, _ = dec.speculative_generate(None, prompt, tiny_proposer(family, model), 20, stop_ids=set())
        outs.append(out)
        assert (sum(calls) > 5) if switch == "fast" else not calls
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_transformers_bit_for_bit(dtype):
    """`rotate` with the sign folded into the sin table gives transformers' `apply_rotary_pos_emb` exactly."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 5, 16, generator=g).to(dtype) for h in (4, 2))
    cos, sin = (torch.randn(2, 5, 16, generator=g).to(dtype) for _ in range(2))
    want = apply_rotary_pos_emb(q, k, cos, sin)
    tables = fast_target.rotary_tables(cos[:, None], sin[:, None])
    assert torch.equal(fast_target.rotate(q, *tables), want[0])
    assert torch.equal(fast_target.rotate(k, *tables), want[1])


@pytest.mark.skipif(not panel_available(), reason="the panel kernel does not build here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_panel_layout_runs_qkv_and_gate_up_as_one_call_each(arch):
    """On the CPU's panel layout each layer's q/k/v and gate/up run as one kernel call each (`StackedPanels`),
    and the step still equals transformers' forward on the same weights (fp32: rounding of the fused norm)."""
    model = tiny_target(arch).float()
    panel_linears(model)
    cache, _ = _prefix(model, 2, 7, seed=6)
    hf, lean, hf_cache, fast_cache = _both(model, cache, torch.tensor([[9], [10]]), None, None, (1,))
    torch.testing.assert_close(lean[0], hf.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean[1], hf.layers, rtol=1e-5, atol=1e-5)
    for layer in model.get_decoder().layers:
        stacks = fast_target._stacks(layer)
        assert stacks is not None and stacks[0].members[0] is layer.self_attn.q_proj
    again = copy.deepcopy(model)  # new modules: stacked anew for them
    layer = again.get_decoder().layers[0]
    assert (
        fast_target._stacks(layer) is not None
        and fast_target._stacks(layer)[1].members[1] is layer.mlp.up_proj
    )
