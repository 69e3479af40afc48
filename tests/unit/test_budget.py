"""The fitted node budget (eval/budget.py): cost curve caching and interpolation, the gain curve read from
one verify (against truncated trees verified one by one), the cap chosen, and lossless decoding under it."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from specdraft.eval.budget import FULL, CostCurve, NodeBudget, machine_key, marginal_min_prob, typical_ms
from specdraft.eval.decode import ar_generate
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree, ProposerSpec
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
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cost_curves"))
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


def test_a_cached_curve_is_measured_again_when_the_machine_moved(tmp_path, monkeypatch):
    """`recheck` times a few verify sizes now: within `tolerance` of the cached cost(1) the cached curve stands
    (no full measurement), scaled to the speed now (the draft times a fit adds to it are measured now), and
    the file keeps the measured curve; farther away (a VM 33% slower or faster than when it cached) it is
    measured again, reported in one line, and the new curve is cached."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cost_curves"))
    calls: list[int] = []

    def measure() -> dict[int, float]:
        calls.append(1)
        return {1: 10.0 * len(calls), 4: 16.0 * len(calls)}

    def at(ms1: float) -> Callable[[], dict[int, float]]:
        return lambda: {1: ms1}

    CostCurve.load_or_measure("k2", measure, log=lambda m: None)
    same = CostCurve.load_or_measure("k2", measure, log=lambda m: None, recheck=at(12.0))  # +20%
    assert len(calls) == 1 and same(1) == pytest.approx(12.0) and same(4) == pytest.approx(19.2)
    kept = CostCurve.load_or_measure("k2", measure, log=lambda m: None)  # no recheck: the file, unscaled
    assert kept.ms == {1: 10.0, 4: 16.0}
    msgs: list[str] = []
    moved = CostCurve.load_or_measure("k2", measure, log=msgs.append, recheck=at(13.5))  # +35%
    assert len(calls) == 2 and moved(1) == 20.0 and moved(4) == 32.0
    assert "13.5 ms now against 10.0 ms" in msgs[0] and "measuring it again" in msgs[0]
    again = CostCurve.load_or_measure("k2", measure, log=lambda m: None, recheck=at(20.0))
    assert len(calls) == 2 and again.ms == moved.ms  # the new curve was cached
    fast = CostCurve.load_or_measure("k2", measure, log=lambda m: None, recheck=at(14.0))  # -30%
    assert len(calls) == 3 and fast(1) == 30.0


def test_a_cached_curve_whose_shape_moved_is_measured_again(tmp_path, monkeypatch):
    """cost(1) alone does not vouch for a cached curve: the Zen 4 of session 64 measured a q8 target's 8-node
    verify at 1.69x its one-node verify where the curve cached a session earlier said 2.49x, at the same cost(1).
    A rechecked size whose cost(n) / cost(1) is more than `shape_tolerance` away from the cached ratio makes the
    curve measured again (one log line naming the size); within it the cached curve stands, scaled."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cost_curves"))
    curves = [{1: 5.0, 4: 7.9, 8: 12.45}, {1: 5.0, 4: 6.1, 8: 8.45}]

    def measure() -> dict[int, float]:
        return curves.pop(0)

    CostCurve.load_or_measure("k3", measure, log=lambda m: None)
    near = CostCurve.load_or_measure(
        "k3", measure, log=lambda m: None, recheck=lambda: {1: 5.2, 4: 7.5, 8: 12.0}
    )
    assert len(curves) == 1 and near(8) == pytest.approx(12.45 * 5.2 / 5.0)  # 2.31x against 2.49x: kept
    msgs: list[str] = []
    flat = CostCurve.load_or_measure(
        "k3", measure, log=msgs.append, recheck=lambda: {1: 5.07, 4: 6.2, 8: 8.55}
    )
    assert not curves and flat.ms == {1: 5.0, 4: 6.1, 8: 8.45}  # measured again, and cached
    assert "4-node verify costs 1.22 one-node verifies now against 1.58" in msgs[0]
    assert CostCurve.load_or_measure("k3", measure, log=lambda m: None).ms == flat.ms


def _budget(costs: dict[int, float], **kw) -> NodeBudget:
    kw.setdefault("fit_steps", 10)
    return NodeBudget(CostCurve(costs), sizes=(1, 2, 4, 8), **kw)


def test_cap_follows_the_machine():
    gains = [1, 2, 2, 3, 3, 3, 3, 4]  # accepted tokens with the first b nodes, every step
    flat = _budget({1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}, check_steps=0)
    steep = _budget({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}, check_steps=0)
    mid = _budget({1: 10.0, 2: 11.0, 4: 20.0, 8: 30.0}, check_steps=0)
    for b in (flat, steep, mid):
        for _ in range(10):
            b.observe(0.001, 4, gains)  # 1 ms of drafting per step
    assert flat.cap == 8 and flat.settled  # a flat cost: the biggest tree
    assert steep.cap == 1  # every node costs a full step: drafting never pays
    assert mid.cap == 2  # 2 tok / 12 ms beats 3 tok / 21 ms, 4 tok / 31 ms and 1 tok / 10 ms
    before = list(mid.gains)
    mid.observe(0.0, 1, [1, 1])  # settled: further steps are not recorded
    assert mid.gains == before


def test_a_gain_within_the_noise_of_the_fit_does_not_draft():
    """A 2-node tree that gives 1 or 2 tokens (6 of 16 steps: mean 1.375) against a verify of 1.3 one-token steps
    beats plain steps on the mean but not by one standard error of it (0.125): no drafting; 12 of 16 (mean 1.75)
    wins either way. `confidence=0` rates the mean alone, and its rates equal the formula."""
    cost = {1: 10.0, 2: 13.0, 4: 40.0, 8: 80.0}
    for twos, z, cap in ((6, 1.0, 1), (6, 0.0, 2), (12, 1.0, 2), (12, 0.0, 2)):
        b = _budget(cost, check_steps=0, confidence=z, fit_steps=16)
        for i in range(16):
            b.observe(0.0, 1, [1, 2 if i < twos else 1])
        assert b.settled and b.cap == cap, (twos, z)
    b = _budget(cost, check_steps=0)
    b.gains, b.draft_ms = [[1, 2]] * 6 + [[1, 1]] * 10, [0.0] * 16
    mean = 22 / 16
    se = ((6 * (2 - mean) ** 2 + 10 * (1 - mean) ** 2) / 15 / 16) ** 0.5
    assert b.rates([0.0], confidence=1.0)[2] == pytest.approx((mean - se) / 13.0)
    assert b.rates([0.0])[2] == pytest.approx(mean / 13.0)


def test_typical_draft_time_drops_the_slowest_eighth():
    assert typical_ms([5.0]) == 5.0
    assert typical_ms([3.0, 300.0]) == 3.0  # one sample of two dropped
    assert typical_ms([1.0] * 7 + [500.0]) == 1.0  # a CUDA graph capture (once) does not price the size
    assert typical_ms([float(i) for i in range(1, 17)]) == sum(range(1, 15)) / 14  # 16 samples: slowest 2 out
    assert typical_ms([1.0] * 7 + [9.0], trim=False) == 2.0  # no captures (a CPU): the plain mean


def test_without_captures_a_hybrids_slow_steps_are_priced() -> None:
    """A proposer with two kinds of steps (lookup's chain alone: 0.1 ms; the drafter's search: 6 ms, one step in
    eight) is priced at its mean draft time where nothing is captured; the trimmed mean would drop every
    search and rate its trees as if drafting were nearly free."""
    cost = CostCurve({1: 5.0, 2: 6.0, 4: 7.5, 8: 11.0, 16: 19.0, 32: 35.0, 64: 66.0, 128: 130.0})
    draft = [6.0 if i % 8 == 0 else 0.1 for i in range(48)]
    gains = [[1, 2, 2, 3, 3, 3, 3, 3]] * 48
    rated = {}
    for trim in (True, False):
        b = NodeBudget(cost, trim_slowest=trim)
        b.gains, b.draft_ms = [list(g) for g in gains], list(draft)
        rated[trim] = b.rates(b.draft_ms)
    assert rated[True][4] == pytest.approx(3 / (7.5 + 0.1))  # the searches trimmed away
    assert rated[False][4] == pytest.approx(3 / (7.5 + sum(draft) / 48))
    assert all(rated[False][k] < rated[True][k] for k in rated[True] if k > 1)


def test_a_capture_step_does_not_turn_drafting_off():
    """The first step at a new size captures a CUDA graph (here 400 ms once); the cap is decided on the steps
    that replay it (1 ms), in phase 1 and in phase 2."""
    gains = [1, 2, 2, 3, 3, 3, 3, 4]
    b = _budget({1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}, check_steps=4)
    for i in range(10):
        b.observe(0.4 if i == 0 else 0.001, 4, gains)
    assert b.cap == 8 and not b.settled
    for i in range(4):
        b.observe(0.4 if i == 0 else 0.001, 4)
    assert b.settled and b.cap == 8


def test_off_is_decided_with_the_draft_time_at_the_cap():
    """Phase 1 picks the best drafting cap even when full-size drafting loses; phase 2 re-times it there."""
    gains = [1, 2, 2, 2, 2, 2, 2, 2]
    costs = {1: 10.0, 2: 10.0, 4: 20.0, 8: 40.0}
    cheap, dear = _budget(costs, check_steps=4), _budget(costs, check_steps=4)
    for b in (cheap, dear):
        for _ in range(10):
            b.observe(0.012, 2, gains)  # 12 ms of full-size drafting: 2 tok / 22 ms < 1 tok / 10 ms
        assert b.cap == 2 and not b.settled  # provisional
    for _ in range(4):
        cheap.observe(0.001, 2)  # a 2-node draft takes 1 ms: 2 tok / 11 ms
        dear.observe(0.012, 1)  # still slow, and nothing accepted: off
    assert cheap.settled and cheap.cap == 2
    assert dear.settled and dear.cap == 1


def test_phase_two_prices_a_checked_cap_with_the_loops_verify():
    """The curve says 4 nodes cost 1.2 one-node verifies (10 -> 12 ms) and 2 nodes 1.05; in the decode loop the
    4-node verify takes 17 ms (a VM whose multi-row speed moved since the curve, session 64). Priced on the
    curve, 4 nodes keep 3 tok / 13 ms over 2 nodes' 2 tok / 11 ms; priced with the loop's 17 ms, 3 / 18 loses to
    2 nodes, which are checked next and kept (their loop verify, 10.5 ms, as the curve says). Without
    `verify_s` reported, or with `loop_verify=False`, the curve decides as before."""
    gains = [1, 2, 3, 3]
    curve = {1: 10.0, 2: 10.5, 4: 12.0}

    def fit(report: bool, **kw) -> NodeBudget:
        b = NodeBudget(CostCurve(curve), fit_steps=8, check_steps=3, sizes=(1, 2, 4), confidence=0.0, **kw)
        for _ in range(8):
            b.observe(0.001, 3, gains)
        assert b.cap == 4 and not b.settled  # provisional, from the curve
        for _ in range(3):
            b.observe(0.001, 3, None, 0.017 if report else None)
        if not b.settled:  # 2 nodes checked next
            assert b.cap == 2
            for _ in range(3):
                b.observe(0.001, 2, None, 0.0105 if report else None)
        return b

    looped = fit(True)
    assert looped.settled and looped.cap == 2 and looped.verified == {4: 17.0, 2: 10.5}
    assert looped.measured[4] == pytest.approx(3 / 18.0) and looped.measured[2] == pytest.approx(2 / 11.5)
    for b in (fit(False), fit(True, loop_verify=False)):
        assert b.settled and b.cap == 4 and not b.verified


def test_phase_two_checks_join_the_gain_curve_up_to_their_cap():
    """Phase 1's probe trees give 3 tokens with their first 4 nodes; the 4-node trees the checked cap really
    drafts give 2 (a one-beam chain is not a 2-beam search's first beam). With the checks' own gain curves
    (`prefix_accept` in phase 2) 4 nodes average 2.5 tokens over the 16 steps: 2.5 / 14 ms loses to 2 nodes'
    2 / 10.5, which are checked and kept; without them phase 1's 3 / 14 keeps 4 nodes."""

    def fit(report: bool) -> NodeBudget:
        b = NodeBudget(
            CostCurve({1: 10.0, 2: 10.5, 4: 14.0}),
            fit_steps=8,
            check_steps=8,
            sizes=(1, 2, 4),
            confidence=0.0,
        )
        for _ in range(8):
            b.observe(0.0, 3, [1, 2, 3, 3])
        assert b.cap == 4 and not b.settled
        for _ in range(8):
            b.observe(0.0, 2, [1, 2, 2, 2] if report else None)
        if not b.settled:
            assert b.cap == 2
            for _ in range(8):
                b.observe(0.0, 2, [1, 2] if report else None)
        return b

    joined = fit(True)
    assert joined.settled and joined.cap == 2 and len(joined.check_gains) == 16
    assert joined.measured[4] == pytest.approx(2.5 / 14.0) and joined.measured[2] == pytest.approx(2 / 10.5)
    alone = fit(False)
    assert alone.settled and alone.cap == 4 and not alone.check_gains


def test_phase_two_walks_down_while_a_smaller_cap_could_pay():
    """A proposer told a smaller cap drafts less: phase 1 charged every size the full-size draft time (12 ms),
    so it keeps 8 nodes provisionally; at 8 the measured rate is 4 tok / 26 ms, 4 nodes could reach 3 / 12 ms
    with no drafting at all, so 4 is checked: 2 ms of drafting, 3 tok / 14 ms wins; 2 nodes (2 / 11 ms at best)
    cannot beat that and are not checked."""
    budget = _budget({1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}, check_steps=3)
    for _ in range(10):
        budget.observe(0.012, 4, [1, 2, 2, 3, 3, 3, 3, 4])
    assert budget.cap == 8 and not budget.settled
    for _ in range(3):
        budget.observe(0.012, 4)
    assert budget.cap == 4 and not budget.settled  # checked next
    for _ in range(3):
        budget.observe(0.002, 3)
    assert budget.settled and budget.cap == 4
    assert budget.measured == pytest.approx({8: 4 / 26, 4: 3 / 14})


def test_phase_two_rates_every_size_on_phase_ones_steps_not_on_its_own_text():
    """Phase 1's steps (gains [1, 2, 2, 2, 3, 3, 3, 4]: 2 tokens from the first 4 nodes, 4 from all 8) keep 8
    provisionally; 4 could beat it with no draft time at all (2 / 12 ms > 4 / 26 ms), so it is checked. Its
    checks meet text the drafter copies (4 tokens a step from 4 nodes): rated on its own steps it would win
    (4 / 18 ms), but every size is rated on phase 1's steps, the same text for all, with the draft time the
    checks measured (6 ms): 2 / 18 ms < 4 / 26 ms; 2 nodes (2 / 15 ms with their 4 ms) lose too, so 8 stays.
    The tokens the checks saw at 8 still set what the drift test expects there."""
    budget = _budget({1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}, check_steps=3)
    for _ in range(10):
        budget.observe(0.012, 4, [1, 2, 2, 2, 3, 3, 3, 4])
    assert budget.cap == 8 and not budget.settled
    for _ in range(3):
        budget.observe(0.012, 3)  # harder text at 8: 3 tokens a step, not phase 1's 4
    assert budget.cap == 4 and not budget.settled
    for _ in range(3):
        budget.observe(0.006, 4)
    assert budget.cap == 2 and not budget.settled  # 2 / 11 ms at best: checked too
    for _ in range(3):
        budget.observe(0.004, 2)
    assert budget.settled and budget.cap == 8
    assert budget.measured == pytest.approx({8: 4 / 26, 4: 2 / 18, 2: 2 / 15})
    assert budget._expect == pytest.approx(3.0)  # the checks' own tokens at the settled cap


def test_a_larger_size_never_beats_the_provisional_cap_with_a_shorter_draft_time():
    """The reason phase 2 checks only smaller sizes: with the same draft time d, a larger size's rate
    gain(b') / (cost(b') + d) falls behind the provisional cap's by more as d shrinks from phase 1's full-size
    draft time to the real one."""
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 30.0}
    budget = _budget(costs, check_steps=2)
    for i in range(10):  # half the steps accept the first node; one of them accepts 2 more by node 4
        g2 = 2 if i < 5 else 1
        g4 = 3 if i == 0 else g2
        budget.observe(0.010, 1, [1, g2, g2, g4, g4, g4, g4, g4])
    full = budget.rates(budget.draft_ms)
    assert budget.cap == 2 and full[4] >= 0.95 * full[2]  # a near-tie at the full-size draft time
    for d in (0.0, 1.0, 5.0, 9.0):
        r = budget.rates([d])
        assert r[4] < r[2] and r[2] - r[4] >= full[2] - full[4]
    budget.observe(0.001, 2)
    budget.observe(0.001, 1)
    assert budget.settled and budget.cap == 2 and budget.measured == pytest.approx({2: 1.5 / 12})


def test_warm_start_skips_phase_one_with_another_budgets_gains():
    """A budget at another batch size (another cost curve) starts from a fitted budget's gain curve: no
    full-size steps, a provisional cap from its own costs, then phase 2 as usual; a started budget or an
    unfitted source changes nothing."""
    gains = [1, 2, 2, 3, 3, 3, 3, 4]
    small = _budget({1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}, check_steps=2)  # batch 1: flat, big trees pay
    for _ in range(10):
        small.observe(0.001, 4, gains)
    big = _budget({1: 10.0, 2: 11.0, 4: 20.0, 8: 30.0}, check_steps=2)  # batch 16: steep
    big.warm_start(small)
    assert big.cap == 2 and not big.settled and big.gains == small.gains  # no phase-1 step was taken
    big.observe(0.0005, 2)
    big.observe(0.0005, 2)
    assert big.settled and big.cap == 2
    fresh = _budget({1: 10.0, 2: 11.0, 4: 20.0, 8: 30.0})
    fresh.warm_start(_budget({1: 10.0}))  # nothing fitted there: phase 1 as usual
    assert fresh.cap is None and not fresh.gains
    big.warm_start(small)  # already started: unchanged
    assert big.settled and big.cap == 2 and big.history == [2]


def test_fixed_budget_cuts_trees_from_the_first_step_and_never_refits():
    """`NodeBudget.fixed(cap)`: settled at `cap` before any step, observations change nothing, no refit."""
    b = NodeBudget.fixed(4)
    assert (b.cap, b.settled, b.history) == (4, True, [4]) and not b.off_for_good
    for _ in range(300):
        assert not b.tick()
        b.observe(0.001, 1)
    assert (b.cap, b.settled, b.refits) == (4, True, 0)
    assert NodeBudget.fixed(1).off_for_good
    with pytest.raises(ValueError, match="cap=0"):
        NodeBudget.fixed(0)


def test_machine_key_changes_with_path_dtype_and_attention():
    from specdraft.models.attention import use_gqa_sdpa

    model = tiny_llama(num_layers=1)
    assert machine_key(model, "eager") != machine_key(model, "fixed")
    key = machine_key(model, "eager")
    assert use_gqa_sdpa(model) and machine_key(model, "eager") != key  # a curve per attention implementation
    assert machine_key(model, "eager") != machine_key(model.double(), "eager")


def test_machine_key_changes_with_the_cpu_kernel_build_and_switches(monkeypatch: pytest.MonkeyPatch):
    """A curve cached before a kernel change (a new build, or SPECDRAFT_AVX512 / SPECDRAFT_VBMI set otherwise)
    is not the one read after it: the key names the library and its switches on a CPU."""
    from specdraft.eval import budget as budget_mod
    from specdraft.models import exact_panels as ep
    from specdraft.models.panel_linear import kernel_identity, panel_available

    model = tiny_llama(num_layers=1)
    key = machine_key(model, "eager")
    monkeypatch.setattr(budget_mod, "kernel_identity", lambda: "panel_linear-0000.so avx512=1 vbmi=1 vnni=1")
    assert machine_key(model, "eager") != key
    monkeypatch.undo()
    assert machine_key(model, "eager") == key
    if not panel_available():
        assert kernel_identity() == ""
        return
    assert kernel_identity().startswith("panel_linear-") and "avx512=" in kernel_identity()
    was = ep.set_avx512(True)
    try:
        if was:  # an AVX-512 CPU: the AVX2 paths are another curve
            on = machine_key(model, "eager")
            ep.set_avx512(False)
            assert "avx512=0" in kernel_identity() and machine_key(model, "eager") != on
    finally:
        ep.set_avx512(os.environ.get("SPECDRAFT_AVX512", "1") != "0")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(  # verify costs of seconds: the real (sub-ms) draft time does not matter
    "cap_costs", [{1: 1e3, 2: 1e3, 4: 1e3, 8: 1e3}, {1: 1e3, 2: 9e3, 4: 9e3, 8: 9e3}]
)
def test_lossless_while_fitting_and_after(static, cap_costs):
    """Full trees while fitting, cut trees (or no drafting at all) after: the output never changes."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    dec = StaticDecoder(model, 64, static=static)
    budget = NodeBudget(  # (a new call would refit a budget settled off: `refit_on_call`, tested below)
        CostCurve(cap_costs),
        fit_steps=4,
        check_steps=2,
        sizes=(1, 2, 4, 8),
        refit_on_call=False,
        loop_verify=False,  # the synthetic curve decides (the loop's verifies take a millisecond, not seconds)
    )
    for prompt_len in (3, 11, 7):
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 30, stop_ids=set())
        proposer = OracleBeamProposer(ref, prompt_len, vocab=128)
        out, stats = dec.speculative_generate(None, prompt, proposer, 30, stop_ids=set(), budget=budget)
        assert out == ref
    assert budget.settled and budget.cap == (8 if cap_costs[2] == 1e3 else 1)
    if budget.cap == 1:  # no drafting: every step a plain target step
        assert stats.tree_sizes == [1] * stats.steps


def test_measured_costs_cover_every_size():
    model = tiny_llama(num_layers=1)
    for static in (False, True):
        ms = StaticDecoder(model, 64, static=static).measure_costs(sizes=(1, 4, 16), prefix=8, reps=1)
        assert sorted(ms) == [1, 4, 16] and all(v > 0 for v in ms.values())


def test_redrafter_drafts_only_what_the_cap_keeps():
    """Once fitted to 2 nodes the ReDrafter searches one beam of one token; output unchanged throughout."""
    from specdraft.eval.proposers import PromptLookupProposer, ReDrafterProposer
    from specdraft.models import redrafter
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.testing import tiny_tokenizer
    from specdraft.train.config import ReDrafterSchema

    model = tiny_llama(num_layers=2, dtype=torch.float64)
    fp = target_fingerprint(model, tiny_tokenizer())
    drafter = (
        redrafter.build(ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1), model, fp).double().eval()
    )
    proposer = ReDrafterProposer(drafter, beam_width=4, beam_length=4)
    dec = StaticDecoder(model, 64)
    budget = NodeBudget(
        CostCurve({1: 10.0, 2: 1.0, 4: 50.0, 8: 90.0, 16: 170.0}),
        fit_steps=3,
        check_steps=2,
        sizes=(1, 2, 4, 8, 16),
    )
    for prompt_len in (4, 9):
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 20, stop_ids=set())
        out, stats = dec.speculative_generate(None, prompt, proposer, 20, stop_ids=set(), budget=budget)
        assert out == ref
    assert budget.cap == 2 and (proposer.beam_width, proposer.draft_len) == (1, 1)
    assert max(stats.tree_sizes) <= 2
    proposer.fit_budget(FULL)  # a refit: the full search again
    assert (proposer.beam_width, proposer.draft_len) == (4, 3)
    proposer.fit_budget(8)
    assert (proposer.beam_width, proposer.draft_len) == (3, 3)
    lookup = PromptLookupProposer(10)
    lookup.fit_budget(4)
    assert lookup.draft_len == 3
    lookup.fit_budget(FULL)
    assert lookup.draft_len == 10


@pytest.mark.parametrize("family", ["eagle", "medusa"])
def test_every_family_accepts_a_fitted_budget(family):
    """EAGLE shrinks its tree (fewer head passes), Medusa keeps its heads; both stay lossless at cap 2."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from specdraft.eval.proposers import make_proposer
    from specdraft.models import eagle, medusa

    model = tiny_llama(num_layers=2, dtype=torch.float64)
    fp = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
    if family == "eagle":
        schema = SimpleNamespace(
            draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
            token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=None, ttt_decay=0.8,
        )  # fmt: skip
        proposer = make_proposer(eagle.build(schema, model, fp).double().eval(), tree_nodes=10)
    else:
        schema = OmegaConf.create(
            {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4}
        )
        proposer = make_proposer(medusa.build(schema, model, fp).double().eval(), tree_nodes=12)
    budget = NodeBudget(
        CostCurve({1: 1e3, 2: 1e3, 4: 9e3, 8: 9e3}),
        fit_steps=3,
        check_steps=2,
        sizes=(1, 2, 4, 8),
        refit_on_call=False,  # the settled cap across calls (a new call would refit it: tested below)
    )
    dec = StaticDecoder(model, 64)
    for prompt_len in (4, 9, 6):
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 16, stop_ids=set())
        out, stats = dec.speculative_generate(None, prompt, proposer, 16, stop_ids=set(), budget=budget)
        assert out == ref
    assert budget.settled and budget.cap in (1, 2) and max(stats.tree_sizes) <= 2
    if family == "eagle" and budget.cap == 2:
        assert (proposer.total_tokens, proposer.depth) == (1, 1)
    if family == "eagle":
        proposer.fit_budget(FULL)  # a refit: the full tree again
        assert (proposer.total_tokens, proposer.depth) == (10, 4)


def test_refit_follows_the_text():
    """Settled on "no drafting" while drafts were never accepted, the fit is redone `refit_gap` steps later on
    fresh full-size steps (the curve: the newest `fit_steps`), so drafting comes back once it pays; refits
    that keep drafting off double the gap up to `refit_max`. While drafting, only a drift of the tokens per
    step at the cap from the fit's expectation starts a refit."""
    costs = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}
    budget = _budget(  # probes of 8 nodes, the steps' gain lists' length (the floor 4 would probe 4)
        costs, check_steps=0, refit_gap=5, refit_steps=4, refit_max=20, drift_window=4, probe_floor=8
    )
    assert not budget.tick()  # not settled yet: nothing to count
    bad, good = [1] * 8, [1, 2, 2, 3, 3, 3, 3, 4]
    for _ in range(10):
        budget.observe(0.001, 1, bad)
    assert budget.settled and budget.cap == 1 and budget.history == [1] and not budget.off_for_good
    gaps = []
    for _ in range(3):  # drafts still never accepted: each refit keeps drafting off, the gap doubles
        n = 1
        while not budget.tick():
            n += 1
        gaps.append(n - 1)
        assert budget.cap is None and not budget.settled  # phase 1 again: full-size trees
        for _ in range(4):
            budget.observe(0.001, 1, bad)
        assert budget.cap == 1
    assert gaps == [5, 10, 20] and budget.refits == 3 and len(budget.gains) == 10  # the newest fit_steps
    while not budget.tick():
        pass
    for _ in range(4):  # now the drafts are right
        budget.observe(0.001, 4, good)
    # curve: 6 old steps (gain 1) + 4 new ones: 8 nodes (6 + 16) / 10 = 2.2 tok / 15 ms beats 1 / 10 ms
    assert budget.settled and budget.cap == 8 and budget.history[-1] == 8
    assert budget._expect == pytest.approx(2.2)
    for _ in range(40):  # tokens at the cap as expected (within 20%): no refit, however long
        assert not budget.tick()
        budget.observe(0.001, 2 + (_ % 2))  # mean 2.5: +14%
    for _ in range(4):  # they drop to 1 per step: a drift, so the next step starts a refit
        budget.tick()
        budget.observe(0.001, 1)
    assert budget.tick() and budget.cap is None and budget.refits == 5
    for _ in range(4):
        budget.observe(0.001, 1, bad)
    assert budget.cap == 8  # the newest 10: 4 good, 6 bad (2 older, 4 new): 2.2 / 15 ms still pays
    never = _budget(costs, check_steps=0, refit_gap=0, drift_window=4)
    for _ in range(10):
        never.observe(0.001, 4, good)
    for _ in range(8):
        never.observe(0.001, 1)
    assert never.cap == 8 and not any(never.tick() for _ in range(1000))  # refit_gap=0: final
    off = _budget(costs, check_steps=0, refit_gap=0)
    for _ in range(10):
        off.observe(0.001, 1, bad)
    assert off.cap == 1 and off.off_for_good  # the decoders stop keeping skipped positions


def test_a_new_call_refits_a_budget_settled_off():
    """`refit_on_call`: a decode call (new text) starts a refit at its first step when the budget is settled
    on no drafting and `refit_steps` steps have passed since it settled, instead of waiting out `refit_gap`;
    never on 2 nodes or a larger cap (session 64: a refit per prompt at 2 nodes cost 12-14%), a final budget
    (`refit_gap` 0) or just after settling."""
    costs = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}
    bad, good = [1] * 8, [1, 2, 2, 3, 3, 3, 3, 4]
    for on in (True, False):
        budget = _budget(costs, check_steps=0, refit_gap=100, refit_steps=4, refit_on_call=on)
        for _ in range(10):
            budget.observe(0.001, 1, bad)
        assert budget.settled and budget.cap == 1
        budget.start(4)  # a call at once: too soon after settling (fewer than refit_steps steps)
        assert not any(budget.tick() for _ in range(4))
        budget.start(4)  # the next call, 4 steps later: its first step refits (or the gap still runs)
        assert budget.tick() is on and (budget.cap is None) is on
    two = _budget({1: 10.0, 2: 10.5, 4: 14.0, 8: 20.0}, check_steps=0, refit_gap=100, refit_steps=4)
    for _ in range(10):
        two.observe(0.001, 2, [1, 2, 2, 2, 2, 2, 2, 2])
    assert two.settled and two.cap == 2
    for _ in range(8):
        assert not two.tick()
        two.observe(0.001, 2)  # as expected: no drift
    two.start(4)
    assert not two.tick()  # settled on 2 nodes: the timer and a drift refit, a new call does not
    drafting = _budget(costs, check_steps=0, refit_gap=100, refit_steps=4)
    for _ in range(10):
        drafting.observe(0.001, 4, good)
    assert drafting.cap == 8
    for i in range(8):
        drafting.tick()
        drafting.observe(0.001, 2 + i % 2)  # as expected: no drift
    drafting.start(4)
    assert not drafting.tick()  # settled on 8 nodes: only a drift refits
    final = _budget(costs, check_steps=0, refit_gap=0, refit_steps=4)
    for _ in range(10):
        final.observe(0.001, 1, bad)
    final.start(4)
    assert final.off_for_good and not any(final.tick() for _ in range(10))


@pytest.mark.parametrize("static", [False, True])
def test_drafting_comes_back_after_a_refit(static):
    """Drafts that never pay turn drafting off; on later prompts the drafts are right, a refit sees it and
    drafting resumes (the proposer then gets every position committed while it was off, so its drafts line
    up again); outputs equal AR throughout, and the proposers' caps are lifted to the probe size for the refit
    (`refit_cap`: 4 x the cap 1 settled before, at least `probe_floor` = 4 nodes)."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    dec = StaticDecoder(model, 96, static=static)
    flat = {1: 1e3, 2: 1e3, 4: 1e3, 8: 1e3}  # verify costs of seconds: the draft time does not matter
    budget = NodeBudget(  # 4-step fits: the mean decides (the noise rule would want more than one hit in 4)
        CostCurve(flat),
        fit_steps=4,
        check_steps=2,
        sizes=(1, 2, 4, 8),
        refit_gap=6,
        refit_steps=4,
        confidence=0.0,
        loop_verify=False,  # the synthetic curve decides
    )
    caps: list[int] = []
    for i, prompt_len in enumerate((3, 11, 7, 5, 9)):
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
        proposer = OracleBeamProposer(ref, prompt_len, vocab=128)
        proposer.wrong = i < 2  # the first two prompts: drafts never accepted
        proposer.fit_budget = caps.append  # type: ignore[method-assign]
        out, stats = dec.speculative_generate(None, prompt, proposer, 24, stop_ids=set(), budget=budget)
        assert out == ref
        if i == 1:
            assert budget.history[0] == 1 and stats.tree_sizes[-1] == 1  # off
    assert budget.refits >= 1 and budget.history[-1] > 1 and budget.cap == budget.history[-1]
    assert (
        4 in caps and sum(stats.accepted) > 0
    )  # lifted to the probe size (4 nodes), drafting again, accepted


def test_refits_probe_a_multiple_of_the_settled_cap():
    """The first fit drafts full-size trees; a refit drafts `refit_scale` x the cap settled before (>= 4 nodes),
    so its gain curve stops there and no larger cap can be chosen; settling on the probe size lets the next
    refit probe further; `refit_scale=0` keeps full-size refits."""
    costs = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0, 32: 10.0, 64: 10.0}
    budget = _budget(costs, check_steps=0, refit_gap=100, refit_steps=4, drift_window=4)
    assert budget.refit_cap() == FULL  # nothing settled yet: the first fit is full size
    deep = list(range(1, 9)) + [8] * 56  # 64 nodes: 8 tokens from node 8 on
    for _ in range(10):
        budget.observe(0.0, 8, deep[:2])  # only 2 nodes' worth of gain: cap 2
    assert budget.cap == 2 and budget.refit_cap() == 8
    for _ in range(4):  # a drift: 8 tokens a step where 2 were expected
        budget.tick()
        budget.observe(0.0, 8)
    assert budget.tick() and budget.cap is None
    for _ in range(4):  # the refit drafts 8-node trees (its gain lists stop at 8)
        budget.observe(0.0, 8, deep[:8])
    assert budget.cap == 8 and budget.refit_cap() == 32  # settled on the probe: the next refit probes 4x that
    full = _budget(costs, check_steps=0, refit_scale=0)
    for _ in range(10):
        full.observe(0.0, 8, deep[:2])
    assert full.cap == 2 and full.refit_cap() == FULL


def test_a_two_node_cap_is_refitted_on_a_timer_too():
    """At 2 nodes a step gives at most 2 tokens, so the drift test cannot see a larger cap start to pay; such a
    cap is refitted `refit_gap` steps after settling (the gap doubling while refits keep it), as "no drafting"
    is; a larger cap whose tokens hold is not."""
    costs = {1: 10.0, 2: 10.0, 4: 14.0, 8: 40.0}
    budget = _budget(costs, check_steps=0, refit_gap=5, refit_steps=4, drift_window=4)
    for _ in range(10):
        budget.observe(0.001, 2, [1, 2, 2, 2, 2, 2, 2, 2])  # 2 tokens at 2 nodes: 2 / 11 ms beats 2 / 15
    assert budget.settled and budget.cap == 2
    gaps = []
    for _ in range(2):
        n = 0
        while not budget.tick():
            n += 1
            budget.observe(0.001, 2)  # exactly as expected: no drift
        gaps.append(n)
        for _ in range(4):
            budget.observe(0.001, 2, [1, 2, 2, 2, 2, 2, 2, 2])
        assert budget.cap == 2
    assert gaps == [5, 10]
    while not budget.tick():
        budget.observe(0.001, 2)
    for _ in range(4):  # the text now pays 4 nodes: the timer's refit (4 steps) finds it
        budget.observe(0.001, 2, [1, 2, 3, 4, 4, 4, 4, 4])
    assert budget.cap == 4
    assert budget._expect == pytest.approx(2.8)  # the newest 10 steps: 4 new (4 tokens), 6 older (2 tokens)
    assert not any(budget.tick() or budget.observe(0.001, 3) for _ in range(100))  # 4 holds: no timer


def test_the_drift_window_doubles_while_refits_keep_the_cap():
    """A drift that a refit answers with the same cap (a change of prompt, not of the best cap) makes the next
    drift test average twice as many steps, up to `drift_window_max`; a refit that changes the cap resets it."""
    costs = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}
    budget = _budget(
        costs, fit_steps=4, check_steps=0, refit_gap=5, refit_steps=4, drift_window=4, drift_window_max=16
    )
    good = [1, 2, 2, 3, 3, 3, 3, 4]
    for _ in range(4):
        budget.observe(0.001, 4, good)
    assert budget.cap == 8

    def steps_to_refit(tokens: int) -> int:
        n = 0
        while not budget.tick():
            budget.observe(0.001, tokens)  # no token accepted where 3 are expected: a drift
            n += 1
        for _ in range(4):  # the refit sees the same gains: the same cap
            budget.observe(0.001, 4, good)
        assert budget.cap == 8
        return n

    assert [steps_to_refit(0) for _ in range(4)] == [4, 8, 16, 16]  # doubled, capped at 16
    bad = [1] * 8
    while not budget.tick():
        budget.observe(0.001, 0)
    for _ in range(4):  # now the drafts are never accepted: the refit turns drafting off (a new cap)
        budget.observe(0.001, 1, bad)
    assert budget.cap == 1 and budget._window == 4  # reset


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_warm_up_runs_every_cap_once_and_restores_the_proposer(family):
    """`runner.precapture` (what `warm_up` runs on the fixed-shape path): one decode at each cap below the full
    tree, so a GPU captures each cap's shapes before timing; the method's budget and proposer come back as they
    were, and the timed run that follows is still lossless."""
    from specdraft.eval.runner import spec_method, warm_up
    from specdraft.testing import tiny_proposer, tiny_target

    model = tiny_target("llama")
    dec = StaticDecoder(model, 96, static=True)
    proposer = tiny_proposer(family, model, static=True)
    full = proposer.spec.node_budget
    budget = NodeBudget(CostCurve({1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 14.0}), fit_steps=4, check_steps=2,
                        sizes=(1, 2, 4, 8, 16))  # fmt: skip
    caps, inner = [], proposer.fit_budget
    proposer.fit_budget = lambda n: (caps.append(n), inner(n))[1]
    method = spec_method("m", model, None, proposer, set(), {}, False, decoder=dec, budget=budget)
    assert method.prepare is not None
    prompt = torch.randint(5, 128, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    method.prepare(prompt, 6)
    assert caps == [*[c for c in (2, 4, 8, 16) if c < full], FULL]
    assert budget.cap is None and not budget.gains and proposer.spec.node_budget == full
    caps.clear()
    warm_up([method], [prompt], 6)  # the ordinary warm-up, then every cap
    assert caps[-1] == FULL and set(caps[:-1]) >= {c for c in (2, 4, 8, 16) if c < full}
    ref, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
    assert method.run(prompt, 24, None)[0] == ref


def test_marginal_min_prob_is_the_break_even_node_probability():
    """A node accepted with probability p pays when p * cost(1) >= cost(2) - cost(1): golden values, the
    interpolated 2-node cost, and the clamps (a flat curve keeps every node; a steep one at most 0.99)."""
    assert marginal_min_prob(CostCurve({1: 10.0, 2: 13.0, 4: 20.0})) == pytest.approx(0.3)
    assert marginal_min_prob(CostCurve({1: 10.0, 4: 16.0})) == pytest.approx(0.2)  # cost(2) = 12
    assert marginal_min_prob(CostCurve({1: 10.0, 2: 9.0})) == 0.0
    assert marginal_min_prob(CostCurve({1: 10.0, 2: 40.0})) == 0.99


# a 2-core CPU's fp32 curve (session 46): 1 / 2 / 4 / 8 / 16 / 32 / 64 / 128 nodes in one-token steps
CPU_CURVE = {1: 1.0, 2: 1.13, 4: 1.41, 8: 2.41, 16: 3.2, 32: 5.4, 64: 9.12, 128: 18.1}


def test_could_pay_is_the_largest_size_whose_verify_costs_less_than_its_deepest_path():
    """b nodes give at most 1 + min(D, b - 1) tokens a step, so b could pay only where its verify costs less
    than that many one-token steps: a depth-4 tree on the CPU curve stops at 16 nodes (32 cost 5.4 steps for
    at most 5 tokens), a depth-6 one at 32; an undeclared depth or a one-point curve bounds nothing, nor does
    a flat (GPU-like) curve; where two nodes cost two steps nothing could pay."""
    cpu = NodeBudget(CostCurve(CPU_CURVE))
    assert cpu.could_pay(4) == 16 and cpu.could_pay(6) == 32 and cpu.could_pay(1) == 4
    assert cpu.could_pay(0) == FULL  # undeclared
    assert cpu.could_pay(17) == 64  # 18 tokens at most against 18.1 steps at 128
    assert NodeBudget(CostCurve({s: 5.0 for s in CPU_CURVE})).could_pay(4) == FULL
    assert NodeBudget.fixed(8).could_pay(4) == FULL  # one point: no bound
    steep = NodeBudget(CostCurve({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}), sizes=(1, 2, 4, 8))
    assert steep.could_pay(4) == 1 and steep.could_pay(100) == 1


def test_no_step_past_could_pay_beats_plain_steps():
    """Over random cost curves and depths: at every size past `could_pay` a step verifying that many nodes
    gives fewer tokens per ms than plain steps even with every node of its deepest path accepted and free
    drafting, and the bound itself could pay (it is the largest such size, not the first)."""
    g = torch.Generator().manual_seed(7)
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    for _ in range(500):
        steps = torch.rand(len(sizes), generator=g) * torch.tensor([0.0, 1.5, 1.5, 3, 4, 8, 12, 20])
        budget = NodeBudget(
            CostCurve(dict(zip(sizes, (10.0 + 10.0 * steps.cumsum(0)).tolist(), strict=True)))
        )
        depth = int(torch.randint(1, 20, (1,), generator=g))
        bound, one = budget.could_pay(depth), budget.cost(1)
        best = [(1 + min(depth, b - 1)) / budget.cost(b) for b in sizes]  # tokens per ms at best
        assert all(r <= 1 / one for b, r in zip(sizes, best, strict=True) if b > bound)
        if 1 < bound < FULL:
            assert best[sizes.index(bound)] > 1 / one


def test_start_bounds_the_probe_and_turns_drafting_off_where_nothing_could_pay():
    """`start` returns the size phase 1 drafts at, the settled cap once there is one, and settles on no drafting
    for good where no size could pay; a fixed budget keeps its cap. On a steep curve the first fit probes the
    largest size costing at most two one-token steps (at least `probe_floor`); settling there starts a refit at
    once, `refit_scale` times further but never past `could_pay`; a first fit that is final (`refit_gap` 0)
    probes up to `could_pay`, and a flat curve full-size trees."""
    cpu = NodeBudget(CostCurve(CPU_CURVE), fit_steps=4, check_steps=0, refit_gap=1000, refit_steps=4)
    assert cpu.refit_cap() == 4 and cpu.start(4) == 4 and cpu.drafting_cap == 4  # 8 nodes cost 2.41 steps
    for _ in range(4):  # only the fourth node pays: cap 4, the probe
        cpu.observe(0.0, 5, [1, 1, 1, 5])
    assert cpu.settled and cpu.cap == 4 and cpu.start(4) == 4 and cpu.drafting_cap == 4
    assert cpu.tick() and cpu.cap is None  # at once, not 1,000 steps later
    assert cpu.start(4) == 16 and cpu.drafting_cap == 16  # 4 x 4
    for _ in range(4):
        cpu.observe(0.0, 5, [1, 1, 1, 5] + [5] * 12)
    assert cpu.cap == 4 and not cpu.tick()  # settled below the probe: no refit due
    floor8 = NodeBudget(CostCurve(CPU_CURVE), fit_steps=4, check_steps=0, refit_gap=1000, probe_floor=8)
    assert floor8.start(4) == 8  # a higher floor probes past two one-token steps
    for _ in range(4):
        floor8.observe(0.0, 5, [1] * 7 + [5])
    assert floor8.cap == 8 and floor8.tick() and floor8.start(4) == 16  # 4 x 8 = 32, bounded by could_pay
    final = NodeBudget(CostCurve(CPU_CURVE), refit_gap=0)
    assert final.start(4) == 16 and final.start(0) == FULL  # undeclared depth: full-size trees
    flat = NodeBudget(CostCurve({s: 5.0 for s in CPU_CURVE}))
    assert flat.start(4) == FULL and flat.drafting_cap is None
    steep = NodeBudget(CostCurve({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}), sizes=(1, 2, 4, 8), label="steep")
    assert steep.start(4) == 1 and steep.settled and steep.off_for_good and steep.history == [1]
    assert not any(steep.tick() for _ in range(10_000))
    fixed = NodeBudget.fixed(8)
    assert fixed.start(4) == 8 and fixed.drafting_cap == 8


@pytest.mark.parametrize("static", [False, True])
def test_phase_one_drafts_no_tree_larger_than_could_pay(static):
    """On a curve where 8 nodes cost more than five one-token steps, a depth-4 proposer's phase 1 verifies at
    most 4 nodes (its 17-node trees cut), the proposer is told so, and outputs equal AR; a curve where even 2
    nodes cost 2 steps never drafts at all."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    dec = StaticDecoder(model, 96, static=static)
    prompt = torch.randint(5, 128, (7,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
    for ms, most in (({1: 1e3, 2: 1.1e3, 4: 1.4e3, 8: 6e3, 16: 1e4}, 4), ({1: 1e3, 2: 2e3, 4: 4e3}, 1)):
        budget = NodeBudget(CostCurve(ms), fit_steps=4, check_steps=2, sizes=tuple(ms))
        proposer = OracleBeamProposer(ref, 7, vocab=128)
        proposer.spec = ProposerSpec(max_depth=4)
        caps: list[int] = []
        proposer.fit_budget = caps.append  # type: ignore[method-assign]
        out, stats = dec.speculative_generate(None, prompt, proposer, 24, stop_ids=set(), budget=budget)
        assert out == ref and caps[0] == most and max(stats.tree_sizes) <= most
        assert len(budget.gains) in (0, 4) and all(len(g) <= most for g in budget.gains)


def test_eval_node_budget_confidence_reaches_every_fitted_budget():
    """`eval.node_budget_confidence` (default 1) is the confidence of the fitted budget (`eval.node_budget=fit`, and
    `auto` on a GPU) evaluate.py builds per method,
    `eval.node_budget_refit_on_call` (default true) its `refit_on_call` and `eval.node_budget_memory` (default
    192) its `memory`."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from specdraft.eval.cli import _spec
    from specdraft.eval.config import EvalConfig

    assert EvalConfig().node_budget_confidence == 1.0 and EvalConfig().node_budget_refit_on_call is True
    assert EvalConfig().node_budget_memory == 192
    runner = SimpleNamespace(spec_method=lambda *args: args[-1])  # the method's budget
    for z, on, memory in ((0.0, True, 0), (2.5, False, 192)):
        e = dict(acceptance="greedy", fallback=False, profile=False, node_budget="fit", node_budget_refit=128)
        e.update(node_budget_refit_scale=4, node_budget_confidence=z, node_budget_refit_on_call=on)
        cfg = OmegaConf.create({"eval": {**e, "node_budget_memory": memory}})
        budget = _spec(cfg, runner, "m", None, None, None, set(), {}, None, cost=CostCurve({1: 1.0}))
        assert isinstance(budget, NodeBudget) and budget.confidence == z and budget.refit_on_call is on
        assert budget.memory == memory


def test_memory_keeps_a_refit_on_a_copied_passage_from_moving_the_cap():
    """`memory`: a refit rates the caps on the probe steps of every fit so far, not only the newest `fit_steps`,
    so four steps of a passage the drafter copies (4 tokens from 4 nodes) do not outweigh the eight steps of
    ordinary text before them (2 tokens whatever the size); without it the refit moves the cap to 4."""
    costs = {1: 10.0, 2: 11.0, 4: 16.0, 8: 24.0}
    ordinary, copied = [1, 2, 2, 2, 2, 2, 2, 2], [1, 2, 3, 4, 5, 5, 5, 5]
    caps = {}
    for memory in (0, 32):
        budget = _budget(
            costs, fit_steps=8, check_steps=0, refit_gap=5, refit_steps=4, probe_floor=8, memory=memory
        )
        for _ in range(8):
            budget.observe(0.001, 2, ordinary)
        assert budget.settled and budget.cap == 2  # 2 / 12 ms against 2 / 17 at 4 nodes
        while not budget.tick():  # settled on one draft node: refitted on the timer
            pass
        for _ in range(4):
            budget.observe(0.001, 4, copied)
        assert budget.settled and budget.refits == 1
        caps[memory] = budget.cap
        assert len(budget.gains) == len(budget.probes) == (8 if memory == 0 else 12)
    # newest 8 steps: 4 ordinary + 4 copied, 3 tokens / 17 ms at 4 nodes; all 12: 2.67 / 17 < 2 / 12
    assert caps == {0: 4, 32: 2}


def test_memory_rates_a_size_only_on_steps_drafted_that_large():
    """With `memory`, a size is rated on the pooled steps whose trees were cut to at least that many nodes (a
    4-node probe's step says nothing of 8 nodes), and the checks' steps at caps that large; without it every
    kept step counts, cut to its own size."""
    costs = {1: 10.0, 2: 11.0, 4: 16.0, 8: 24.0}
    budget = _budget(costs, fit_steps=4, check_steps=0, memory=16)
    budget.gains = [[1, 2, 2, 2]] * 4 + [[1, 2, 3, 3, 4, 4, 4, 5]] * 4
    budget.probes = [4] * 4 + [8] * 4
    rates = budget.rates([1.0], 0.0)
    assert rates[8] == pytest.approx(5 / (24 + 1))  # the 8-node probes alone
    assert rates[4] == pytest.approx((2 + 3) / 2 / (16 + 1))  # every step
    budget.memory = 0
    assert budget.rates([1.0], 0.0)[8] == pytest.approx((2 + 5) / 2 / ((16 + 24) / 2 + 1))
    assert _budget(costs, memory=8).rates([1.0]) == {1: 0.1}  # no step yet: only plain steps are rated
