"""Medusa heads' top-k through C (`eval/medusa_native.py`, `sd_medusa_heads`): the torch heads' top-k with the
same weights (plain and root-token heads, 1-2 residual blocks, full and reduced draft vocabularies), the VNNI
products' agreement, lossless decoding through the proposer under capped budgets, and the cases left to torch."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from specdraft.eval import medusa_native
from specdraft.eval.budget import NodeBudget
from specdraft.eval.decode import ar_generate
from specdraft.eval.medusa_tree import MedusaProposer
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import medusa
from specdraft.testing import jitter, on_int8_grid, tiny_llama

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _heads(
    target: nn.Module, root: bool, layers: int = 1, vd: int | None = None, seed: int = 1, scale: float = 0.3
) -> medusa.Medusa:
    """fp32 Medusa heads (3 heads, top-4) over `target` with random blocks and root projection (noise of std
    `scale` on every weight), on the int8 grid."""
    schema = OmegaConf.create(
        {"draft_len": 3, "num_layers": layers, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
         "tree_choices": None, "draft_vocab_size": vd, "root_token": root}
    )  # fmt: skip
    h, v = int(target.config.hidden_size), int(target.config.vocab_size)
    fp = {"name_or_path": "tiny", "hidden_size": h, "vocab_size": v, "tokenizer_hash": "abc"}
    counts = torch.randperm(v, generator=torch.Generator().manual_seed(0)).float() if vd else None
    model = medusa.build(schema, target, fp, token_counts=counts).float()
    medusa.attach(model, target)
    torch.manual_seed(seed)
    jitter(model, scale)
    on_int8_grid(model)
    return model.eval()


@pytest.mark.parametrize(
    ("root", "layers", "vd"), [(False, 1, None), (True, 1, None), (True, 2, 40), (False, 2, 40)]
)
def test_native_heads_are_what_torch_drafts(root, layers, vd):
    """Every head's top-4 target ids equal torch's (`Medusa.topk_tokens`) at random states and roots, for every
    number of heads run; the copies are shared by the proposers of one set of heads and weights."""
    target = tiny_llama()  # fp32, H = 32: fp32 activations in C
    heads = _heads(target, root, layers, vd)
    native = medusa_native.MedusaNative(heads)
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        h = torch.randn(32, generator=gen) * 2.0
        r = torch.randint(0, 128, (), generator=gen)
        for n in (1, 2, 3):
            want = heads.topk_tokens(h, 4, n, root=r)  # (n, 4)
            assert native.topk(h, r, 4, n).tolist() == want.tolist()
            # what a copy gate reads, from the same call: draft ids, the heads' states and logits
            ids, states, logits = native.heads_out(h, r, 4, n)
            assert heads.to_target_ids(ids).tolist() == want.tolist()
            torch.testing.assert_close(states, heads.head_states(h, n, r), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logits, heads.head_logits(h, n, root=r), rtol=1e-5, atol=1e-4)
    assert medusa_native.make_native(heads) is medusa_native.make_native(heads)


def test_native_heads_with_int8_activations_on_vnni():
    """H = 64 takes the VNNI products (activations quantised to int8 per vector): the top-1 of every head still
    equals torch's where it is not a near tie (nearly all states)."""
    from specdraft.models import qdot

    if not qdot.set_vnni(True):
        pytest.skip("no AVX-512 VNNI here")
    target = tiny_llama(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    heads = _heads(target, root=True)
    native = medusa_native.MedusaNative(heads)
    gen = torch.Generator().manual_seed(4)
    same = total = 0
    for _ in range(40):
        h, r = torch.randn(64, generator=gen) * 2.0, torch.randint(0, 128, (), generator=gen)
        got, want = native.topk(h, r, 1, 3)[:, 0], heads.topk_tokens(h, 1, 3, root=r)[:, 0]
        same, total = same + int((got == want).sum()), total + 3
    assert same >= 0.9 * total, (same, total)


@pytest.mark.parametrize("root", [False, True])
def test_decoding_through_the_native_heads_is_lossless(root):
    """Greedy output equals AR under caps of 2-6 nodes (one to three heads, ranks beyond the first) with mixed
    prompt lengths and a stop token; the proposer's lone rows draft through C."""
    target = tiny_llama()
    heads = _heads(target, root)
    proposer = make_proposer(heads, int8_head=True, draft_block="auto")
    assert isinstance(proposer, MedusaProposer) and proposer._native is not None
    calls = []
    real = proposer._native.topk
    proposer._native.topk = lambda *a: calls.append(a[2:]) or real(*a)  # type: ignore[method-assign]
    dec = StaticDecoder(target, 64)
    for cap, prompt_len, stop in [(2, 3, set()), (4, 11, {7}), (3, 5, set()), (6, 9, set())]:
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(target, None, prompt, 24, stop_ids=stop)
        out, stats = dec.speculative_generate(
            None, prompt, proposer, 24, stop_ids=stop, budget=NodeBudget.fixed(cap)
        )
        assert out == ref and max(stats.tree_sizes) <= cap
    assert calls and max(n for _, n in calls) >= 2  # deeper caps ran more heads


def test_what_drafts_in_torch(monkeypatch):
    """Not Medusa, another dtype, no int8 heads or `SPECDRAFT_NATIVE_CHAIN=0`: no native heads (`unsupported`
    says why); rows drafted together stay in torch (one top-k over the rows), a lone row takes its native heads."""
    target = tiny_llama()
    heads = _heads(target, root=True)
    assert medusa_native.unsupported(heads) is None
    assert "not Medusa" in str(medusa_native.unsupported(nn.Linear(2, 2)))
    fp64 = _heads(tiny_llama(dtype=torch.float64), root=True).double()
    assert "fp32 on the CPU" in str(medusa_native.unsupported(fp64))
    assert make_proposer(heads, int8_head=False)._native is None
    ps = [make_proposer(heads, int8_head=True) for _ in range(2)]
    assert ps[0]._native is not None and ps[0]._native is ps[1]._native
    hidden = [torch.randn(3, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    tokens = [torch.tensor([4, 9, 11]), torch.tensor([7, 3, 20])]
    rows = ps[0].propose_rows(ps, hidden, tokens)
    assert rows is not None
    p = ps[0]  # the rows' torch top-k, one call (int8 activations share a scale across the rows)
    roots = torch.stack([t[-1] for t in tokens])
    top = p._search.topk_tokens(torch.stack([h[-1] for h in hidden]), *p._run, linears=p.int8, root=roots)
    for r, tree in enumerate(rows):
        want = torch.cat([roots[r : r + 1], top[r][p.head[1:], p.rank[1:]]])
        assert tree.tokens.tolist() == want.tolist()
    alone = ps[0].propose_rows([ps[0]], hidden[:1], tokens[:1])  # a lone row: its native heads
    assert (
        alone is not None and alone[0].tokens.tolist() == ps[0].propose(hidden[0], tokens[0]).tokens.tolist()
    )
    with pytest.raises(ValueError, match="k=0 must be in"):
        ps[0]._native.topk(hidden[0][-1], tokens[0][-1], 0, 1)
    monkeypatch.setenv("SPECDRAFT_NATIVE_CHAIN", "0")
    assert make_proposer(heads, int8_head=True)._native is None


def test_sampling_through_the_native_heads_keeps_the_target_distribution(monkeypatch):
    """T > 0 with the heads drafting through C: the first two sampled tokens follow the target's own
    distribution (chi-square over 1,000 draws against two exact target forwards), with drafted tokens both kept
    and rejected; the same harness rejects a rule that draws the bonus token from p instead of the residual
    (`testing.check_sampling_keeps_distribution`)."""
    from specdraft.testing import check_sampling_keeps_distribution, peaked_tiny_target

    target = peaked_tiny_target()

    def native() -> MedusaProposer:  # root-token heads on a 3-node tree
        proposer = make_proposer(_heads(target, root=True, scale=0.05), int8_head=True)
        assert proposer._native is not None
        proposer.fit_budget(3)
        return proposer

    check_sampling_keeps_distribution(target, native, monkeypatch)


def test_freed_heads_drop_their_native_copies():
    """The shared copies are held per heads, weakly: heads that are freed take their int8 copies with them."""
    import gc
    import weakref

    heads = _heads(tiny_llama(), root=True)
    assert medusa_native.make_native(heads) is not None
    alive = weakref.ref(heads)
    del heads
    gc.collect()
    assert alive() is None
