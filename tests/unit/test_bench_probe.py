"""`train.bench_probe.bench_rows`: benchmark first turns answered greedily by the target, one per category in
turn, cached under a key that changes with the target, the benchmark and the counts."""

from __future__ import annotations

import json

import pytest
import torch

import specdraft.data.benchmarks as benchmarks
from specdraft.data.benchmarks import first_turn_ids, load_benchmark
from specdraft.eval.decode import ar_generate
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.bench_probe import bench_rows, probe_key


@pytest.fixture(scope="module")
def target_tok():
    torch.manual_seed(0)
    return tiny_llama(), tiny_tokenizer()


def test_rows_are_the_targets_greedy_answers_one_category_each(target_tok) -> None:
    target, tok = target_tok
    rows = bench_rows(target, tok, "mt_bench", 3, 6, set())
    items = load_benchmark("mt_bench", limit=3)
    assert len({i.category for i in items}) == 3  # writing, roleplay, reasoning
    for row, ids in zip(rows, first_turn_ids(tok, items), strict=True):
        answer, _ = ar_generate(target, None, ids, 6, stop_ids=set())
        assert row["input_ids"] == ids + answer
        assert row["loss_mask"] == [0] * len(ids) + [1] * len(answer)


def test_the_cache_is_read_under_its_key_only(target_tok, tmp_path, monkeypatch) -> None:
    target, tok = target_tok
    cache, fp = tmp_path / "bench_rows.json", {"hash": "a"}
    first = bench_rows(target, tok, "mt_bench", 2, 4, set(), cache, fp)
    assert json.loads(cache.read_text())["key"] == probe_key(fp, "mt_bench", 2, 4)
    calls: list[tuple] = []
    orig = benchmarks.load_benchmark  # bench_rows imports it at call time
    monkeypatch.setattr(benchmarks, "load_benchmark", lambda *a, **k: calls.append(a) or orig(*a, **k))
    assert bench_rows(target, tok, "mt_bench", 2, 4, set(), cache, fp) == first and not calls  # read back
    other = bench_rows(target, tok, "mt_bench", 2, 4, set(), cache, {"hash": "b"})  # another target
    assert calls and other == first  # regenerated (same model, so the same rows), and rewritten
    assert json.loads(cache.read_text())["key"] == probe_key({"hash": "b"}, "mt_bench", 2, 4)
    bench_rows(target, tok, "mt_bench", 2, 4, set(), cache, {"hash": "c"}, write=False)
    assert json.loads(cache.read_text())["key"] == probe_key({"hash": "b"}, "mt_bench", 2, 4)  # not written


def test_a_bad_benchmark_names_the_field(target_tok, tmp_path) -> None:
    target, tok = target_tok
    with pytest.raises(ValueError, match=r"train.eval_bench='.*nope.jsonl'"):
        bench_rows(target, tok, str(tmp_path / "nope.jsonl"), 2, 4, set())
