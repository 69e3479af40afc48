"""Benchmark prompts: MT-Bench (80 questions, 8 categories, 2 turns) and AlpacaEval (805 instructions).

The project ships copies in `data/benchmarks/`; any local .jsonl/.json file or Hub dataset id with the
same columns works too. MT-Bench's second turn is asked after the model's *own* first answer, so items
carry all their turns and the decoder feeds them one by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdraft.utils import hub_errors, local_or_hub

BUILTIN = {"mt_bench": "mt_bench_question.jsonl", "alpaca_eval": "alpaca_eval.jsonl"}


@dataclass
class BenchmarkItem:
    """One benchmark prompt: `turns` are user messages asked in order (MT-Bench has 2)."""

    id: str
    category: str
    turns: list[str]


def builtin_path(name: str) -> Path:
    """Path of a benchmark file shipped with specdraft (`mt_bench` or `alpaca_eval`)."""
    return Path(str(resources.files("specdraft.data").joinpath("benchmarks", BUILTIN[name])))


def _item(row: dict[str, Any], index: int, source: str) -> BenchmarkItem:
    if "turns" in row:  # MT-Bench
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{source}: row {index}: `turns` must be a non-empty list of strings")
        return BenchmarkItem(str(row.get("question_id", index)), str(row.get("category", "all")), list(turns))
    if "instruction" in row:  # AlpacaEval
        text = row["instruction"]
        if row.get("input"):
            text = f"{text}\n\n{row['input']}"
        return BenchmarkItem(
            str(row.get("id", index)), str(row.get("dataset", row.get("category", "all"))), [text]
        )
    if "prompt" in row:
        return BenchmarkItem(str(row.get("id", index)), str(row.get("category", "all")), [str(row["prompt"])])
    raise ValueError(
        f"{source}: row {index} has none of `turns` (MT-Bench), `instruction` (AlpacaEval), `prompt`"
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from e
        return rows
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of benchmark rows")
    return data


def load_benchmark(name_or_path: str, limit: int | None = None, split: str = "train") -> list[BenchmarkItem]:
    """Load benchmark items.

    Args:
        name_or_path: `mt_bench`, `alpaca_eval`, a .jsonl/.json file, or a Hub dataset id (an `eval.benches`
            entry).
        limit: keep `limit` items, taken round-robin over categories so a small subset still covers
            every category (None: all).
        split: split of a Hub dataset.

    Raises:
        FileNotFoundError: a missing local file, or a Hub dataset that cannot be fetched.
        ValueError: a malformed file or row.
    """
    if name_or_path in BUILTIN:
        path = builtin_path(name_or_path)
    else:
        expect = f".jsonl/.json file, one of {list(BUILTIN)},"
        path = Path(local_or_hub(name_or_path, "eval.benches", expect))
    if path.exists():
        rows = _read_rows(path)
        source = str(path)
    else:
        import datasets

        with hub_errors("eval.benches", name_or_path):
            rows = list(datasets.load_dataset(name_or_path, split=split))
        source = name_or_path
    items = [_item(r, i, source) for i, r in enumerate(rows)]
    if limit is None or limit >= len(items):
        return items
    return round_robin(items, limit)


def first_turn_ids(tokenizer: Any, items: list[BenchmarkItem]) -> list[list[int]]:
    """Each item's first user turn as chat-templated prompt ids (the throughput table's and the benchmark
    scripts' requests, the warm-up prompts)."""
    from specdraft.data.chat import prompt_ids

    return [prompt_ids(tokenizer, [{"role": "user", "content": i.turns[0]}]) for i in items]


def round_robin(items: list[BenchmarkItem], limit: int) -> list[BenchmarkItem]:
    """The first `limit` items taking one per category in turn (category order = first appearance)."""
    by_cat: dict[str, list[BenchmarkItem]] = {}
    for it in items:
        by_cat.setdefault(it.category, []).append(it)
    out: list[BenchmarkItem] = []
    depth = 0
    while len(out) < limit:
        for cat_items in by_cat.values():
            if depth < len(cat_items) and len(out) < limit:
                out.append(cat_items[depth])
        depth += 1
    return out
