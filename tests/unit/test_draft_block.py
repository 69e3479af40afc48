"""The decode-time copy of an EAGLE head's layer (`eval/draft_block.py`): the HF layer's values, fused."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from specdraft.eval.draft_block import FastBlock, draft_block, supported
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.eval.proposers import int8_supported, make_proposer
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import tiny_target

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}


def _head(family, target, dtype=torch.float32):
    schema = SimpleNamespace(
        draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
        token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=None, ttt_decay=0.8,
    )  # fmt: skip
    torch.manual_seed(3)
    head = family.build(schema, target, FP).to(dtype).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head


def _layer(head):
    return head.draft_layer()[0]


def _passes(head, feats, tokens, block):
    """A commit of 7 positions, then a 3-node frontier attending to them under a tree mask: (7 + 3, H)."""
    cache = DynamicCache()
    n = feats.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    g = head.encode_target(feats.to(head.fc.weight.dtype), block)[None]
    out = head.step(g, tokens[None], cache, torch.arange(n)[None], mask, block)[0]  # (n, H)
    front = out[-3:][None]  # (1, 3, H): three frontier nodes fed back
    rows = torch.cat(
        [torch.ones(3, n, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], dim=1
    )  # (3, n + 3)
    deeper = head.step(front, tokens[:3][None], cache, torch.full((1, 3), n), rows, block)[0]
    return torch.cat([out, deeper])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("family", [eagle, eagle3])
def test_fused_block_equals_the_hf_layer_in_fp32(family, arch):
    """Fused q/k/v and gate/up products (and Qwen2's q/k/v biases): the HF modules' values, pass after pass."""
    target = tiny_target(arch).float()
    head = _head(family, target)
    assert supported(_layer(head)) is None
    ids = torch.randint(5, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    feats = forward_with_hidden(target, ids).hidden[
        0
    ]  # (7, H) last layer (EAGLE-3: tiled, as its config reads)
    if family is eagle3:
        feats = torch.cat([feats] * len(head.config.target_layers), dim=-1)
    block = draft_block(head, *head.draft_layer(), int8=False)
    assert isinstance(block, FastBlock)
    with torch.inference_mode():
        ref = _passes(head, feats, ids[0], None)
        out = _passes(head, feats, ids[0], block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_supported(), reason="needs fbgemm's int8 products")
def test_int8_block_stays_close_and_is_shared_until_the_weights_change():
    target = tiny_target("llama").float()
    head = _head(eagle3, target)
    ids = torch.randint(5, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    feats = torch.cat([forward_with_hidden(target, ids).hidden[0]] * 3, dim=-1)
    block = draft_block(head, head.midlayer, {"fc": head.fc}, int8=True)
    assert block is not None and block.qkv.int8 is not None and block.extra["fc"].int8 is not None
    with torch.inference_mode():
        ref, out = _passes(head, feats, ids[0], None), _passes(head, feats, ids[0], block)
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.05  # int8 weights: close to the HF values, not equal
    # one copy per head and weights: every proposer of a batch shares it; training the head rebuilds it
    assert draft_block(head, head.midlayer, {"fc": head.fc}, int8=True) is block
    with torch.no_grad():
        head.midlayer.mlp.down_proj.weight.mul_(2.0)
    assert draft_block(head, head.midlayer, {"fc": head.fc}, int8=True) is not block


def test_unsupported_layers_keep_the_hf_modules():
    target = tiny_target("llama")
    head = _head(eagle3, target)
    layer = _layer(head)
    layer.self_attn.q_norm = torch.nn.Identity()  # Qwen3-style q/k norms: not reproduced
    assert "q/k norms" in str(supported(layer))
    assert draft_block(head, layer, {"fc": head.fc}, int8=False) is None
    assert "is not one of" in str(supported(torch.nn.Linear(2, 2)))
    prop = EagleTreeProposer(head, 10, 4, 3, draft_block="fused")
    assert prop.block is None  # falls back to the HF layer, same proposer otherwise
    with pytest.raises(ValueError, match="draft_block='fast'"):
        EagleTreeProposer(head, 10, 4, 3, draft_block="fast")


@pytest.mark.parametrize("family", [eagle, eagle3])
@pytest.mark.parametrize("static", [False, True])
def test_fused_block_drafts_the_same_trees(family, static):
    """The proposer with the fused block gives the HF layer's trees, call after call (fp32)."""
    target = tiny_target("llama").float()
    head = _head(family, target)
    ids = torch.randint(5, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    hidden = forward_with_hidden(target, ids).hidden[0]
    if family is eagle3:
        hidden = torch.cat([hidden] * 3, dim=-1)
    nxt = torch.cat([ids[0, 1:], torch.tensor([7])])
    props = [make_proposer(head, tree_nodes=10, static=static, draft_block=b) for b in ("hf", "fused")]
    assert props[0].block is None and props[1].block is not None
    for lo, hi in ((0, 6), (6, 7), (7, 10), (10, 16)):  # prefill, then accepted paths of 1, 3 and 6
        a, b = (p.propose(hidden[lo:hi], nxt[lo:hi]) for p in props)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.skipif(not int8_supported(), reason="needs fbgemm's int8 products")
def test_auto_runs_int8_where_the_family_declares_it(monkeypatch):
    """eval.draft_block=auto: a family declaring `int8_draft_layer` (EAGLE-3 and, with 8-bit activations,
    EAGLE-1) drafts through int8 products; one that does not, through the fused layer in its own dtype."""
    target = tiny_target("llama").float()
    e3, e1 = (EagleTreeProposer(_head(f, target), 10, 4, 3, draft_block="auto") for f in (eagle3, eagle))
    assert e3.block is not None and e3.block.qkv.int8 is not None
    assert e1.block is not None and e1.block.qkv.int8 is not None
    monkeypatch.setattr(eagle, "FAMILY", dataclasses.replace(eagle.FAMILY, int8_draft_layer=False))
    e1 = EagleTreeProposer(_head(eagle, target), 10, 4, 3, draft_block="auto")
    assert e1.block is not None and e1.block.qkv.int8 is None
