"""Benchmark probe rows: what the drafter would serve on the benchmark's own prompts, logged while it trains.

Held-out distilled rows come from the training prompts' distribution; served speedups are measured on MT-Bench.
The two can be far apart: a ReDrafter with the copy gate replayed 3.04 tokens/step on 8 held-out ShareGPT rows
and served 3.17 on them, but served 2.26 on 8 MT-Bench first turns (one per category; 1.84 on 8 "writing" ones)
with the same trees (docs/experiments.md, session 65). `train.eval_bench_rows=N` therefore also replays the
drafter on N benchmark questions (one per category in turn, `data.benchmarks.round_robin`): at the start of training the frozen target answers each
question's first turn greedily (`eval.decode.ar_generate`, the decoder's own AR), and every evaluation logs
`eval/bench_replay_accept_len` and `eval/bench_replay_steps` from `train.evaluate.replay_estimate` on those rows.
Only the prompts are the benchmark's; nothing trains on them.

The answers are cached in `<run_dir>/bench_rows.json` (atomic), keyed by the target's fingerprint, the benchmark,
the row count and the token count, so a resumed run does not generate them again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdraft.utils import atomic_write_json, sha256_text

__all__ = ["bench_rows", "probe_key"]


def probe_key(fingerprint: dict[str, Any], bench: str, n: int, max_new_tokens: int) -> str:
    """The cache key of a probe set: a hash of the target's fingerprint, the benchmark, the row and token counts."""
    return sha256_text(json.dumps([fingerprint, bench, n, max_new_tokens], sort_keys=True, default=str))[:16]


def bench_rows(
    target: torch.nn.Module,
    tokenizer: Any,
    bench: str,
    n: int,
    max_new_tokens: int,
    stop_ids: set[int],
    cache: Path | None = None,
    fingerprint: dict[str, Any] | None = None,
    write: bool = True,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """N benchmark questions' first turns answered greedily by the target, as rows `replay_estimate` reads.

    Args:
        target: the frozen target; tokenizer: its tokenizer (chat template).
        bench: a benchmark name (`mt_bench`, `alpaca_eval`) or a local file (`data.benchmarks.load_benchmark`).
        n: rows (one question per category in turn).
        max_new_tokens: tokens the target answers at most (a stop token ends an answer earlier).
        stop_ids: tokens that end an answer (`eval.decode.default_stop_ids`).
        cache: a JSON file holding the rows from an earlier call with the same key (None: no cache).
        fingerprint: the target's fingerprint for the cache key (`models.base_llm.target_fingerprint`).
        write: write the cache when the rows were generated (the main process; the others only read).
        progress: show a progress bar while the target answers.

    Returns:
        n rows: `input_ids` (L,) the templated prompt then the answer, `loss_mask` (L,) 1 on the answer.
    """
    from specdraft.data.benchmarks import first_turn_ids, load_benchmark
    from specdraft.eval.decode import ar_generate

    key = probe_key(fingerprint or {}, bench, n, max_new_tokens)
    if cache is not None and cache.is_file():
        held = json.loads(cache.read_text())
        if held.get("key") == key:
            return list(held["rows"])
    try:
        items = load_benchmark(bench, limit=n)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"train.eval_bench={bench!r}: {e}") from e
    rows = []
    was_training = target.training
    target.eval()
    try:
        with torch.no_grad():
            prompts = first_turn_ids(tokenizer, items)
            for ids in tqdm(prompts, desc=f"{bench} probe answers", disable=not progress, leave=False):
                answer, _ = ar_generate(target, None, ids, max_new_tokens, stop_ids=stop_ids)
                rows.append({"input_ids": ids + answer, "loss_mask": [0] * len(ids) + [1] * len(answer)})
    finally:
        target.train(was_training)
    if cache is not None and write:
        atomic_write_json(cache, {"key": key, "bench": bench, "rows": rows})
    return rows
