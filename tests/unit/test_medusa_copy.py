"""Medusa's copy gate (`models/medusa_copy.py`, `eval/medusa_copy_tree.py`): the mixture's ranks against a brute
force, the gate at its start and warm-started from plain heads, the tree the decoder drafts (each node's children
from its own path's candidate), lossless greedy decoding and sampling that keeps the target's distribution.
The eager, fixed-shape, graph and batched paths run "medusa_copy" through `testing.FAMILIES`."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from specdraft.data.ngrams import NgramIndex
from specdraft.eval import medusa_native
from specdraft.eval.budget import NodeBudget
from specdraft.eval.decode import ar_generate
from specdraft.eval.medusa_tree import MedusaProposer, measure_rank_accuracies, rank_hits
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import medusa
from specdraft.models.copy_lookup import mix_log_probs, mix_logits
from specdraft.models.medusa_copy import mixture_ranks
from specdraft.testing import jitter, saved_without, tiny_llama

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _heads(target: nn.Module, copy: int = 3, vd: int | None = None, scale: float = 0.3) -> medusa.Medusa:
    """fp64 root-token Medusa heads (3 heads, top-4) over `target`, with a copy gate of order `copy` (0: none) and
    random weights (noise of std `scale`)."""
    schema = OmegaConf.create(
        {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
         "tree_choices": None, "draft_vocab_size": vd, "root_token": True, "copy_ngram": copy,
         "copy_hidden": 8, "copy_scale": 8.0}
    )  # fmt: skip
    h, v = int(target.config.hidden_size), int(target.config.vocab_size)
    fp = {"name_or_path": "tiny", "hidden_size": h, "vocab_size": v, "tokenizer_hash": "abc"}
    counts = torch.randperm(v, generator=torch.Generator().manual_seed(0)).float() if vd else None
    model = medusa.build(schema, target, fp, token_counts=counts).to(next(target.parameters()).dtype)
    torch.manual_seed(1)
    return jitter(model, scale).eval()


def test_mixture_ranks_are_the_mixtures_top_k():
    """The k best of (1 - lam) p + lam onehot(c), from p's k best and c's log-probability, equal a top-k over the
    whole mixed distribution (`mix_log_probs`): candidates inside and outside p's k best, lam from 0 to 0.9."""
    gen = torch.Generator().manual_seed(0)
    moved = 0
    for trial in range(200):
        logits = torch.randn(50, generator=gen, dtype=torch.float64) * 3.0
        logp = torch.log_softmax(logits, -1)
        cand = int(torch.randint(0, 50, (), generator=gen))
        lam = [0.0, 0.02, 0.1, 0.5, 0.9][trial % 5]
        vals, ids = logp.topk(5)
        got = mixture_ranks(ids.tolist(), vals.tolist(), cand, float(logp[cand]), lam)
        want = (
            mix_log_probs(logits, torch.tensor(cand), torch.tensor(lam, dtype=torch.float64)).topk(5).indices
        )
        assert got == want.tolist(), (trial, cand, lam)
        moved += got != ids.tolist()
    assert moved > 50  # the candidate changed the list often


def test_a_fresh_gate_mixes_at_one_half_and_warm_starts_from_plain_heads():
    """At its start the gate weighs every candidate 1/2 (the logits of the mixture with lam = 1/2; unchanged where
    there is none), it is the only new tensor next to plain root-token heads, and without candidates the
    gated heads compute the plain heads' logits."""
    target = tiny_llama(dtype=torch.float64)
    plain = _heads(target, copy=0)
    gated = _heads(target, copy=3)
    missing, unexpected = gated.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all(k.startswith("copy.gate.") for k in missing)
    nn.init.zeros_(gated.copy.gate.out.weight)  # (jitter moved it: back to the start)
    nn.init.zeros_(gated.copy.gate.out.bias)
    nn.init.zeros_(gated.copy.gate.length_bias)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 5, 32, generator=gen, dtype=torch.float64)
    root = torch.randint(0, 128, (2, 5), generator=gen)
    targets = torch.zeros(2, 5, 3, dtype=torch.long)
    cand = torch.randint(0, 128, (2, 5, 3), generator=gen)
    length = torch.randint(0, 3, (2, 5, 3), generator=gen)  # 0: no candidate
    cand = torch.where(length > 0, cand, torch.full_like(cand, -1))
    base = plain(hidden, root, targets)  # (2, 5, 3, V)
    assert torch.equal(gated(hidden, root, targets), base)  # no candidates passed: the plain heads
    mixed = gated(hidden, root, targets, copy=(cand, length))
    half = torch.where(length > 0, 0.5, 0.0).double()
    assert torch.allclose(mixed, mix_logits(base, cand.clamp_min(0), half), atol=1e-12)
    assert torch.equal(mixed[length == 0], base[length == 0])


@pytest.mark.parametrize("vd", [None, 64])
def test_each_nodes_children_come_from_its_own_paths_candidate(vd):
    """The drafted tree, node by node: the children of a node are the ranks its own mixture gives, with the
    candidate looked up on the committed tokens + the root + that node's path (brute force over the tree with
    the full mixtures); the plain heads' tree differs where a candidate moved up."""
    target = tiny_llama(dtype=torch.float64)
    heads = _heads(target, vd=vd)
    with (
        torch.no_grad()
    ):  # longer matches weigh more (lam near 1 at m = 3), so the echoes' candidates move up
        heads.copy.gate.length_bias.copy_(torch.tensor([0.0, 0.0, 0.5, 2.0]))
    proposer = make_proposer(heads, int8_head=False)
    assert isinstance(proposer, MedusaProposer) and proposer._copy is not None
    proposer.fit_budget(12)
    gen = torch.Generator().manual_seed(5)
    differs = 0
    for step in range(6):
        proposer.reset()
        base = torch.randint(0, 128, (6,), generator=gen)
        tokens = (
            torch.cat([base, base, base[:3]]) if step % 2 else torch.randint(0, 128, (15,), generator=gen)
        )
        hidden = torch.randn(tokens.shape[0], 32, generator=gen, dtype=torch.float64)
        tree = proposer.propose(hidden, tokens)
        index = NgramIndex(3)
        index.extend(tokens[:-1].tolist())
        root = tokens[-1]
        states = heads.head_states(hidden[-1], 3, root)  # (3, H)
        logits = heads.head_logits(hidden[-1], 3, root=root)  # (3, Vd)
        ids, parents = tree.tokens.tolist(), proposer.parents.tolist()
        for i in range(1, len(ids)):
            path, j = [], parents[i]
            while j >= 0:
                path.insert(0, ids[j])
                j = parents[j]
            c, m = index.lookup(path)
            d = len(path) - 1  # the head that drafts node i
            draft, lam = heads.copy.candidates(heads, states[d], torch.tensor(c), torch.tensor(m))
            order = mix_log_probs(logits[d], draft, lam).topk(4).indices
            want = heads.to_target_ids(order[int(proposer.rank[i])])
            assert ids[i] == int(want), (step, i)
        plain = heads.topk_tokens(hidden[-1], 4, 3, root=root)  # (3, 4)
        differs += ids[1:] != plain[proposer.head[1:12], proposer.rank[1:12]].tolist()
    assert differs >= 3  # the echoed prompts' candidates moved into the tree


@pytest.mark.parametrize("int8", [False, True])
def test_decoding_with_the_gate_is_lossless(int8):
    """Greedy output equals AR under caps of 2-12 nodes with prompts that repeat themselves (candidates found),
    a stop token, fp32 with int8 heads (drafted through the heads' C call where it runs) or fp64 without."""
    dtype = torch.float32 if int8 else torch.float64
    target = tiny_llama(dtype=dtype)
    proposer = make_proposer(_heads(target, scale=0.05), int8_head=int8, draft_block="auto")
    assert isinstance(proposer, MedusaProposer) and proposer._copy is not None
    if int8 and medusa_native.make_native(proposer.drafter) is not None:  # the heads' one C call, gate beside
        assert proposer._copy.native is not None and proposer._copy.host is not None
    dec = StaticDecoder(target, 96)
    gen = torch.Generator().manual_seed(7)
    accepted = 0
    for cap, stop in [(2, set()), (4, {7}), (12, set()), (6, set())]:
        head = torch.randint(5, 128, (5,), generator=gen)
        ref0, _ = ar_generate(target, None, head, 12, stop_ids=set())
        prompt = torch.cat([head, torch.tensor(ref0), head])  # the continuation is in the prompt
        ref, _ = ar_generate(target, None, prompt, 30, stop_ids=stop)
        out, stats = dec.speculative_generate(
            None, prompt, proposer, 30, stop_ids=stop, budget=NodeBudget.fixed(cap)
        )
        assert out == ref and max(stats.tree_sizes) <= cap
        accepted += sum(stats.accepted)
    assert accepted > 10  # the gate copied the echo


def test_sampling_with_the_gate_keeps_the_target_distribution(monkeypatch):
    """T > 0: the first two sampled tokens follow the target's own distribution (chi-square over 1,000 draws),
    with drafted tokens both kept and rejected (`testing.check_sampling_keeps_distribution`)."""
    from specdraft.testing import check_sampling_keeps_distribution, peaked_tiny_target

    target = peaked_tiny_target()

    def gated() -> MedusaProposer:
        proposer = make_proposer(_heads(target, scale=0.05).float(), int8_head=False)
        assert proposer._copy is not None
        proposer.fit_budget(3)
        return proposer

    check_sampling_keeps_distribution(target, gated, monkeypatch)


def test_the_loss_reads_each_slots_candidate_and_trains_the_gate(tmp_path):
    """Training: the collator adds the candidates of the family's declared order, the loss's logits are the
    mixtures of each slot's own candidate (brute force per position and head), the gate gets gradients, and an
    export keeps it (an export from before the field loads as plain heads)."""
    from specdraft.data.collate import Collator
    from specdraft.models.base_llm import forward_with_hidden
    from specdraft.models.registry import spec_of

    target = tiny_llama()
    heads = _heads(target, scale=0.05).float().train()
    assert spec_of(heads).copy_ngram_of(heads.config) == 3
    torch.manual_seed(0)
    seq = torch.randint(5, 40, (8,))
    ids = torch.cat([seq, seq, seq[:4]])  # (20,) it repeats itself: many candidates
    items = [{"input_ids": ids, "loss_mask": torch.tensor([0] * 4 + [1] * 16)}]
    batch = Collator(pad_id=0, draft_len=3, copy_ngram=3)(items)
    assert int((batch["copy_len"] > 0).sum()) > 10
    tout = forward_with_hidden(target, batch["input_ids"])
    loss, aux = medusa.compute_loss(heads, batch, tout, {"draft_len": 3, "loss": "ce"})
    sel = batch["pos_mask"].nonzero()
    b, t = sel[:, 0], sel[:, 1]
    hidden, root = tout.hidden[b, t], batch["root"][b, t]  # (N, H), (N,)
    states, logits = heads.head_states(hidden, 3, root), heads.head_logits(hidden, 3, root=root)
    draft, lam = heads.copy.candidates(heads, states, batch["copy_ids"][b, t], batch["copy_len"][b, t])
    want = mix_log_probs(logits, draft, lam)  # (N, 3, V)
    torch.testing.assert_close(torch.log_softmax(aux["logits"].float(), -1), want, rtol=1e-4, atol=1e-4)
    # the static tree is built from the same mixtures' rank accuracies (scripts/build_medusa_tree.py)
    acc, _ = measure_rank_accuracies(heads, target, [batch], topk=4)
    hits, valid = rank_hits(want, batch["targets"][b, t], 4)
    torch.testing.assert_close(acc, (hits / valid.clamp_min(1.0)[:, None]).double())
    plain, _ = measure_rank_accuracies(
        heads, target, [{k: v for k, v in batch.items() if "copy" not in k}], 4
    )
    assert acc[0, 0] > plain[0, 0]  # the echo's candidates are right: rank 0 of the mixture hits more
    loss.backward()
    assert (
        heads.copy.gate.length_bias.grad.abs().sum() > 0 and heads.copy.gate.out.weight.grad.abs().sum() > 0
    )
    heads.save_pretrained(tmp_path / "gate")
    again = medusa.Medusa.from_pretrained(tmp_path / "gate")
    assert again.config.copy_ngram == 3 and torch.equal(
        again.copy.gate.length_bias, heads.copy.gate.length_bias
    )
    old = medusa.Medusa.from_pretrained(saved_without(_heads(target, copy=0), tmp_path / "old", "copy_ngram"))
    assert old.copy is None and spec_of(old).copy_ngram_of(old.config) == 0


def test_the_host_gate_is_the_gates_arithmetic():
    """`HostGate` (numpy, beside the heads' C call) gives the torch gate's draft ids and copy weights: candidates
    inside and outside a reduced draft vocabulary, none, every match length; shared per heads and weights."""
    from specdraft.eval.medusa_copy_tree import host_gate

    target = tiny_llama()
    heads = _heads(target, vd=64).float()
    host = host_gate(heads)
    assert host_gate(heads) is host
    gen = torch.Generator().manual_seed(4)
    for _ in range(10):
        state = torch.randn(32, generator=gen) * 2.0
        cand = torch.randint(-1, 128, (9,), generator=gen)
        length = torch.randint(0, 4, (9,), generator=gen)
        draft, lam = host(state.numpy(), cand.tolist(), length.tolist())
        want_d, want_l = heads.copy.candidates(heads, state.expand(9, -1), cand, length)
        assert draft == want_d.tolist()
        torch.testing.assert_close(
            torch.tensor(lam, dtype=torch.float64), want_l.double(), rtol=1e-5, atol=1e-6
        )
    with torch.no_grad():
        heads.copy.gate.length_bias.add_(1.0)  # trained further: a new host copy
    assert host_gate(heads) is not host


def test_warm_start_from_root_heads_and_the_export_round_trip(tmp_path):
    """`train.init_from` root-token heads: every tensor copied, the gate at its start (lam = 1/2), the same
    logits; a gated export loads with the target's embeddings borrowed again (same mixtures), and refuses a warm
    start into heads without a gate (the tensor is named, not dropped)."""
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.models.hub import export_drafter, load_drafter, warm_start
    from specdraft.testing import tiny_tokenizer

    target = tiny_llama(dtype=torch.float64)
    fp = target_fingerprint(target, tiny_tokenizer())

    def build(copy: int) -> medusa.Medusa:  # root-token heads for this target's fingerprint
        schema = OmegaConf.create(
            {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
             "tree_choices": None, "draft_vocab_size": None, "root_token": True, "copy_ngram": copy}
        )  # fmt: skip
        return medusa.build(schema, target, fp).double()

    torch.manual_seed(3)
    root = jitter(build(0), 0.3).eval()
    export_drafter(root, tmp_path / "root")
    fresh = build(3)
    assert warm_start(fresh, str(tmp_path / "root"), fp) == len(root.state_dict())
    assert not fresh.copy.gate.out.weight.any() and not fresh.copy.gate.length_bias.any()
    h, r = torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 128, (4,))
    torch.testing.assert_close(
        fresh.eval().head_logits(h, root=r), root.head_logits(h, root=r), rtol=0, atol=0
    )
    gated = jitter(build(3), 0.3).eval()
    export_drafter(gated, tmp_path / "gated")
    loaded = load_drafter(str(tmp_path / "gated"), target=target).double().eval()
    zeros, cand, length = (
        torch.zeros(4, 3, dtype=torch.long),
        torch.randint(0, 128, (4, 3)),
        torch.randint(0, 4, (4, 3)),
    )
    want = gated(h, r, zeros, copy=(cand, length))
    torch.testing.assert_close(loaded(h, r, zeros, copy=(cand, length)), want)
    assert not torch.equal(want, gated(h, r, zeros))  # the candidates changed the logits
    with pytest.raises(ValueError, match=r"has tensor 'copy\.gate\.[a-z_.]+' that this drafter lacks"):
        warm_start(build(0), str(tmp_path / "gated"), fp)
