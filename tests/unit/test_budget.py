"""The fitted node budget (eval/budget.py): cost curve caching and interpolation, the gain curve read from
one verify (against truncated trees verified one by one), the cap chosen, and lossless decoding under it."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.budget import CostCurve, NodeBudget, machine_key
from specdraft.eval.decode import ar_generate
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree
from specdraft.eval.verify import greedy_verify, greedy_verify_packed
from specdraft.testing import OracleBeamProposer, tiny_llama


def test_gain_curve_equals_verifying_each_truncated_tree():
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        n = int(torch.randint(1, 14, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tree = DraftTree(torch.randint(0, 3, (n,), generator=g), parents)
        logits = torch.randn(n, 3, generator=g)
        packed = greedy_verify_packed(
            tree.tokens, tree.parents, tree.ancestors, tree.depth, logits, prefix_accept=True
        )
        gains = packed[2 + 2 * n :].tolist()
        expect = [greedy_verify(tree.truncated(k), logits[:k])[0].shape[0] for k in range(1, n + 1)]
        assert gains == expect


def test_cost_curve_interpolates_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {1: 10.0, 4: 16.0, 16: 40.0}

    curve = CostCurve.load_or_measure("k1", measure, log=lambda m: None)
    assert curve(1) == 10.0 and curve(2) == 12.0 and curve(10) == 28.0 and curve(28) == 64.0
    again = CostCurve.load_or_measure("k1", measure, log=lambda m: None)
    assert again.ms == curve.ms and len(calls) == 1  # read from the cache
    (tmp_path / "cost_curves" / "k1.json").write_text("{not json")
    msgs = []
    CostCurve.load_or_measure("k1", measure, log=msgs.append)
    assert len(calls) == 2 and "unreadable" in msgs[0]


def test_cap_follows_the_machine():
    gains = [[1, 2, 2, 3, 3, 3, 3, 4]] * 10  # accepted tokens with the first b nodes
    flat = NodeBudget(CostCurve({1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}), fit_steps=10, sizes=(1, 2, 4, 8))
    steep = NodeBudget(CostCurve({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}), fit_steps=10, sizes=(1, 2, 4, 8))
    mid = NodeBudget(CostCurve({1: 10.0, 2: 11.0, 4: 20.0, 8: 30.0}), fit_steps=10, sizes=(1, 2, 4, 8))
    for b in (flat, steep, mid):
        for g in gains:
            b.observe(g, 0.001)  # 1 ms of drafting per step
    assert flat.cap == 8  # a flat cost: the biggest tree
    assert steep.cap == 1  # every node costs a full step: drafting never pays
    assert mid.cap == 2  # 2 tok / 12 ms beats 3 tok / 21 ms, 4 tok / 31 ms and 1 tok / 10 ms
    before = list(mid.gains)
    mid.observe([1, 1], 0.0)  # fitted: further steps are not recorded
    assert mid.gains == before


def test_machine_key_changes_with_path_and_dtype():
    model = tiny_llama(num_layers=1)
    assert machine_key(model, "eager") != machine_key(model, "fixed")
    assert machine_key(model, "eager") != machine_key(model.double(), "eager")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("cap_costs", [{1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, {1: 1.0, 2: 9.0, 4: 9.0, 8: 9.0}])
def test_lossless_while_fitting_and_after(static, cap_costs):
    """Full trees while fitting, cut trees (or no drafting at all) after: the output never changes."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    dec = StaticDecoder(model, 64, static=static)
    budget = NodeBudget(CostCurve(cap_costs), fit_steps=4, sizes=(1, 2, 4, 8))
    for prompt_len in (3, 11, 7):
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 30, stop_ids=set())
        proposer = OracleBeamProposer(ref, prompt_len, vocab=128)
        out, stats = dec.speculative_generate(None, prompt, proposer, 30, stop_ids=set(), budget=budget)
        assert out == ref
    assert budget.cap == (8 if cap_costs[2] == 1.0 else 1)
    if budget.cap == 1:  # no drafting: every step a plain target step
        assert stats.tree_sizes == [1] * stats.steps


def test_measured_costs_cover_every_size():
    model = tiny_llama(num_layers=1)
    for static in (False, True):
        ms = StaticDecoder(model, 64, static=static).measure_costs(sizes=(1, 4, 16), prefix=8, reps=1)
        assert sorted(ms) == [1, 4, 16] and all(v > 0 for v in ms.values())
