"""Batched speculative decoding (eval/batch_decode.py, eval/batch_kv.py): every request's greedy output equals
its own batch-1 `ar_generate` output token for token (fp64 tiny Llama / Qwen2 / Mistral targets), in AR mode and
with test and real proposers, with mixed prompt lengths, rows finishing at different steps and refills; each
row's cache holds exactly its committed tokens' K/V after every step; rows do not influence each other."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from specdraft.eval.batch_decode import BatchDecoder, auto_prefill_rows, make_batch_decoder
from specdraft.eval.decode import ar_generate, target_forward
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.static_kv import StaticKVCache
from specdraft.eval.tree import DraftTree
from specdraft.testing import (
    FAMILIES,
    OracleBeamProposer,
    RandomTreeProposer,
    random_prompts,
    tiny_proposer,
    tiny_proposer_factory,
    tiny_target,
)

CPU = torch.device("cpu")
LENGTHS = [1, 4, 25, 9, 17, 6, 13]  # prompt lengths: mixed, more requests than rows
BUDGETS = [14, 20, 1, 9, 20, 16, 11]  # max_new_tokens per request (1: done at the prefill)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")
SHAPES = [
    "eager",
    "fixed",
    pytest.param("graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def _device(shape: str) -> torch.device:
    """The device a decoder shape runs on: graphs need CUDA, the other shapes are pinned to the CPU."""
    return torch.device("cuda") if shape == "graph" else CPU


def _decoder(model, batch_size: int, shape: str, max_len: int = 1024) -> BatchDecoder:
    """The batch decoder in one of its three shapes (eager, fixed, graph)."""
    return BatchDecoder(model, batch_size, max_len, static=shape != "eager", graphs=shape == "graph")


def _references(model, prompts: list[list[int]], budgets: list[int]) -> tuple[set[int], list[list[int]]]:
    """Stop ids taken mid-way from two unconstrained outputs, and every request's batch-1 AR output with them."""
    free = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, budgets, strict=True)]
    stops = {free[1][7], free[4][11]}
    return stops, [
        ar_generate(model, None, p, m, stop_ids=stops)[0] for p, m in zip(prompts, budgets, strict=True)
    ]


class _OracleByPrompt:
    """`OracleBeamProposer` behind the per-slot factory API: on the first call after `reset()` it recognises
    the request by its prompt (tokens start with prompt[1:]: later tokens are there when the row was not
    drafted at first) and drafts around that request's AR reference."""

    wrong = False  # drafts that never pay (`OracleBeamProposer.wrong`)

    last_compression: float | None = None

    def __init__(self, prompts: list[list[int]], refs: list[list[int]], seed: int) -> None:
        self.table = {tuple(p[1:]): (r, len(p)) for p, r in zip(prompts, refs, strict=True)}
        self.seed, self.inner = seed, None
        self.spec = OracleBeamProposer([], 1).spec

    def reset(self) -> None:
        self.inner = None

    def fit_budget(self, nodes: int) -> None:
        """Trees are cut by the decoder; nothing to change here."""

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        if self.inner is None:
            seen = tuple(tokens[:-1].tolist())
            key = max((k for k in self.table if seen[: len(k)] == k), key=len)
            ref, plen = self.table[key]
            self.inner = OracleBeamProposer(ref, plen, seed=self.seed)
            self.inner.reset()
        self.inner.wrong = self.wrong
        tree = self.inner.propose(hidden, tokens)
        self.last_compression = self.inner.last_compression
        return tree


def _factory(mode: str, prompts, refs) -> Callable | None:
    """The proposer factory of a decoding mode (None: batched AR)."""
    if mode == "ar":
        return None
    if mode == "random":
        seeds = iter(range(100))
        return lambda: RandomTreeProposer(vocab=128, seed=next(seeds))
    if mode == "oracle":
        seeds = iter(range(100))
        return lambda: _OracleByPrompt(prompts, refs, next(seeds))
    return lambda: PromptLookupProposer(4)


def _check_equal(model, batch_size: int, mode: str, shape: str = "eager") -> BatchDecoder:
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    dec = _decoder(model, batch_size, shape, max_len=32)  # too small: growing the cache is exercised too
    res = dec.generate(prompts, BUDGETS, stop_ids=stops, proposer_factory=_factory(mode, prompts, refs))
    for i, ((out, stats), ref) in enumerate(zip(res, refs, strict=True)):
        assert out == ref, f"request {i} (prompt {LENGTHS[i]}, budget {BUDGETS[i]})"
        assert stats.new_tokens == len(ref) and stats.prompt_tokens == LENGTHS[i]
        assert stats.steps == len(stats.accepted) and sum(stats.accepted) + stats.steps + 1 >= len(ref)
    reasons = [s.finish_reason for _, s in res]
    assert "stop" in reasons and "length" in reasons  # rows finished at different steps, for both reasons
    batch = res[0][1].batch
    assert batch.requests == len(prompts) and batch.prefills == len(prompts)
    assert batch.new_tokens == sum(map(len, refs)) and batch.tokens_per_s > 0
    if batch_size > 1:  # rows really shared forwards
        assert batch.steps < sum(s.steps for _, s in res)
    if mode == "oracle":
        assert sum(sum(s.accepted) for _, s in res) > 0
    return dec


@pytest.mark.parametrize("mode", ["ar", "random", "oracle", "lookup"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_batched_equals_batch1_ar(arch, mode):
    _check_equal(tiny_target(arch, CPU), 3, mode)


@pytest.mark.parametrize("mode", ["ar", "random", "oracle", "lookup"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_batched_equals_batch1_ar_batch_sizes(batch_size, mode):
    _check_equal(tiny_target("llama", CPU), batch_size, mode)


@pytest.mark.parametrize("mode", ["ar", "oracle"])
def test_eager_verify_runs_only_the_live_rows(mode):
    """Once the queue is empty, the eager verify covers only the rows from the first to the last one still
    decoding (finished rows at either end drop out of the forward); outputs still equal batch-1 AR."""
    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    dec = _decoder(model, 4, "eager")
    seen: list[slice] = []
    verify = dec._verify

    def spy(tokens, ancestors, depth, layers, keep_last, rows=None, valid=None):
        rows = slice(0, 4) if rows is None else rows
        lengths = dec.cache.lengths
        assert tokens.shape[0] == rows.stop - rows.start
        assert lengths[rows.start] > 0 and lengths[rows.stop - 1] > 0  # live rows at both ends
        assert all(n == 0 for i, n in enumerate(lengths) if not rows.start <= i < rows.stop)  # idle outside
        seen.append(rows)
        return verify(tokens, ancestors, depth, layers, keep_last, rows)

    dec._verify = spy  # type: ignore[method-assign]
    res = dec.generate(prompts, BUDGETS, stop_ids=stops, proposer_factory=_factory(mode, prompts, refs))
    assert [out for out, _ in res] == refs
    assert any(r.stop - r.start < 4 for r in seen) and any(r.start > 0 for r in seen)


def _reference_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (kv_heads, L, head_dim) keys and values of a batch-1 forward over `tokens`."""
    cache = StaticKVCache(model, len(tokens))
    target_forward(model, torch.tensor([tokens]), cache)
    n = len(tokens)
    return [(layer.keys[0, :, :n], layer.values[0, :, :n]) for layer in cache.kv_layers]


@pytest.mark.parametrize("mode", ["oracle", "lookup"])
def test_every_row_holds_exactly_its_committed_kv(mode):
    model = tiny_target("qwen2", CPU)
    prompts = random_prompts(LENGTHS, seed=1)
    stops, refs = _references(model, prompts, BUDGETS)
    checked = []

    def check(dec: BatchDecoder) -> None:
        for r in range(dec.batch_size):
            n, toks = dec.cache.lengths[r], dec.committed[r]
            assert len(toks) == n and int(dec.cache.lengths_t[r]) == n
            if n == 0:
                continue
            for layer, (k, v) in zip(dec.cache.kv_layers, _reference_kv(model, toks), strict=True):
                torch.testing.assert_close(layer.keys[r, :, :n], k, rtol=0, atol=1e-10)
                torch.testing.assert_close(layer.values[r, :, :n], v, rtol=0, atol=1e-10)
            checked.append(n)

    dec = BatchDecoder(model, 3, max_len=128)  # big enough: the spied cache is not reallocated
    commit, moved = dec.cache.commit, []

    def spy(path: torch.Tensor, accepted: list[int], in_place: bool | None = None) -> None:
        """Did a row keep a scattered path, and did the decoder's host-side `in_place` say so?"""
        scattered = any(path[r, :a].tolist() != list(range(a)) for r, a in enumerate(accepted))
        assert in_place is None or in_place == (not scattered)
        moved.append(scattered)
        commit(path, accepted, in_place)

    dec.cache.commit = spy  # type: ignore[method-assign]
    res = dec.generate(prompts, BUDGETS, stops, _factory(mode, prompts, refs), on_step=check)
    assert [out for out, _ in res] == refs
    assert (
        len(checked) >= 10 and max(checked) >= 16
    )  # long rows, not just prompts (finished rows are emptied)
    if mode == "oracle":
        assert any(moved)


@pytest.mark.parametrize("mode", ["ar", "lookup"])
def test_rows_are_independent(mode):
    model = tiny_target("mistral", CPU)
    others = random_prompts([3, 20, 8, 2, 15], seed=2)
    (x,) = random_prompts([11], seed=3)
    runs = [
        (1, [x], [18]),  # alone
        (3, [x, *others[:2]], [18, 5, 30]),  # first, beside two others
        (2, [*others[:3], x, others[3]], [4, 30, 6, 18, 9]),  # after refills, in a row others used
        (4, [*others[2:], x], [25, 3, 7, 18]),
    ]
    got = []
    for batch_size, prompts, budgets in runs:
        res = BatchDecoder(model, batch_size, 64).generate(
            prompts, budgets, set(), _factory(mode, prompts, [])
        )
        got.append(res[prompts.index(x)])
    ref = ar_generate(model, None, x, 18, stop_ids=set())[0]
    for out, stats in got:
        assert out == ref
        assert stats.accepted == got[0][1].accepted and stats.tree_sizes == got[0][1].tree_sizes


def test_budget_edge_cases_and_errors():
    model = tiny_target("llama", CPU)
    prompts = random_prompts([5, 7, 3])
    dec = BatchDecoder(model, 2, 64)
    res = dec.generate(prompts, [0, 1, 3], set())
    assert [len(out) for out, _ in res] == [0, 1, 3]
    assert res[2][0] == ar_generate(model, None, prompts[2], 3, stop_ids=set())[0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(prompts, [4, 4], set())
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([[]], 4, set())


@pytest.mark.parametrize(
    ("ms", "expect"),
    [
        ({1: 1.0, 2: 50.0, 4: 100.0, 8: 200.0, 16: 400.0}, 1),
        ({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}, None),
    ],
    ids=["costly-verify-turns-drafting-off", "flat-verify-keeps-trees"],
)
def test_batched_node_budget_fits_a_cap_and_keeps_outputs(ms, expect):
    """One shared `NodeBudget` over 3 rows of oracle beams: a verify that costs 50x per extra node settles on
    no drafting (later steps are plain target steps), a flat one keeps trees; outputs equal batch-1 AR."""
    from specdraft.eval.budget import CostCurve, NodeBudget

    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    # (the settled cap carries over to the next call: a call does not refit it, `refit_on_call`)
    budget = NodeBudget(CostCurve(ms), fit_steps=6, check_steps=3, refit_on_call=False)
    dec = BatchDecoder(model, 3)
    res = dec.generate(prompts, BUDGETS, stops, _factory("oracle", prompts, refs), budget=budget)
    assert [t for t, _ in res] == refs
    assert budget.settled and (budget.cap == 1 if expect == 1 else budget.cap > 1)
    again = dec.generate(prompts, BUDGETS, stops, _factory("oracle", prompts, refs), budget=budget)
    assert [t for t, _ in again] == refs
    sizes = [n for _, s in again for n in s.tree_sizes]
    assert max(sizes) <= budget.cap and (expect != 1 or set(sizes) == {1})


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_bandit_budget_keeps_outputs_and_scores_every_row(shape, monkeypatch):
    """One `BanditBudget` over 3 rows of oracle beams (prompts of mixed lengths, rows finishing at different
    steps and refilled): every cap it plays, plain steps included, leaves each request its batch-1 AR output; a
    plain step scores one token per decoded row, a drafted step every row's emitted tokens."""
    from specdraft.eval.bandit_budget import BanditBudget
    from specdraft.eval.budget import CostCurve

    dev = _device(shape)
    model = tiny_target("llama", dev)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    scored: list[tuple[int, int]] = []
    real = BanditBudget._score

    def spy(self: BanditBudget, arm: int, tokens: int, seconds: float) -> None:
        scored.append((arm, tokens))
        real(self, arm, tokens, seconds)

    monkeypatch.setattr(BanditBudget, "_score", spy)
    budget = BanditBudget(CostCurve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}), sizes=(1, 2, 4, 8), explore=4)
    dec = _decoder(model, 3, shape)
    for _ in range(2):  # the second call starts from what the first learnt
        res = dec.generate(prompts, BUDGETS, stops, _factory("oracle", prompts, refs), budget=budget)
        assert [t for t, _ in res] == refs
    assert {arm for arm, _ in scored} == {1, 2, 4, 8}
    plain = {t for arm, t in scored if arm == 1}
    assert plain <= {1, 2, 3} and max(plain) == 3  # one token per decoded row (3 while every row decodes)
    assert max(t for arm, t in scored if arm > 1) > 3  # oracle drafts: several tokens a row


def test_batched_refit_brings_drafting_back():
    """Rows whose drafts never pay turn drafting off for the batch; in the next call the drafts are right, a
    refit sees it and drafting resumes (each row's proposer gets the positions committed while it was off);
    outputs equal batch-1 AR in both calls."""
    from specdraft.eval.budget import CostCurve, NodeBudget

    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    flat = {1: 1e3, 2: 1e3, 4: 1e3, 8: 1e3, 16: 1e3}  # seconds per verify: the draft time does not matter
    budget = NodeBudget(CostCurve(flat), fit_steps=6, check_steps=3, refit_gap=3, refit_steps=6)
    dec = BatchDecoder(model, 3)
    try:
        _OracleByPrompt.wrong = True
        res = dec.generate(prompts, BUDGETS, stops, _factory("oracle", prompts, refs), budget=budget)
        assert [t for t, _ in res] == refs and budget.history[0] == 1
        _OracleByPrompt.wrong = False
        again = dec.generate(prompts, BUDGETS, stops, _factory("oracle", prompts, refs), budget=budget)
    finally:
        _OracleByPrompt.wrong = False
    assert [t for t, _ in again] == refs
    assert budget.refits >= 1 and budget.history[-1] > 1
    assert sum(a for _, s in again for a in s.accepted) > 0  # drafts accepted again


def test_batched_cost_curve_is_per_row(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path))
    dec = BatchDecoder(tiny_target("llama", CPU), 4)
    ms = dec.measure_costs(sizes=(1, 2, 4), prefix=16, reps=1)
    assert set(ms) == {1, 2, 4} and all(v > 0 for v in ms.values())
    assert all(dec.cache.lengths[r] == 0 for r in range(4))  # nothing committed
    curve = dec.row_cost_curve(log=lambda _: None)
    assert len(list(tmp_path.glob("*.json"))) == 1  # cached per machine and batch size
    raw = json.loads(next(tmp_path.glob("*.json")).read_text())["ms"]
    assert curve(1) == pytest.approx(float(raw["1"]) / 4)
    # read back: re-timed at a few sizes, then scaled to the speed now (or measured again where the shape moved,
    # as a tiny model's sub-ms timings may): either way the file's shape
    again = dec.row_cost_curve(log=lambda _: None)
    raw = json.loads(next(tmp_path.glob("*.json")).read_text())["ms"]
    assert len(list(tmp_path.glob("*.json"))) == 1
    for b in (2, 4, 8, 16):
        assert again(b) / again(1) == pytest.approx(float(raw[str(b)]) / float(raw["1"]))


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("mode", ["ar", "random", "oracle", "lookup"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fixed_shape_batched_equals_batch1_ar(arch, mode, shape):
    """The fixed-shape path (power-of-two trees, whole-cache attention, device-side mask and write positions)
    and, on CUDA, its graph replays: the same outputs as batch-1 AR, with refills and rows finishing apart."""
    dec = _check_equal(tiny_target(arch, _device(shape)), 3, mode, shape)
    assert dec._inputs and all(b & (b - 1) == 0 for b in dec._inputs)  # only power-of-two budgets
    if shape == "graph":  # captured (a failed capture is an error in tests), one graph per budget
        assert dec._graphs and all(g is not None for g in dec._graphs.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", [*FAMILIES, "redrafter+lookup", "eagle3+lookup"])
def test_every_family_batched_equals_batch1_ar(family, shape):
    """Every family's real proposer (random drafters, so acceptance is partial), alone and with prompt lookup
    merged in, one proposer per row, on every path: each request's output is its batch-1 AR output."""
    from specdraft.eval.hybrid import LookupBranch

    model = tiny_target("llama", _device(shape))
    prompts = random_prompts(LENGTHS, seed=4)
    stops, refs = _references(model, prompts, BUDGETS)
    name, lookup = family.removesuffix("+lookup"), family.endswith("+lookup")
    factory = lambda: LookupBranch(tiny_proposer(name, model), 4) if lookup else tiny_proposer(name, model)  # noqa: E731
    res = _decoder(model, 3, shape).generate(prompts, BUDGETS, stops, factory)
    assert [out for out, _ in res] == refs
    assert max(n for _, s in res for n in s.tree_sizes) > 1  # trees were verified, not just roots


@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "eager"])
@pytest.mark.parametrize(
    "family",
    ["redrafter", "redrafter_copy", "redrafter_copy+lookup", "medusa", "eagle", "eagle3", "eagle3+lookup"],
)
def test_fixed_shape_proposers_batched_equal_batch1_ar(family, shape):
    """The batched decoder with fixed-shape draft steps around one drafter (what evaluate.py's throughput table
    and bench_batch.py build when the batch runs with graphs): the ReDrafter's rows in one fixed-shape search
    (on CUDA one graph per padded row count), EAGLE's in one fixed-shape step over every row's slot (one
    graph per tree size; behind the lookup branch the drafting rows change every step), Medusa's heads once
    for all rows."""
    model = tiny_target("llama", _device(shape))
    prompts = random_prompts(LENGTHS, seed=5)
    stops, refs = _references(model, prompts, BUDGETS)
    graphs = shape == "graph"
    factory = tiny_proposer_factory(family, model, static=True, graphs=graphs)
    res = _decoder(model, 3, shape).generate(prompts, BUDGETS, stops, factory)
    assert [out for out, _ in res] == refs
    assert max(n for _, s in res for n in s.tree_sizes) > 1


def test_fixed_shape_steps_never_change_shape():
    """Every batched verify of the fixed path reads the whole cache (span = max_len, no host lengths) over a
    padded tree width (`rows_budget_for`: powers of two up to 8, then multiples of 8), so a budget's step
    always has the same shapes (what a CUDA graph needs)."""
    from specdraft.eval.batch_decode import rows_budget_for

    assert [rows_budget_for(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65)] == [
        1, 2, 4, 8, 8, 16, 16, 24, 40, 64, 72,
    ]  # fmt: skip
    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    dec = _decoder(model, 3, "fixed")
    seen: list[tuple[int, int, int]] = []
    forward = dec._forward

    def spy(rows, tokens, ancestors, depth, layers, keep_last, span=None, logits_at=None):
        if logits_at is None:  # the batched verify (prefills ask for their last logits, eagerly)
            seen.append((*tokens.shape, span))
        return forward(rows, tokens, ancestors, depth, layers, keep_last, span, logits_at)

    dec._forward = spy  # type: ignore[method-assign]
    res = dec.generate(prompts, BUDGETS, stops, _factory("random", prompts, refs))
    assert [out for out, _ in res] == refs
    assert {(rows, span) for rows, _, span in seen} == {(3, dec.cache.max_len)}
    widths = {b for _, b, _ in seen}
    assert all(rows_budget_for(b) == b for b in widths) and len(widths) <= 8 and max(widths) > 1


def test_make_batch_decoder_follows_cuda_graphs():
    """auto: the eager path on a CPU target; on: an error naming the fix; anything else: an error."""
    model = tiny_target("llama", CPU)
    dec = make_batch_decoder(model, 2, "auto")
    assert not dec.static and not dec.graphs and dec.path_name() == "eager"
    # eval.prefill_rows: auto is one prompt per forward on a CPU, every admitted row on a GPU
    assert dec.prefill_rows == 1 and make_batch_decoder(model, 4, prefill_rows=3).prefill_rows == 3
    assert auto_prefill_rows(torch.device("cuda"), 8) == 8 and auto_prefill_rows(CPU, 8) == 1
    assert not make_batch_decoder(model, 2, "off").graphs
    with pytest.raises(ValueError, match="base_model.device=cuda"):
        make_batch_decoder(model, 2, "on")
    with pytest.raises(ValueError, match="auto | on | off"):
        make_batch_decoder(model, 2, "sometimes")
    with pytest.raises(ValueError, match="graphs=True needs"):
        BatchDecoder(model, 2, static=False, graphs=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["ar", "redrafter_copy", "eagle3"])
def test_batched_prefills_equal_batch1_ar(family, shape):
    """Rows admitted together are prefilled in one forward (`prefill_rows`: contiguous rows, prompts of 1-25
    tokens padded to the longest, logits at each row's last prompt token only); a request done at its first
    token is refilled in the next round. Every request still gets its batch-1 AR output, and the drafters,
    which read the prompt's hidden states (EAGLE-3 three layers), draft from the real positions."""
    model = tiny_target("llama", _device(shape))
    prompts = random_prompts(LENGTHS, seed=6)
    stops, refs = _references(model, prompts, BUDGETS)
    dec = BatchDecoder(model, 3, static=shape != "eager", graphs=shape == "graph", prefill_rows=3)
    prefills: list[int] = []
    forward = dec._forward

    def spy(rows, tokens, ancestors, depth, layers, keep_last, span=None, logits_at=None, valid=None):
        if logits_at is not None:
            prefills.append(tokens.shape[0])
        return forward(rows, tokens, ancestors, depth, layers, keep_last, span, logits_at, valid)

    dec._forward = spy  # type: ignore[method-assign]
    graphs = shape == "graph"
    factory = (
        None
        if family == "ar"
        else tiny_proposer_factory(family, model, static=shape != "eager", graphs=graphs)
    )
    res = dec.generate(prompts, BUDGETS, stops, factory)
    assert [out for out, _ in res] == refs
    assert prefills[0] == 3 and sum(prefills) == res[0][1].batch.prefills == len(prompts)


def test_prefill_groups_follow_rows_and_the_token_cap(monkeypatch):
    """A prefill forward takes at most `prefill_rows` rows and at most `PREFILL_TOKENS` padded tokens;
    `prefill_rows=0` is refused."""
    import specdraft.eval.batch_decode as bd

    model = tiny_target("llama", CPU)
    with pytest.raises(ValueError, match="prefill_rows=0"):
        BatchDecoder(model, 2, prefill_rows=0)
    dec = BatchDecoder(model, 4, 256, prefill_rows=2)
    seen: list[tuple[int, int]] = []
    forward = dec._forward

    def spy(rows, tokens, ancestors, depth, layers, keep_last, span=None, logits_at=None):
        seen.append((rows.start, tokens.shape[0]))
        return forward(rows, tokens, ancestors, depth, layers, keep_last, span, logits_at)

    dec._forward = spy  # type: ignore[method-assign]
    st = [bd._Row(i, 5, bd.RequestStats(), 0.0) for i in range(4)]
    prompts = random_prompts([3, 9, 4, 2], seed=1)
    dec._prefill([(0, st[0]), (1, st[1]), (3, st[3])], [prompts[0], prompts[1], prompts[3]], (), False, None)
    assert seen == [(0, 2), (3, 1)]  # rows 0-1 together (prefill_rows=2), then row 3
    monkeypatch.setattr(bd, "PREFILL_TOKENS", 12)
    seen.clear()
    dec._prefill([(0, st[0]), (1, st[1])], [prompts[0], prompts[1]], (), False, None)
    assert seen == [(0, 1), (1, 1)]  # 2 rows x 9 tokens > 12
    assert [dec.cache.lengths[r] for r in (0, 1)] == [3, 9] and st[1].new_hidden.shape[0] == 9


@pytest.mark.parametrize("shape", ["eager", "fixed"])
@pytest.mark.parametrize("family", ["redrafter_copy", "eagle3", "lookup"])
def test_drafters_read_their_own_rows(family, shape):
    """Each row's proposer gets its own row's newly committed hidden states and tokens: with one drafter, every
    request's drafts accepted per step at batch 3 (beside others, after refills, rows drafted together) equal
    its own at batch 1. Output equality alone would not show it (a wrong row only drafts worse)."""
    model = tiny_target("llama", CPU)
    prompts = random_prompts([11, 3, 20, 8, 5], seed=7)
    budgets = [16, 9, 16, 12, 16]
    static = shape == "fixed"
    factory = (
        tiny_proposer_factory(family, model, static=static)
        if family != "lookup"
        else _factory("lookup", prompts, [])
    )
    alone = [
        BatchDecoder(model, 1, static=static).generate([p], m, set(), factory)[0][1].accepted
        for p, m in zip(prompts, budgets, strict=True)
    ]
    together = BatchDecoder(model, 3, static=static).generate(prompts, budgets, set(), factory)
    assert [s.accepted for _, s in together] == alone
    assert sum(map(sum, alone)) > 0


@pytest.mark.parametrize("shape", ["eager", "fixed"])
def test_rows_that_are_not_adjacent_prefill_in_one_forward(shape):
    """Rows 0, 2 and 3 admitted together (`prefill_rows=3`) take one forward over row indices, not a slice:
    each holds exactly its prompt's K/V afterwards, and row 1, mid-request, keeps its own untouched."""
    import specdraft.eval.batch_decode as bd

    model = tiny_target("qwen2", CPU)
    dec = BatchDecoder(model, 4, 64, static=shape == "fixed", prefill_rows=3)
    prompts = random_prompts([5, 7, 3, 9], seed=2)
    st = [bd._Row(i, 5, bd.RequestStats(), 0.0) for i in range(4)]
    dec._prefill([(1, st[1])], [prompts[1]], (), False, None)
    seen: list[object] = []
    forward = dec._forward

    def spy(rows, *args, **kwargs):
        seen.append(rows)
        return forward(rows, *args, **kwargs)

    dec._forward = spy  # type: ignore[method-assign]
    starts = [(0, st[0]), (2, st[2]), (3, st[3])]
    dec._prefill(starts, [prompts[0], prompts[2], prompts[3]], (), False, None)
    assert seen == [[0, 2, 3]]
    for r in range(4):
        n = len(prompts[r])
        assert dec.cache.lengths[r] == n and dec.committed[r] == prompts[r]
        for layer, (k, v) in zip(dec.cache.kv_layers, _reference_kv(model, prompts[r]), strict=True):
            torch.testing.assert_close(layer.keys[r, :, :n], k, rtol=0, atol=1e-10)
            torch.testing.assert_close(layer.values[r, :, :n], v, rtol=0, atol=1e-10)
        ref = ar_generate(model, None, prompts[r], 1, stop_ids=set())[0]
        assert st[r].root == ref[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["ar", "redrafter_copy"])
def test_refills_wait_for_refill_rows_free_rows(family, shape):
    """`refill_rows=3` of 3 rows admits queued requests only once every row is free (or the queue is
    shorter): fewer prefill forwards than refilling each row as it frees, more idle row-steps, and every
    request still gets its batch-1 AR output. Out of range: refused; auto is B/4 on CUDA, 1 on a CPU."""
    from specdraft.eval.batch_decode import auto_refill_rows

    model = tiny_target("llama", _device(shape))
    prompts = random_prompts(LENGTHS, seed=6)
    stops, refs = _references(model, prompts, BUDGETS)
    forwards, idle = {}, {}
    for refill in (1, 3):
        dec = BatchDecoder(
            model, 3, static=shape != "eager", graphs=shape == "graph", prefill_rows=3, refill_rows=refill
        )
        calls: list[int] = []
        forward = dec._forward

        def spy(rows, tokens, *args, calls=calls, forward=forward, **kwargs):
            if kwargs.get("logits_at") is not None:
                calls.append(tokens.shape[0])
            return forward(rows, tokens, *args, **kwargs)

        dec._forward = spy  # type: ignore[method-assign]
        factory = (
            None
            if family == "ar"
            else tiny_proposer_factory(family, model, static=shape != "eager", graphs=shape == "graph")
        )
        res = dec.generate(prompts, BUDGETS, stops, factory)
        assert [out for out, _ in res] == refs
        forwards[refill], idle[refill] = len(calls), res[0][1].batch.idle_row_steps
        assert sum(calls) == len(prompts)
    assert forwards[3] < forwards[1] and idle[3] > idle[1]
    with pytest.raises(ValueError, match="refill_rows=4"):
        BatchDecoder(model, 3, refill_rows=4)
    assert auto_refill_rows(torch.device("cuda"), 16) == 4 and auto_refill_rows(CPU, 16) == 1
    assert auto_refill_rows(torch.device("cuda"), 2) == 1
    assert make_batch_decoder(tiny_target("llama", CPU), 4, refill_rows=9).refill_rows == 4


def test_a_commit_moves_every_layer_in_two_kernels_and_only_the_accepted_slots():
    """`BatchKVCache.commit` compacts every layer's keys and values of every row with one index_select and one
    index_copy_ over the one buffer (not 4 kernels per layer), moving each row's accepted path right after its
    prefix and nothing past the longest accepted count: a 4-layer cache against a per-row, per-layer copy."""
    from specdraft.eval.batch_kv import BatchKVCache
    from specdraft.testing import KernelCount

    model = tiny_target("llama", CPU)
    cache = BatchKVCache(model, 3, 32)
    g = torch.Generator().manual_seed(0)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=g, dtype=cache.buffer.dtype))
    for r, n in enumerate([5, 9, 2]):
        cache.set_length(r, n)
    path = torch.tensor(
        [[0, 2, 5, 6, 7, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7], [0, 3, 4, 1, 1, 1, 1, 1]]
    )  # (B, 8)
    accepted = [3, 0, 2]
    expected = cache.buffer.clone()
    for r, (n, a) in enumerate(zip([5, 9, 2], accepted, strict=True)):
        for i in range(a):
            expected[:, :, r, :, n + i] = cache.buffer[:, :, r, :, n + int(path[r, i])]
    with KernelCount() as count:
        cache.commit(path, accepted, in_place=False)
    assert count.ops["index_select"] == 1 and count.ops["index_copy_"] == 1, count.ops
    assert count.count <= 30, count.ops  # a few index kernels, whatever the layers
    torch.testing.assert_close(cache.buffer, expected, rtol=0, atol=0)
    assert cache.lengths == [8, 9, 4] and cache.lengths_t.tolist() == [8, 9, 4]
    assert all(
        layer.keys.data_ptr() == cache.buffer[i, 0].data_ptr() for i, layer in enumerate(cache.kv_layers)
    )


def test_batched_phase_one_drafts_no_tree_larger_than_could_pay():
    """The batched decoder bounds phase 1 as the single-row one does (`NodeBudget.start`): a depth-4 proposer
    on a per-row curve where 8 nodes cost more than five one-token steps verifies at most 4 nodes a row while
    fitting; outputs equal batch-1 AR."""
    from specdraft.eval.budget import CostCurve, NodeBudget
    from specdraft.eval.tree import ProposerSpec

    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS)
    stops, refs = _references(model, prompts, BUDGETS)
    inner = _factory("oracle", prompts, refs)
    assert inner is not None

    def factory():
        p = inner()
        p.spec = ProposerSpec(max_depth=4)
        return p

    budget = NodeBudget(CostCurve({1: 1e3, 2: 1.1e3, 4: 1.4e3, 8: 6e3, 16: 1e4}), fit_steps=4, check_steps=2)
    res = BatchDecoder(model, 3).generate(prompts, BUDGETS, stops, factory, budget=budget)
    assert [t for t, _ in res] == refs
    assert max(n for _, s in res for n in s.tree_sizes) <= 4 and budget.gains
    assert all(len(g) <= 4 for g in budget.gains)
