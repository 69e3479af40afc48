"""Length-grouped serving under a KV memory budget (S3, Jin et al. 2023) against FIFO under the same budget.

A per-row preallocated cache reserves prompt + reserved response tokens for each row. Knowing nothing of the
response lengths, FIFO must reserve the whole budget `max_new_tokens` for every row, so a KV budget of M
tokens buys it B = M // (longest prompt + max_new_tokens) rows, decoded with continuous batching. Knowing (a
bound on) each response's length, the length-aware scheduler packs requests by decreasing first fit
(`scheduler.first_fit_decreasing`) into groups with n_g * max(prompt + reserve in g) <= M, so short
requests run many to a batch, each group with its own batch size and a cache no longer than it needs:

    FIFO, M = 4 x 200     [4 rows x 200 tokens] ... every request, 4 at a time
    grouped               [2 rows x 200] long ones  |  [8 rows x 100] short ones  |  ...

A reserve can be too short (the predictor is wrong): the request stops at its reserve and is re-admitted
afterwards with its prompt + emitted tokens as the new prompt and the rest of its budget reserved exactly
(S3's preemption), so every output still equals its batch-1 greedy output (up to float ties), and sampled
outputs still follow the target's distribution (a continuation depends only on its prefix). Overflows are
counted; they cost a second prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdraft.eval.batch_decode import make_batch_decoder
from specdraft.eval.batch_width import WidthPolicy
from specdraft.eval.budget import CapPolicy
from specdraft.eval.decode import Proposer
from specdraft.eval.scheduler import first_fit_decreasing


@dataclass
class GroupedStats:
    """What one `serve_grouped` call (or any `BatchDecoder` calls, `add_call`) did."""

    groups: int = 0  # BatchDecoder calls (FIFO: 1)
    batch_sizes: list[int] = field(default_factory=list)  # rows of each call
    steps: int = 0  # batched verify forwards over all calls
    request_steps: int = 0  # steps each request took part in, summed over requests
    idle_row_steps: int = 0  # idle row slots summed over steps
    row_steps: int = 0  # rows * steps summed over calls
    new_tokens: int = 0  # emitted tokens of all requests
    overflows: int = 0  # requests that outgrew their reserve and were re-admitted
    peak_kv_tokens: int = 0  # largest rows * reserved tokens per row of any call (the budget check)
    time_s: float = 0.0  # wall time

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens of all requests per second."""
        return self.new_tokens / max(self.time_s, 1e-9)

    @property
    def row_utilisation(self) -> float:
        """1 - idle row slots / row slots, over all calls."""
        return 1.0 - self.idle_row_steps / max(self.row_steps, 1)


def fifo_rows(prompt_lens: Sequence[int], max_new_tokens: int, kv_budget: int) -> int:
    """Rows FIFO can afford: kv_budget // (longest prompt + max_new_tokens) (it must reserve the worst case).

    Raises:
        ValueError: not even one row fits.
    """
    worst = max(prompt_lens, default=0) + max_new_tokens
    if kv_budget < worst:
        raise ValueError(f"kv_budget={kv_budget} tokens is less than one row's worst case ({worst})")
    return kv_budget // worst


def add_call(stats: GroupedStats, out: list, rows: int, reserved: int) -> None:
    """Add one `BatchDecoder.generate` call's output (its batch stats; `rows` rows of `reserved` KV tokens
    each) to `stats`; time and new tokens are the caller's to set."""
    if not out:
        return
    b = out[0][1].batch
    stats.groups += 1
    stats.batch_sizes.append(rows)
    stats.steps += b.steps
    stats.request_steps += sum(st.steps for _, st in out)
    stats.idle_row_steps += b.idle_row_steps
    stats.row_steps += b.rows * b.steps
    stats.peak_kv_tokens = max(stats.peak_kv_tokens, rows * reserved)


def serve_grouped(
    model: torch.nn.Module,
    prompts: list[list[int]],
    reserve: Sequence[int],
    max_new_tokens: int,
    kv_budget: int,
    stop_ids: set[int],
    proposer_factory: Callable[[], Proposer] | None = None,
    max_batch: int | None = None,
    budget: CapPolicy | None = None,
    sample: dict[str, Any] | None = None,
    cuda_graphs: str = "auto",
    width: WidthPolicy | None = None,
) -> tuple[list[list[int]], GroupedStats]:
    """Decreasing-first-fit groups under `kv_budget`, each decoded as its own batch; overflows re-admitted.

    Args:
        model: the target.
        prompts: (N,) prompt ids.
        reserve: (N,) response tokens reserved per request (predicted bound, e.g.
            `LengthPredictor.reserve_length`; the measured lengths give the oracle); clamped to [1, max_new].
        max_new_tokens: the generation budget per request.
        kv_budget: KV tokens any one group may reserve (rows * longest prompt + reserve of the group).
        stop_ids: end tokens.
        proposer_factory: one proposer per row (None: AR).
        max_batch: most rows per group (None: no limit).
        budget: a node budget shared by every group (fitted or learnt at one batch size, usually FIFO's: an
            approximation for groups of other sizes; outputs never depend on it).
        sample: `BatchDecoder.generate` sampling keywords; None: greedy. A resumed overflow continues from
            its emitted prefix, so its tokens still follow the target's distribution.
        cuda_graphs: `eval.cuda_graphs` for each group's batch decoder (`batch_decode.make_batch_decoder`).
        width: instead of `budget`, a per-step width policy shared by every group (its cost curve is one batch
            size's, as for `budget`).

    Returns:
        (new tokens per request in request order, stats); each output equals the request's batch-1 greedy one.
    """
    if len(reserve) != len(prompts):
        raise ValueError(f"{len(reserve)} reserves for {len(prompts)} prompts")
    res = [min(max(int(r), 1), max_new_tokens) for r in reserve]
    outputs: list[list[int]] = [[] for _ in prompts]
    stats = GroupedStats()
    t0 = time.perf_counter()
    todo = list(range(len(prompts)))
    while todo:  # pass 1: the predicted reserves; pass 2: overflows, their exact remaining budgets
        heads = [prompts[i] + outputs[i] for i in todo]  # an overflow resumes from what it emitted
        left = [max_new_tokens - len(outputs[i]) for i in todo]
        want = [min(res[i], n) for i, n in zip(todo, left, strict=True)]
        groups = first_fit_decreasing([len(h) for h in heads], want, kv_budget, max_batch)
        again: list[int] = []
        for g in groups:
            reserved = max(len(heads[j]) + want[j] for j in g)
            out = make_batch_decoder(model, len(g), cuda_graphs).generate(
                [heads[j] for j in g],
                [want[j] for j in g],
                stop_ids,
                proposer_factory,
                budget=budget,
                width=width,
                **(sample or {}),
            )
            add_call(stats, out, len(g), reserved)
            for j, (toks, st) in zip(g, out, strict=True):
                i = todo[j]
                outputs[i] += toks
                if st.finish_reason == "length" and want[j] < left[j]:
                    again.append(i)  # outgrew its reserve: resume later with the rest reserved
        stats.overflows += len(again)
        todo = again
        res = [max_new_tokens] * len(prompts)  # re-admitted requests reserve their whole remaining budget
    stats.time_s = time.perf_counter() - t0
    stats.new_tokens = sum(len(t) for t in outputs)
    return outputs, stats
