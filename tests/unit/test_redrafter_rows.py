"""The ReDrafter's fixed-shape draft step for a whole batch (`eval/redrafter_rows.py`): one beam search over
every drafting row, the form one CUDA graph captures, equal to each row's own static `propose`."""

from __future__ import annotations

import pytest
import torch

from specdraft import testing
from specdraft.eval.redrafter_rows import padded_rows
from specdraft.models.copy_lookup import lookup_fixed_rows
from specdraft.testing import HostReads, KernelCount, tiny_proposer_factory, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spans(
    steps: int, rows: int, seed: int, device: torch.device
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per row: (hidden (n, 32) fp64, tokens (n,)) of 1-50 newly committed positions, tokens from 6
    ids so the copy gate's n-grams recur (and the committed buffers grow past 256 tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(rows):
            n = int(torch.randint(1, 51, (1,), generator=g))
            hidden = torch.randn(n, 32, generator=g, dtype=torch.float64).to(device)
            step.append((hidden, torch.randint(5, 11, (n,), generator=g).to(device)))
        out.append(step)
    return out


def _same(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.equal(a.ancestors, b.ancestors) and torch.equal(a.depth, b.depth)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family", ["redrafter", "redrafter_copy"])
def test_rows_drafted_together_equal_each_row_alone(family):
    """Three rows, 16 steps, a row sitting out now and then (finished or refilled rows): every tree of the
    batched search equals the row's own static `propose`, node for node; the copy-gate buffers grow (past
    256 tokens) and stay one capacity for all rows."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory(family, model, static=True)
    together, alone = [factory() for _ in range(3)], [factory() for _ in range(3)]
    assert all(p.static and not p.graphs for p in together + alone)
    for s, step in enumerate(_spans(16, 3, seed=0, device=torch.device("cpu"))):
        rows = [r for r in range(3) if (s + r) % 4 != 3]  # each row idles every fourth step
        trees = together[rows[0]].propose_rows(
            [together[r] for r in rows], [step[r][0] for r in rows], [step[r][1] for r in rows]
        )
        assert trees is not None and len(trees) == len(rows)
        for r, tree in zip(rows, trees, strict=True):
            _same(tree, alone[r].propose(*step[r]))
            assert together[r].last_compression == 1.0 and int(tree.tokens[0]) == int(step[r][1][-1])
    if family == "redrafter_copy":
        caps = {p.copy_ctx.buf.shape[0] for p in together}
        assert len(caps) == 1 and caps.pop() > 256
        assert [p.copy_ctx.n for p in together] == [p.copy_ctx.n for p in alone]
    state = together[0]._rows_state
    assert state is not None and all(p._rows_state is state for p in together)  # one shared state


def test_rows_of_other_searches_are_not_drafted_together():
    """A row of another drafter (or the dynamic step) makes `propose_rows` decline: nothing changes."""
    model = tiny_target("llama")
    fixed = tiny_proposer_factory("redrafter", model, static=True)
    other = tiny_proposer_factory("redrafter", model, static=True)()  # another drafter object
    dynamic = tiny_proposer_factory("redrafter", model)()
    a = fixed()
    h, t = torch.randn(2, 32, dtype=torch.float64), torch.tensor([5, 6])
    assert a.propose_rows([a, other], [h, h], [t, t]) is None
    assert a.propose_rows([a, dynamic], [h, h], [t, t]) is None
    assert a._rows_state is None


@pytest.mark.parametrize("family", ["redrafter", "redrafter_copy"])
def test_batched_fixed_step_reads_nothing_on_the_host(family):
    """What the batch's CUDA graph captures, and the stacking around it, reads nothing on the host and copies
    no Python number to the device."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory(family, model, static=True)
    rows = [factory() for _ in range(3)]
    reads, steps = HostReads(), _spans(5, 3, seed=1, device=torch.device("cpu"))
    with reads:
        for step in steps:
            rows[0].propose_rows(rows, [h for h, _ in step], [t for _, t in step])
    assert reads.count == 0, dict(reads.sites)
    assert reads.scalar_writes == 0, dict(reads.write_sites)


def test_padded_rows_and_the_row_lookup():
    """Under graphs the row count rounds up to a power of two (at most log2(B) + 1 captures for a batch of B);
    `lookup_fixed_rows` of several rows is each row's own lookup."""
    assert [padded_rows(r, True) for r in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert [padded_rows(r, False) for r in (1, 3, 5)] == [1, 3, 5]
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 4, (3, 12), generator=g)
    length = torch.tensor([0, 7, 12])
    chains = torch.randint(0, 4, (3, 5, 3), generator=g)
    cand, size = lookup_fixed_rows(ctx, length, chains, 3)
    for s in range(3):
        one = lookup_fixed_rows(ctx[s : s + 1], length[s : s + 1], chains[s : s + 1], 3)
        assert torch.equal(cand[s], one[0][0]) and torch.equal(size[s], one[1][0])
    assert bool((size > 0).any())


@CUDA
@pytest.mark.parametrize("family", ["redrafter", "redrafter_copy"])
def test_batched_draft_graph_equals_the_eager_rows(family):
    """On CUDA the batched step is one graph per padded row count: the trees equal the eager batched step's."""
    dev = torch.device("cuda")
    model = tiny_target("llama", dev)
    graph_rows = testing.graph_rows_match_eager(family, model, _spans(8, 3, seed=2, device=dev), _same)
    state = graph_rows[0]._rows_state
    assert state is not None and all(g is not None for g in state.graphs.values())
    assert {key[0] for key in state.graphs} <= {2, 4}


def test_kernel_launches_of_the_lookup_and_of_batched_rows():
    """What a GPU's draft graph pays per launch: the copy gate's lookup launches as many kernels for 6-grams as
    for 1-grams (every length in one pass), and drafting 4 rows together launches about what one row does
    (each row's buffer commit aside), where row by row it was 4x."""
    g = torch.Generator().manual_seed(0)
    ctx, length = torch.randint(0, 4, (2, 40), generator=g), torch.tensor([30, 12])
    chains = torch.randint(0, 4, (2, 8, 3), generator=g)
    counts = []
    for n in (1, 6):
        lookup_fixed_rows(ctx, length, chains, n)  # shape-only index tensors made on first use
        with KernelCount() as k:
            lookup_fixed_rows(ctx, length, chains, n)
        counts.append(k.count)
    assert counts[0] == counts[1] < 40
    model = tiny_target("llama")
    factory = tiny_proposer_factory("redrafter_copy", model, static=True)
    launches = []
    for r in (1, 4):
        rows, step = [factory() for _ in range(r)], _spans(2, r, seed=3, device=torch.device("cpu"))
        rows[0].propose_rows(rows, [h for h, _ in step[0]], [t for _, t in step[0]])
        with KernelCount() as k:
            rows[0].propose_rows(rows, [h for h, _ in step[1]], [t for _, t in step[1]])
        launches.append(k.count)
    assert launches[1] < 1.25 * launches[0], launches
