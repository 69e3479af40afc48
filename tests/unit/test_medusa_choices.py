"""Medusa's training-time tree estimate (`models/medusa_choices.py`, `eval/tree_accept_len`): label ranks, the
static tree's greedy acceptance against the decoder's own proposer + `greedy_accepted`, and the metric in
`train.evaluate.evaluate`. All on CPU, fp64 tiny models."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from specdraft.eval.medusa_tree import MedusaProposer
from specdraft.models.base_llm import TargetOutput
from specdraft.models.layers import scatter_to_vocab
from specdraft.models.medusa import FAMILY, Medusa, build
from specdraft.models.medusa_choices import (
    IGNORE_INDEX,
    label_ranks,
    resolve_paths,
    teacher_forced_tree_accept,
    tree_accepted,
)
from specdraft.models.redrafter import FAMILY as REDRAFTER
from specdraft.testing import tiny_llama
from specdraft.train.evaluate import evaluate, greedy_accepted, replay_decode, walk

H, V, VD, K = 32, 128, 40, 3
FP = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "abc"}


def medusa(draft_vocab_size: int | None, root_token: bool, tree: list | None = None) -> Medusa:
    """A 3-head fp64 Medusa with non-trivial weights (top-4 candidates per head)."""
    schema = OmegaConf.create(
        {
            "draft_len": K,
            "num_layers": 1,
            "loss_decay": 0.8,
            "init_from_lm_head": True,
            "topk": 4,
            "tree_choices": tree,
            "draft_vocab_size": draft_vocab_size,
            "root_token": root_token,
        }
    )
    counts = torch.randperm(V, generator=torch.Generator().manual_seed(0)).float()
    target = tiny_llama(dtype=torch.float64)
    model = build(schema, target, FP, token_counts=counts).double().eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def head_logits_in_target_ids(model: Medusa, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """(N, K, V) as evaluation hands them over: draft-vocabulary logits spread to target ids (-inf elsewhere)."""
    logits = model.head_logits(hidden, root=root)  # (N, K, Vd)
    return scatter_to_vocab(logits, model.draft_ids(), V) if model.reduced_vocab else logits


def labels_at_ranks(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """(N, K) labels: per slot the token at a random rank in {0, 0, 0, 1, 2, 3, 5} or a token outside the top
    (all ranks of a head are distinct tokens), then an ignored suffix for a quarter of the rows."""
    n = logits.shape[0]
    order = logits.argsort(-1, descending=True)  # (N, K, V)
    choice = torch.tensor([0, 0, 0, 1, 2, 3, 5, 60])[torch.randint(0, 8, (n, K), generator=gen)]  # (N, K)
    labels = order.gather(-1, choice[..., None])[..., 0]  # (N, K)
    cut = torch.randint(1, K + 1, (n,), generator=gen)  # rows keep slots [0, cut)
    short = torch.rand(n, generator=gen) < 0.25
    ignored = short[:, None] & (torch.arange(K)[None] >= cut[:, None])
    return labels.masked_fill(ignored, IGNORE_INDEX)


def test_label_ranks_golden() -> None:
    logits = torch.tensor([[[0.1, 3.0, 2.0, -1.0]], [[5.0, float("-inf"), 1.0, 1.0]], [[0.0, 1.0, 2.0, 3.0]]])
    targets = torch.tensor(
        [[2], [1], [IGNORE_INDEX]]
    )  # rank 1; scored -inf (outside the draft vocab); ignored
    assert label_ranks(logits, targets).tolist() == [[1], [4], [4]]
    assert label_ranks(logits, torch.tensor([[1], [0], [0]]), chunk=1).tolist() == [[0], [0], [3]]


def test_tree_accepted_golden() -> None:
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    ranks = torch.tensor([[0, 0, 0], [0, 1, 0], [1, 0, 7], [1, 1, 0], [2, 0, 0], [0, 2, 0], [0, 0, 1]])
    assert tree_accepted(ranks, paths).tolist() == [3, 2, 2, 1, 0, 1, 2]


@pytest.mark.parametrize(
    "vocab, root, tree",
    [
        (None, False, None),  # the default tree pruned to 3 heads x top-4
        (VD, False, None),  # reduced draft vocabulary: labels outside it are never drafted
        (VD, True, None),  # heads that read the root token
        (None, False, [[1], [0], [1, 2], [0, 0], [0, 0, 3], [2]]),  # the export's own tree, out of order
    ],
)
def test_tree_accept_equals_the_decoders_proposer(vocab, root, tree) -> None:
    """Per position: the accepted drafts the proposer's own tree gets from greedy verification against the
    labels (`greedy_accepted`) equal the rank-based count from the teacher-forced logits."""
    model = medusa(vocab, root, tree)
    gen = torch.Generator().manual_seed(1)
    n = 200
    hidden = torch.randn(n, H, dtype=torch.float64, generator=gen)
    root_ids = torch.randint(0, V, (n,), generator=gen)
    logits = head_logits_in_target_ids(model, hidden, root_ids)  # (N, K, V)
    labels = labels_at_ranks(logits, gen)
    got = teacher_forced_tree_accept(model, logits, labels)  # (N,)
    proposer = MedusaProposer(model)
    want = []
    for i in range(n):
        draft = proposer.propose(hidden[i : i + 1], root_ids[i : i + 1])
        truth = labels[i][labels[i] != IGNORE_INDEX]  # the row's labels up to its end
        want.append(greedy_accepted(draft, truth))
    assert got.tolist() == want
    assert len(set(want)) >= 3 and max(want) >= 2  # the case exercises deep paths, misses and partial ones


def test_resolve_paths_is_the_proposers_tree() -> None:
    model = medusa(None, False)
    assert MedusaProposer(model).paths == resolve_paths(None, K, 4)
    assert MedusaProposer(model, max_nodes=6).paths == resolve_paths(None, K, 4, 6)
    assert len(resolve_paths([[1], [0], [1, 2]], K, 4, max_nodes=3)) == 2


def test_evaluate_reports_the_served_tree_for_medusa_only() -> None:
    """`eval/tree_accept_len` for Medusa, equal to the mean of the per-position counts + 1; a tree that is one
    chain of top-1 tokens gives exactly `eval/chain_accept_len`; ReDrafter declares no tree estimate."""
    assert FAMILY.tree_accept is teacher_forced_tree_accept and REDRAFTER.tree_accept is None
    gen = torch.Generator().manual_seed(2)
    B, L = 3, 12
    hidden = torch.randn(B, L, H, dtype=torch.float64, generator=gen)
    ids = torch.randint(0, V, (B, L), generator=gen)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(B, L, dtype=torch.long),
        "root": ids,
        "targets": torch.stack([ids.roll(-k - 1, 1) for k in range(K)], -1),  # (B, L, K)
        "pos_mask": torch.ones(B, L, dtype=torch.bool),
    }
    batch["targets"][:, -K:] = IGNORE_INDEX  # the rows end: later slots do not train

    def features(b, need_logits=False):
        return TargetOutput(hidden.new_empty(0), hidden, None, None)

    opts = {"loss": "ce", "draft_len": K, "max_positions": None}
    for tree, same_as_chain in ((None, False), ([[0], [0, 0], [0, 0, 0]], True)):
        model = medusa(None, False, tree)
        # labels at the heads' top tokens half of the time, so every estimate is above 1
        top = head_logits_in_target_ids(model, hidden.flatten(0, 1), ids.flatten()).argmax(-1)  # (B*L, K)
        take = torch.rand(B * L, K, generator=gen) < 0.6
        mixed = torch.where(take, top, batch["targets"].flatten(0, 1)).view(B, L, K)
        b = {**batch, "targets": mixed.masked_fill(batch["targets"] == IGNORE_INDEX, IGNORE_INDEX)}
        out = evaluate(model, FAMILY, features, [b], opts, torch.ones(V))
        _, aux = FAMILY.compute_loss(model, b, features(b), {**opts, "generator": gen})
        counts = teacher_forced_tree_accept(model, aux["logits"], aux["targets"])
        first = aux["targets"][:, 0] != IGNORE_INDEX
        assert out["eval/tree_accept_len"] == pytest.approx(1.0 + counts[first].double().mean().item())
        assert out["eval/tree_accept_len"] > 1.2
        if same_as_chain:
            assert out["eval/tree_accept_len"] == pytest.approx(out["eval/chain_accept_len"])
        else:  # the default tree holds the chain and more
            assert out["eval/tree_accept_len"] > out["eval/chain_accept_len"]


def test_walk_golden() -> None:
    assert walk(list(range(10)), [2, 0, 1, 0, 3, 0, 0, 0, 0, 0]) == (10, 5)  # steps at 0, 3, 4, 8, 9
    assert walk([0, 1, 2, 10, 11], [1, 0, 0, 0, 0]) == (5, 4)  # 0 -> 2, then a gap: 10, 11
    assert walk([], []) == (0, 0)


def test_the_walk_is_the_decoders_replay() -> None:
    """`eval/tree_walk_len` of one row (every position's tree count, walked as the decoder steps) equals the
    tokens/step of `replay_decode` with Medusa's own proposer on that row: the same steps, the same drafts."""
    model = medusa(None, True)
    gen = torch.Generator().manual_seed(3)
    L, start = 60, 8
    hidden = torch.randn(L, H, dtype=torch.float64, generator=gen)  # the target's states, one per position
    ids = torch.randint(0, V, (L,), generator=gen)
    t = start - 1
    with torch.no_grad():  # x_{t+2} (and x_{t+3}) often heads 0 (and 1)'s top tokens at t: accepted drafts
        while t < L - 3:
            top = model.head_logits(hidden[t : t + 1], root=ids[t + 1 : t + 2])[0].argmax(-1)  # (K,)
            u = torch.rand(1, generator=gen).item()
            n = 2 if u < 0.35 else 1 if u < 0.7 else 0
            ids[t + 2 : t + 2 + n] = top[:n]
            t += max(n, 1)
    steps = replay_decode(MedusaProposer(model), hidden, ids, start, 10_000)
    served = 1.0 + sum(steps) / len(steps)
    t = torch.arange(L)
    targets = torch.stack([ids.roll(-k - 2) for k in range(K)], -1)  # (L, K): x_{t+2+k}
    targets[(t[:, None] + 2 + torch.arange(K)[None]) > L - 2] = IGNORE_INDEX  # x_{L-1} is only ever a bonus
    batch = {
        "input_ids": ids[None],
        "attention_mask": torch.ones(1, L, dtype=torch.long),
        "root": ids.roll(-1)[None],  # x_{t+1}
        "targets": targets[None],
        "pos_mask": ((t >= start - 1) & (t <= L - 3))[None],
    }
    out = evaluate(
        model,
        FAMILY,
        lambda b, need_logits=False: TargetOutput(hidden.new_empty(0), hidden[None], None, None),
        [batch],
        {
            "loss": "ce",
            "draft_len": K,
            "max_positions": 16,
        },  # the per-position metrics sample; the walk does not
        torch.ones(V),
    )
    assert max(steps) >= 2 and min(steps) == 0
    assert out["eval/tree_walk_len"] == pytest.approx(served, abs=1e-12)
    assert out["eval/tree_accept_len"] != pytest.approx(served)  # the per-position average is another number
