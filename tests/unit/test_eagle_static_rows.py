"""EAGLE-2's fixed-shape draft step for a whole batch (`eval/eagle_static_rows.py`): one step over every row's
slot of a shared head cache, the form one CUDA graph captures, equal to each row's own static `propose`."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.eagle_static import fixed_ancestors
from specdraft.eval.eagle_tree import select_nodes
from specdraft.testing import (
    HostReads,
    KernelCount,
    graph_rows_match_eager,
    tiny_proposer_factory,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spans(
    steps: int, rows: int, width: int, seed: int, device: torch.device, longest: int = 12
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per row: (hidden (n, width) fp64, tokens (n,)) of 1-`longest` newly committed positions (a
    first span of 20-40: a prompt)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        step = []
        for _ in range(rows):
            lo, hi = (20, 41) if s == 0 else (1, longest + 1)
            n = int(torch.randint(lo, hi, (1,), generator=g))
            hidden = torch.randn(n, width, generator=g, dtype=torch.float64).to(device)
            step.append((hidden, torch.randint(5, 128, (n,), generator=g).to(device)))
        out.append(step)
    return out


def _width(proposer) -> int:
    return 32 * max(len(proposer.target_layers), 1)


def _same(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.equal(a.ancestors, b.ancestors) and torch.equal(a.depth, b.depth)


@pytest.mark.parametrize(
    "family", ["eagle", "eagle3", "eagle_vocab", "eagle3_fused", "eagle_copy", "eagle3_copy"]
)
def test_rows_drafted_together_equal_each_row_alone(family):
    """Three rows, 24 steps, rows sitting out now and then, commits longer than the step's M rows (committed
    eagerly first), a row drafting alone in between, a row reset for a new request, and head buffers that grow
    past their first capacity: every tree of the batched step equals the row's own static `propose`, node
    for node, and every row's committed count follows."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory(family, model, static=True)
    together, alone = [factory() for _ in range(3)], [factory() for _ in range(3)]
    for p in together + alone:
        assert p.static and not p.graphs
        p.fixed.cache.reserve(0)
    first_cap = together[0].fixed.cache.capacity
    width = _width(together[0])
    for s, step in enumerate(_spans(24, 3, width, seed=0, device=torch.device("cpu"), longest=60)):
        if s == 12:  # row 1 starts a new request
            together[1].reset(), alone[1].reset()
            step[1] = (step[1][0].repeat(4, 1)[:30], step[1][1].repeat(4)[:30])
        rows = [r for r in range(3) if (s + r) % 5 != 4]  # each row idles every fifth step
        if s == 7:  # row 0 drafts alone (as when the others chain from the lookup branch)
            _same(together[0].propose(*step[0]), alone[0].propose(*step[0]))
            rows = [1, 2]
        trees = together[rows[0]].propose_rows(
            [together[r] for r in rows], [step[r][0] for r in rows], [step[r][1] for r in rows]
        )
        assert trees is not None and len(trees) == len(rows)
        for r, tree in zip(rows, trees, strict=True):
            _same(tree, alone[r].propose(*step[r]))
            assert int(tree.tokens[0]) == int(step[r][1][-1])
        assert [p.committed for p in together] == [p.committed for p in alone]
    state = together[0].static_rows
    assert state is not None and all(p.static_rows is state for p in together)  # one shared state
    assert state.cache.capacity > first_cap  # grown (and the members relinked) along the way


def test_short_first_commits_are_written_by_the_step_and_kept_by_a_row_alone():
    """Rows whose first commits fit the step's M rows have no head buffer of their own: the batched step
    allocates the shared one and writes their positions, and a row that then drafts alone reads them there."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory("eagle", model, static=True)
    together, alone = [factory() for _ in range(2)], [factory() for _ in range(2)]
    steps = _spans(4, 2, 32, seed=5, device=torch.device("cpu"), longest=3)[1:]  # 1-3 positions each
    trees = together[0].propose_rows(together, [h for h, _ in steps[0]], [t for _, t in steps[0]])
    assert trees is not None
    for r in range(2):
        _same(trees[r], alone[r].propose(*steps[0][r]))
    for step in steps[1:]:  # each row alone now
        for r in range(2):
            _same(together[r].propose(*step[r]), alone[r].propose(*step[r]))


def test_rows_of_other_heads_or_modes_are_not_drafted_together():
    """A row of another head, of the dynamic mode or of another tree size makes `propose_rows` decline."""
    model = tiny_target("llama")
    fixed = tiny_proposer_factory("eagle", model, static=True)
    other = tiny_proposer_factory("eagle3", model, static=True)()
    dynamic = tiny_proposer_factory("eagle", model)()
    a, b = fixed(), fixed()
    b.fit_budget(4)
    h, t = torch.randn(2, 32, dtype=torch.float64), torch.tensor([5, 6])
    assert a.propose_rows([a, other], [h, h], [t, t]) is None
    assert a.propose_rows([a, dynamic], [h, h], [t, t]) is None
    assert a.propose_rows([a, b], [h, h], [t, t]) is None
    assert a.static_rows is None


@pytest.mark.parametrize("family", ["eagle", "eagle3", "eagle3_copy"])
def test_batched_fixed_step_reads_nothing_on_the_host(family):
    """What the batch's CUDA graph captures, and the staging around it, reads nothing on the host and copies
    no Python number to the device (early stop off, as under graphs)."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory(family, model, static=True)
    rows = [factory() for _ in range(3)]
    for p in rows:
        p.early_stop = False
    steps = _spans(6, 3, _width(rows[0]), seed=1, device=torch.device("cpu"))
    rows[0].propose_rows(rows, [h for h, _ in steps[0]], [t for _, t in steps[0]])  # prompts: eager commits
    reads = HostReads()
    with reads:
        for step in steps[1:]:
            rows[0].propose_rows(rows, [h[-4:] for h, _ in step], [t[-4:] for _, t in step])
    assert reads.count == 0, dict(reads.sites)
    assert reads.scalar_writes == 0, dict(reads.write_sites)


def test_reranking_and_ancestors_over_rows_equal_each_row():
    """`select_nodes` and `fixed_ancestors` over a batch of pools / trees equal them row by row."""
    g = torch.Generator().manual_seed(0)
    k, levels = 3, 3
    pools = []
    for _ in range(4):
        par = [-1] * k
        score = (-torch.rand(k, generator=g)).tolist()
        depth = [1] * k
        for lev in range(1, levels):
            for c in range(k * k):
                parent = (lev - 1) * k * k + c // k if lev > 1 else c // k
                parent = min(parent, len(par) - 1)
                par.append(parent)
                score.append(score[parent] - float(torch.rand(1, generator=g)))
                depth.append(depth[parent] + 1)
        tok = torch.randint(0, 50, (len(par),), generator=g)
        pools.append((tok, torch.tensor(par), torch.tensor(score, dtype=torch.float64), torch.tensor(depth)))
    batched = select_nodes(*(torch.stack(x) for x in zip(*pools, strict=True)), 7)
    for i, pool in enumerate(pools):
        for a, b in zip(batched, select_nodes(*pool, 7), strict=True):
            assert torch.equal(a[i], b)
    parents = torch.cat([torch.full((4, 1), -1), batched[1]], dim=1)  # (4, 8)
    anc, depth = fixed_ancestors(parents, levels)
    for i in range(4):
        one = fixed_ancestors(parents[i], levels)
        assert torch.equal(anc[i], one[0]) and torch.equal(depth[i], one[1])


def test_kernel_launches_of_batched_rows():
    """Drafting 4 rows together launches about what one row does, where row by row it was 4x."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory("eagle", model, static=True)
    launches = []
    for r in (1, 4):
        rows = [factory() for _ in range(r)]
        for p in rows:
            p.early_stop = False
        step = _spans(2, r, 32, seed=3, device=torch.device("cpu"))
        rows[0].propose_rows(rows, [h for h, _ in step[0]], [t for _, t in step[0]])
        with KernelCount() as k:
            rows[0].propose_rows(rows, [h[-3:] for h, _ in step[1]], [t[-3:] for _, t in step[1]])
        launches.append(k.count)
    assert launches[1] < 1.25 * launches[0], launches


@CUDA
@pytest.mark.parametrize("family", ["eagle", "eagle3", "eagle3_copy"])
def test_batched_draft_graph_equals_the_eager_rows(family):
    """On CUDA the batched step is one graph per tree size: the trees equal the eager batched step's."""
    dev = torch.device("cuda")
    model = tiny_target("llama", dev)
    width = 32 * (3 if family.startswith("eagle3") else 1)
    steps = _spans(8, 3, width, seed=2, device=dev)
    graph_rows = graph_rows_match_eager(family, model, steps, _same, eager_early_stop=False)
    state = graph_rows[0].static_rows
    assert state is not None and len(state.graphs) >= 1
    assert all(g is not None for g in state.graphs.values())
