"""EAGLE-2 trees of several rows from one head pass per level (`eval/eagle_rows.py`): whatever subset of rows
drafts in a step, after refills (`reset`) and after a row drafted alone in between, every row gets exactly the
tree its own `propose` gives; long commits (prompts) go alone; the rows' positions live in one group buffer."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.eagle_rows import SOLO, RowGroup
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.testing import random_prompts, tiny_proposer_factory, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
CPU = torch.device("cpu")


def _same(a, b) -> bool:
    """Two trees with the same tokens, topology and scores."""
    ok = torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    return (
        ok
        and (a.scores is None) == (b.scores is None)
        and (a.scores is None or torch.allclose(a.scores, b.scores))
    )


@pytest.mark.parametrize("family", ["eagle", "eagle3", "eagle_copy", "eagle3_copy"])
def test_any_subset_of_rows_refills_and_solo_steps(family):
    """Four rows over eight steps; each step a different subset drafts together (the others ride along),
    row 2 starts a new request (reset + a prompt longer than `SOLO`) at step 3, and row 0 drafts alone at
    step 5 (it leaves the group with its positions, and the next call regroups): every tree equals the tree
    of a twin proposer fed the same inputs row by row."""
    model = tiny_target("llama", CPU)
    make = tiny_proposer_factory(family, model)
    rows, twins = [make() for _ in range(4)], [make() for _ in range(4)]
    assert all(isinstance(p, EagleTreeProposer) for p in rows)
    f = 32 * max(len(rows[0].spec.feature_layers), 1)
    g = torch.Generator().manual_seed(11)

    def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.randn(n, f, dtype=torch.float64, generator=g)
        return h, torch.tensor(random_prompts([n], seed=seed)[0])

    pending = {r: inputs(n, r) for r, n in enumerate([5, SOLO + 7, 3, 9])}  # the prompts
    plan = [[0, 1, 2, 3], [0, 2], [1, 3], [0, 1, 2, 3], [2, 3], [0], [0, 1, 3], [0, 1, 2, 3]]
    groups = set()
    for step, drafting in enumerate(plan):
        if step == 3:  # row 2: a new request
            rows[2].reset()
            twins[2].reset()
            pending[2] = inputs(SOLO + 3, 99)
        ins = [pending[r] for r in drafting]
        if step == 5:  # row 0 alone
            trees = [rows[0].propose(*ins[0])]
            assert rows[0].group is None
        else:
            trees = rows[drafting[0]].propose_rows(
                [rows[r] for r in drafting], [x[0] for x in ins], [x[1] for x in ins]
            )
            assert trees is not None
            groups.add(id(rows[drafting[0]].group))
        for r, t, (h, tok) in zip(drafting, trees, ins, strict=True):
            ref = twins[r].propose(h, tok)
            assert _same(t, ref), (family, step, r)
            assert rows[r].committed == twins[r].committed
            pending[r] = inputs(1 + step % 3, 10 * step + r)  # the positions committed after this step
    assert len(groups) == 2  # regrouped once, after row 0 drafted alone


def test_group_buffer_holds_each_rows_positions():
    """Grouping copies each row's committed positions into its slot; leaving copies them back out unchanged."""
    model = tiny_target("llama", CPU)
    make = tiny_proposer_factory("eagle", model)
    a, b = make(), make()
    g = torch.Generator().manual_seed(2)
    a.propose(torch.randn(6, 32, dtype=torch.float64, generator=g), torch.arange(6))
    b.propose(torch.randn(4, 32, dtype=torch.float64, generator=g), torch.arange(4))
    keys_a = a.cache.layers[0].keys[:, :, :6].clone()
    group = RowGroup([a, b])
    assert (a.group, a.slot, b.group, b.slot) == (group, 0, group, 1)
    assert group.cache.lengths == [6, 4]
    torch.testing.assert_close(group.cache.layer.keys[0:1, :, :6], keys_a, rtol=0, atol=0)
    group.leave(a)
    assert a.group is None and a.committed == 6 and not group.covers([a, b]) and group.covers([b])
    torch.testing.assert_close(a.cache.layers[0].keys[:, :, :6], keys_a, rtol=0, atol=0)


def test_rows_of_other_sizes_or_heads_are_declined():
    """Another tree size, another head or a fixed-shape (static) proposer: None, nothing changed."""
    model = tiny_target("llama", CPU)
    make = tiny_proposer_factory("eagle", model)
    p = make()
    h, t = [torch.randn(3, 32, dtype=torch.float64)] * 2, [torch.tensor([4, 5, 6])] * 2
    other = EagleTreeProposer(p.drafter, 5, p.depth, p.top_k)
    static = EagleTreeProposer(p.drafter, p.total_tokens, p.depth, p.top_k, static=True)
    fresh = tiny_proposer_factory("eagle", model)()
    for q in (other, static, fresh):
        assert p.propose_rows([p, q], h, t) is None
    assert p.group is None and p.committed == 0
