"""Length-aware scheduling (eval/scheduler.py, `BatchDecoder.generate(order=...)`): decreasing first fit keeps
every request exactly once within the KV budget; admission order never changes a request's output (each equals
its batch-1 AR output, fp64 tiny targets); longest-first cuts idle row-steps on a tail-heavy workload; the
throughput table carries FIFO, length-aware and oracle rows for the same prompts; S3 length groups stay within
FIFO's KV memory, and requests that outgrow their reserve resume losslessly."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.decode import ar_generate
from specdraft.eval.grouped import fifo_rows, serve_grouped
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.scheduler import fifo_order, first_fit_decreasing, longest_first, schedule_order
from specdraft.eval.throughput import plot_throughput, print_throughput, throughput_rows
from specdraft.testing import random_prompts, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.parametrize("seed", range(20))
def test_first_fit_decreasing_respects_the_budget_and_keeps_every_request_once(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    prompts = [rng.randint(1, 60) for _ in range(n)]
    predicted = [rng.uniform(0, 128) for _ in range(n)]
    budget = rng.randint(200, 2000)
    max_batch = rng.choice([None, 1, 4, 16])
    batches = first_fit_decreasing(prompts, predicted, budget, max_batch)
    assert sorted(i for g in batches for i in g) == list(range(n))
    size = [p + round(q) for p, q in zip(prompts, predicted, strict=True)]
    for g in batches:
        assert len(g) * max(size[i] for i in g) <= budget
        assert max_batch is None or len(g) <= max_batch
        assert [size[i] for i in g] == sorted((size[i] for i in g), reverse=True)
    firsts = [size[g[0]] for g in batches]
    assert firsts == sorted(firsts, reverse=True)


def test_first_fit_decreasing_groups_similar_lengths_and_refuses_oversized() -> None:
    # footprints 100, 100, 90, 20, 20, 10: budget 200 -> [100, 100], [90, 20], [20, 10]
    assert first_fit_decreasing([0] * 6, [100, 20, 100, 10, 90, 20], 200) == [[0, 2], [4, 1], [5, 3]]
    with pytest.raises(ValueError, match="request 1 needs 300 KV tokens"):
        first_fit_decreasing([10, 200], [5, 100], 250)
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], [1], 0)


def test_orders() -> None:
    assert fifo_order(3) == [0, 1, 2]
    assert longest_first([5, 9, 5, 1, 9]) == [1, 4, 0, 2, 3]  # ties keep arrival order
    assert schedule_order("fifo", 3) == [0, 1, 2]
    assert schedule_order("length", 3, [1, 3, 2]) == [1, 2, 0]
    assert sorted(schedule_order("length", 4, [1, 30, 2, 40], [5, 5, 5, 5], budget=100)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="one length per request"):
        schedule_order("length", 3)
    with pytest.raises(ValueError, match="scheduler='lifo'"):
        schedule_order("lifo", 3, [1, 2, 3])


@pytest.mark.parametrize(
    ("arch", "spec"), [("llama", False), ("qwen2", True)], ids=["ar-llama", "lookup-qwen2"]
)
def test_length_order_keeps_every_output_equal_to_batch1_ar(arch: str, spec: bool) -> None:
    model = tiny_target(arch)
    prompts = random_prompts([3, 12, 7, 20, 5, 9, 15])
    budgets = [6, 18, 1, 12, 20, 3, 9]
    refs = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, budgets, strict=True)]
    factory = (lambda: PromptLookupProposer(4)) if spec else None
    dec = BatchDecoder(model, 3)
    for order in (longest_first(budgets), [6, 0, 5, 1, 4, 2, 3]):
        out = dec.generate(prompts, budgets, set(), factory, order=order)
        assert [t for t, _ in out] == refs, order


def test_longest_first_cuts_idle_row_steps_on_a_tail() -> None:
    """B = 2, budgets 3, 3, 3, 3, 21 (no stop tokens): FIFO admits the long request last and runs it alone;
    longest-first runs it in row 0 while row 1 serves the four short ones."""
    model = tiny_target()
    prompts = random_prompts([4, 6, 5, 7, 3])
    budgets = [3, 3, 3, 3, 21]
    dec = BatchDecoder(model, 2)
    fifo = dec.generate(prompts, budgets, set())[0][1].batch
    lpt = dec.generate(prompts, budgets, set(), order=longest_first(budgets))[0][1].batch
    assert (fifo.steps, fifo.idle_row_steps) == (24, 20)  # 2 + 2 steps for two pairs, then 20 alone
    assert (lpt.steps, lpt.idle_row_steps) == (20, 12)
    assert lpt.row_utilisation > fifo.row_utilisation
    with pytest.raises(ValueError, match="permutation"):
        dec.generate(prompts, budgets, set(), order=[0, 1, 2, 3, 3])


def test_throughput_rows_fifo_length_oracle(tmp_path) -> None:
    model = tiny_target()
    prompts = random_prompts([4, 9, 6, 3, 5])
    predicted = [10.0, 2.0, 16.0, 4.0, 12.0]
    rows = throughput_rows(
        model, "toy", prompts, [("ar", None), ("lookup", lambda: PromptLookupProposer(3))], [1, 2], 8, set(),
        log=lambda _: None, schedulers=("fifo", "length", "oracle"), predicted=predicted, predict_s=0.01,
    )  # fmt: skip
    assert [(r["batch"], r["method"], r["scheduler"]) for r in rows][:3] == [
        (1, "ar", "fifo"),
        (1, "ar", "length"),
        (1, "ar", "oracle"),
    ]
    assert len(rows) == 2 * 2 * 3  # batch sizes x methods x schedulers
    assert all(r["identical"] == len(prompts) for r in rows)
    assert all(0 < r["row_utilisation"] <= 1 and r["speedup_vs_fifo"] is not None for r in rows)
    assert all(r["predict_s"] == (0.01 if r["scheduler"] == "length" else 0.0) for r in rows)
    print_throughput(rows)
    assert plot_throughput(rows, tmp_path)[0].exists()
    with pytest.raises(ValueError, match="predicted length"):
        throughput_rows(model, "toy", prompts, [("ar", None)], [1], 4, set(), schedulers=("length",))


def _lookup_rows_under_budgets(**kw: Any) -> list[dict[str, Any]]:
    """The throughput table of AR and prompt lookup at batch 1 and 2 with node budgets (`throughput_rows`
    keywords `kw`) over six toy prompts; every output equal to batch-1 AR's."""
    prompts = random_prompts([4, 9, 6, 3, 5, 7])
    rows = throughput_rows(
        tiny_target(), "toy", prompts, [("ar", None), ("lookup", lambda: PromptLookupProposer(3))], [1, 2], 24,
        set(), log=lambda _: None, node_budget=True, **kw,
    )  # fmt: skip
    assert all(r["identical"] == len(prompts) for r in rows)
    return rows


@pytest.mark.parametrize("memory", [0, 192])
def test_throughput_budgets_carry_their_gain_curve_to_the_next_batch_size(
    tmp_path, monkeypatch, memory
) -> None:
    """With node budgets, a method's budget at the second batch size starts from the first one's gains
    (`NodeBudget.warm_start`: no full-size phase 1 again) and outputs stay batch-1 AR's. Memory 0 carries the
    newest fit's 48 steps; memory 192 (the default, as `eval.node_budget_memory`) every probe step batch 1 drafted,
    up to 192."""
    from specdraft.eval.budget import NodeBudget

    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path))
    starts: list[tuple[int, int]] = []
    real = NodeBudget.warm_start

    def spy(self: NodeBudget, other: NodeBudget) -> None:
        real(self, other)
        starts.append((len(other.gains), len(self.gains)))

    monkeypatch.setattr(NodeBudget, "warm_start", spy)
    _lookup_rows_under_budgets(budget_memory=memory)
    assert len(starts) == 1 and starts[0][0] >= 48  # batch 1 fitted (a refit may be under way)
    if memory == 0:
        assert starts[0][1] == 48  # the batch-2 budget began with batch 1's newest 48-step gain curve
    else:
        assert starts[0][1] == min(starts[0][0], memory) > 48  # ... with every probe step batch 1 drafted


def test_throughput_bandit_budgets_learn_per_batch_size(tmp_path, monkeypatch, capsys) -> None:
    """`bandit=True` (`eval.node_budget=auto` on a CPU): a `BanditBudget` per (batch size, drafter) instead of a
    fitted budget, its arms bounded by that batch size's cost curve; only batch 1 learns per context (the step
    before a hit or a miss); outputs stay batch-1 AR's."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path))
    rows = _lookup_rows_under_budgets(bandit=True)
    lines = capsys.readouterr().out.splitlines()
    one = [x for x in lines if "lookup at batch 1: bandit over caps [1" in x]
    two = [x for x in lines if "lookup at batch 2: bandit over caps [1" in x]
    assert one and two and all("per context" in x for x in one) and not any("per context" in x for x in two)
    assert all(r["node_cap"] >= 1 for r in rows if r["method"] == "lookup")


@pytest.mark.parametrize("spec", [False, True], ids=["ar", "lookup"])
def test_grouped_serving_stays_in_budget_and_equals_batch1_ar_with_overflows(spec: bool) -> None:
    """Reserves [2, 2, 12, 2, 12, 3] against true lengths up to 12 (no stop tokens): the too-short reserves
    overflow, resume from what they emitted and still end equal to batch-1 AR; no group exceeds the budget;
    FIFO under the same budget affords budget // (longest prompt + max_new) rows."""
    model = tiny_target("llama")
    prompts = random_prompts([3, 8, 5, 2, 6, 4])
    max_new = 12
    refs = [ar_generate(model, None, p, max_new, stop_ids=set())[0] for p in prompts]
    factory = (lambda: PromptLookupProposer(3)) if spec else None
    budget = 2 * (8 + max_new)
    out, stats = serve_grouped(model, prompts, [2, 2, 12, 2, 12, 3], max_new, budget, set(), factory)
    assert out == refs
    assert stats.overflows == 4  # every reserve below 12 (no request stops early)
    assert stats.peak_kv_tokens <= budget and stats.new_tokens == 6 * max_new
    assert max(stats.batch_sizes) > fifo_rows([len(p) for p in prompts], max_new, budget) == 2
    fifo = BatchDecoder(model, 2, max_len=1).generate(prompts, max_new, set(), factory)  # FIFO in that budget
    assert [t for t, _ in fifo] == refs
    exact, estats = serve_grouped(model, prompts, [max_new] * 6, max_new, budget, set(), factory)
    assert exact == refs and estats.overflows == 0
    with pytest.raises(ValueError, match="less than one row"):
        fifo_rows([5, 30], 10, 39)


def test_reserve_length_is_the_bucket_bound_at_the_quantile() -> None:
    from specdraft.eval.length_predictor import LengthPredictor

    k = 4  # edges (32, 64, 128): buckets [0,32) [32,64) [64,128) [128,inf)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05], [0.05, 0.05, 0.1, 0.8]]))  # (2, K)
    pred = LengthPredictor(
        "length", (32, 64, 128), torch.zeros(1), torch.ones(1), torch.zeros(k, 1), torch.zeros(k),
        torch.tensor([16.0, 48.0, 96.0, 200.0]),
    )  # fmt: skip
    pred.bias.copy_(logits[0])
    assert pred.reserve_length(torch.zeros(1, 1), 256, 0.5).tolist() == [32]
    assert pred.reserve_length(torch.zeros(1, 1), 256, 0.9).tolist() == [64]  # 0.7 + 0.2 reaches 0.9
    assert pred.reserve_length(torch.zeros(1, 1), 100, 0.99).tolist() == [100]  # the last bound is max_new
    pred.bias.copy_(logits[1])
    assert pred.reserve_length(torch.zeros(1, 1), 256, 0.1).tolist() == [64]
    with pytest.raises(ValueError, match="quantile"):
        pred.reserve_length(torch.zeros(1, 1), 256, 0.0)


def test_throughput_rows_groups_under_fifos_memory() -> None:
    model = tiny_target()
    prompts = random_prompts([4, 9, 6, 3, 5, 7, 2, 8])
    rows = throughput_rows(
        model, "toy", prompts, [("ar", None), ("lookup", lambda: PromptLookupProposer(3))], [2], 8, set(),
        log=lambda _: None, schedulers=("fifo", "groups", "oracle_groups"), predicted=[8.0] * 8,
        predict_s=0.01, reserve=[2, 8, 2, 8, 2, 8, 2, 8],
    )  # fmt: skip
    assert [r["scheduler"] for r in rows] == ["fifo", "groups", "oracle_groups"] * 2
    assert all(r["identical"] == len(prompts) for r in rows)
    assert all(r["kv_budget"] == 2 * (9 + 8) for r in rows)
    groups = [r for r in rows if r["scheduler"] == "groups"]
    assert all(r["overflows"] == 4 and r["predict_s"] == 0.01 for r in groups)  # reserves of 2 overflow
    assert all(r["overflows"] == 0 for r in rows if r["scheduler"] == "oracle_groups")
    print_throughput(rows)
    with pytest.raises(ValueError, match="one reserve per prompt"):
        throughput_rows(model, "toy", prompts, [("ar", None)], [1], 4, set(), schedulers=("fifo", "groups"))
