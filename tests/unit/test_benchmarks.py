"""Benchmark loaders: the shipped MT-Bench / AlpacaEval copies and arbitrary files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from specdraft.data.benchmarks import load_benchmark


def test_mt_bench_shape() -> None:
    items = load_benchmark("mt_bench")
    assert len(items) == 80
    assert Counter(i.category for i in items) == {
        c: 10
        for c in ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    }
    assert all(len(i.turns) == 2 for i in items)


def test_alpaca_eval_shape() -> None:
    items = load_benchmark("alpaca_eval")
    assert len(items) == 805
    assert set(Counter(i.category for i in items)) == {
        "helpful_base",
        "koala",
        "oasst",
        "selfinstruct",
        "vicuna",
    }
    assert all(len(i.turns) == 1 for i in items)


def test_limit_covers_every_category() -> None:
    items = load_benchmark("mt_bench", limit=8)
    assert len({i.category for i in items}) == 8


def test_local_file_and_bad_rows(tmp_path: Path) -> None:
    p = tmp_path / "b.jsonl"
    p.write_text(
        json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]})
        + "\n"
        + json.dumps({"instruction": "do", "dataset": "y"})
        + "\n"
    )
    items = load_benchmark(str(p))
    assert [(i.id, i.category, i.turns) for i in items] == [("1", "x", ["a", "b"]), ("1", "y", ["do"])]
    p.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"b\.jsonl: row 0"):
        load_benchmark(str(p))
    with pytest.raises(FileNotFoundError):
        load_benchmark("nope")
