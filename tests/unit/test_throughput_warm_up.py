"""The throughput table times warm methods: every method is served once before its timed calls (its CUDA
graphs captured there), the timed calls reuse the warmed proposers, the cache is sized once per batch size
before anything is captured on it, and a profiled call splits a batched step into its phases. Outputs stay
batch-1 AR's throughout (fp64 tiny targets)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specdraft.eval.batch_decode import PHASES, BatchDecoder
from specdraft.eval.budget import NodeBudget
from specdraft.eval.proposers import PromptLookupProposer
from specdraft.eval.throughput import print_phases, throughput_rows
from specdraft.testing import random_prompts, tiny_proposer_factory, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _spy_on_the_decoder(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, int]]:
    """Record (batch size, "cache" | "generate", generate calls so far) for every cache reallocation and call."""
    events: list[tuple[int, str, int]] = []
    calls: dict[int, int] = {}
    new_cache, generate = BatchDecoder._new_cache, BatchDecoder.generate

    def spy_cache(self: BatchDecoder, max_len: int) -> None:
        events.append((self.batch_size, "cache", calls.get(id(self), 0)))
        new_cache(self, max_len)

    def spy_generate(self: BatchDecoder, *args: Any, **kwargs: Any):
        calls[id(self)] = calls.get(id(self), 0) + 1
        events.append((self.batch_size, "generate", calls[id(self)]))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(BatchDecoder, "_new_cache", spy_cache)
    monkeypatch.setattr(BatchDecoder, "generate", spy_generate)
    return events


def test_timed_calls_reuse_the_warmed_proposers_on_a_cache_sized_once(monkeypatch) -> None:
    """Per batch size: the cache is (re)allocated before the first call only, each drafter's factory makes one
    probe proposer (the cache margin) and B row proposers for the warm-up, and its timed calls (three
    schedulers and the profiled one) make none; every output equals batch-1 AR's."""
    events = _spy_on_the_decoder(monkeypatch)
    made = {"n": 0}

    def lookup() -> PromptLookupProposer:
        made["n"] += 1
        return PromptLookupProposer(3)

    model = tiny_target()
    prompts = random_prompts([4, 9, 6, 3, 5])
    rows = throughput_rows(
        model, "toy", prompts, [("ar", None), ("lookup", lookup)], [1, 3], 12, set(), log=lambda _: None,
        schedulers=("fifo", "length"), predicted=[3.0, 9.0, 1.0, 4.0, 7.0], phases=True,
    )  # fmt: skip
    assert all(r["identical"] == len(prompts) for r in rows)
    assert made["n"] == (1 + 1) + (1 + 3)  # batch 1: probe + 1 row; batch 3: probe + 3 rows
    for b in (1, 3):
        mine = [(kind, n) for bs, kind, n in events if bs == b]
        assert [n for kind, n in mine if kind == "cache"] == [0] * sum(k == "cache" for k, _ in mine)
        # AR: warm-up, fifo, length, profiled; lookup: the same (one warm-up: no budget, no graphs)
        assert sum(kind == "generate" for kind, _ in mine) == 8


def test_a_reused_proposer_drafts_full_trees_again_after_a_capped_call() -> None:
    """`BatchDecoder.proposers_for`: the same factory gets the same proposers back, restored to full trees
    after a call under a 2-node cap; a new factory gets new ones; outputs equal batch-1 AR's every time."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory("redrafter", model)
    prompts = random_prompts([5, 8, 3], seed=4)
    dec = BatchDecoder(model, 2)
    ar = [t for t, _ in dec.generate(prompts, 16, set())]
    capped = dec.generate(prompts, 16, set(), factory, budget=NodeBudget.fixed(2))
    first = dec.proposers_for(factory)
    full = dec.generate(prompts, 16, set(), factory)
    assert dec.proposers_for(factory) is first
    assert [t for t, _ in capped] == ar and [t for t, _ in full] == ar
    assert max(n for _, st in capped for n in st.tree_sizes) <= 2
    assert max(n for _, st in full for n in st.tree_sizes) > 2  # the cap did not stay with the proposers
    assert dec.proposers_for(tiny_proposer_factory("redrafter", model)) is not first


@pytest.mark.parametrize(
    "family", ["redrafter_copy", "medusa", "eagle", "eagle3", "eagle_int8", "eagle+lookup"]
)
def test_proposers_reused_across_calls_stay_lossless(family: str) -> None:
    """Every family's proposers, kept from one call to the next (`proposers_for`), decode other prompts of
    other lengths exactly as batch-1 AR does: what a request leaves in a proposer is reset with the row."""
    from specdraft.eval.decode import ar_generate

    model = tiny_target("qwen2")
    factory = tiny_proposer_factory(family, model)
    dec = BatchDecoder(model, 2)
    for seed, lengths in ((1, [9, 4, 13]), (2, [3, 17, 6, 8])):
        prompts = random_prompts(lengths, seed=seed)
        out = [t for t, _ in dec.generate(prompts, 14, set(), factory)]
        assert out == [ar_generate(model, None, p, 14, stop_ids=set())[0] for p in prompts]
    assert dec.proposers_for(factory)[0] is dec.proposers_for(factory)[0]


@pytest.mark.parametrize("spec", [False, True], ids=["ar", "redrafter"])
def test_a_profiled_call_splits_its_time_into_phases(spec: bool) -> None:
    """`generate(profile=True)`: every phase of `PHASES` gets time, and together they account for the call's
    wall time (the laps cover it from start to the last step); outputs are unchanged."""
    model = tiny_target("llama")
    factory = tiny_proposer_factory("redrafter", model) if spec else None
    prompts = random_prompts([5, 8, 3, 6], seed=1)
    dec = BatchDecoder(model, 2)
    plain = [t for t, _ in dec.generate(prompts, 12, set(), factory)]
    out = dec.generate(prompts, 12, set(), factory, profile=True)
    assert [t for t, _ in out] == plain
    st = out[0][1].batch
    assert set(st.phase_s) == set(PHASES)
    assert all(v > 0 for k, v in st.phase_s.items() if k != "draft" or spec)
    assert 0.8 * st.time_s <= sum(st.phase_s.values()) <= st.time_s + 1e-6
    assert dec.generate(prompts, 12, set(), factory)[0][1].batch.phase_s == {}  # unprofiled: nothing


def test_print_phases_shows_the_profiled_records(capsys) -> None:
    """The phase table lists the records that carry `phase_ms_per_step` (others are skipped), with the time
    outside the verify over the verify and the speedup over AR if drafting were free."""
    from specdraft.eval.throughput import free_draft_speedup

    ph = {"prefill": 1.0, "draft": 2.0, "verify": 4.0, "accept": 0.5, "commit": 1.5}
    ar_ph = {"prefill": 1.0, "draft": 0.0, "verify": 3.0, "accept": 0.5, "commit": 0.5}
    rows = [
        {
            "bench": "toy",
            "batch": 4,
            "method": "ar",
            "phase_ms_per_step": ar_ph,
            "profiled_tokens_per_s": 8.0,
        },
        {"bench": "toy", "batch": 4, "method": "m", "phase_ms_per_step": ph, "profiled_tokens_per_s": 10.0},
        {"bench": "toy", "batch": 4, "method": "other"},
    ]
    assert free_draft_speedup(rows[1], rows[0]) == pytest.approx(10.0 * 9.0 / 7.0 / 8.0)  # 1.61x
    assert free_draft_speedup(rows[0], rows[0]) == pytest.approx(1.0)
    print_phases(rows)
    out = capsys.readouterr().out
    assert "1.00" in out and "1.61x" in out and "other" not in out  # (2 + 0.5 + 1.5) / 4 = 1.00 outside


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_timed_call_captures_a_graph_after_the_warm_up(monkeypatch) -> None:
    """On the graph path the warm-up captures every graph the timed calls replay: the verify at each tree
    size and the ReDrafter rows' draft step at each padded row count (rows finish one by one in both)."""
    import specdraft.eval.graphs as graphs

    events = _spy_on_the_decoder(monkeypatch)
    captures: list[int] = []
    real = graphs.capture_or_none

    def spy(*args: Any, **kwargs: Any):
        captures.append(len(events))
        return real(*args, **kwargs)

    monkeypatch.setattr(graphs, "capture_or_none", spy)
    model = tiny_target("llama").to("cuda")
    factory = tiny_proposer_factory("redrafter", model, static=True, graphs=True)
    prompts = random_prompts([4, 9, 6, 3, 5, 7, 8, 2], seed=3)
    rows = throughput_rows(
        model, "toy", prompts, [("ar", None), ("redrafter", factory)], [4], 10, set(), log=lambda _: None,
        cuda_graphs="on",
    )  # fmt: skip
    assert all(r["identical"] == len(prompts) for r in rows)
    calls = [i for i, (_, kind, _) in enumerate(events) if kind == "generate"]
    assert len(calls) == 4  # AR warm-up and timed, ReDrafter warm-up and timed
    owners = {max(c for c in calls if c < n) for n in captures}  # the call each capture happened in
    assert captures and owners <= {calls[0], calls[2]}  # the warm-ups only
