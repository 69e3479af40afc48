"""Length-aware request scheduling for the batched decoder (S3-style), against FIFO.

Why the order matters in `BatchDecoder`: every batched step runs the target over all B rows, busy or idle.
Rows are refilled as soon as a request finishes, so rows go idle only once the queue is empty - the tail of
the call, where the last long request keeps the batch stepping with empty rows:

    FIFO    row 0  [a....][c.][e...........................]      <- e admitted late: long tail alone
            row 1  [b..........][d....]   idle    idle    idle
    longest row 0  [e...........................]
    first   row 1  [b..........][a....][d....][c.]   (short ones fill the gaps)

Admitting the longest predicted requests first (LPT, longest processing time first) packs the short ones
into the tail and cuts idle row-steps (`BatchStats.idle_row_steps`). With a KV memory budget, decreasing
first fit (`first_fit_decreasing`) also groups requests of similar predicted length into batches whose size
fits the budget: a group of n requests with the largest footprint s_0 = prompt + predicted length costs
n * s_0 <= budget tokens of a per-row preallocated cache.
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEDULERS = (
    "fifo",
    "length",
    "oracle",
    "groups",
    "oracle_groups",
)  # oracle*: the true lengths (an upper bound, measured after the fact); *groups: eval/grouped.py


def fifo_order(n: int) -> list[int]:
    """Requests in arrival order: [0, 1, ..., n-1]."""
    return list(range(n))


def longest_first(predicted: Sequence[float]) -> list[int]:
    """Request indices by decreasing predicted length (ties keep arrival order).

    Args:
        predicted: (N,) predicted response length (tokens) per request.

    Returns:
        a permutation of range(N).
    """
    return sorted(range(len(predicted)), key=lambda i: (-float(predicted[i]), i))


def first_fit_decreasing(
    prompt_lens: Sequence[int], predicted: Sequence[float], budget: int, max_batch: int | None = None
) -> list[list[int]]:
    """Pack requests into batches under a KV budget by decreasing first fit.

    Requests are taken by decreasing footprint s_i = prompt_i + predicted_i; each goes into the first open
    batch g where (|g| + 1) * max(s in g) <= budget (and |g| < max_batch), else opens a new batch. As items
    arrive in decreasing order, max(s in g) is the batch's first item, so batches hold similar lengths.

    Args:
        prompt_lens: (N,) prompt lengths.
        predicted: (N,) predicted response lengths.
        budget: KV tokens per batch (B * per-row capacity).
        max_batch: most requests per batch (None: no limit).

    Returns:
        batches of request indices; every request exactly once, each batch's indices by decreasing footprint,
        batches ordered by their largest footprint (decreasing).

    Raises:
        ValueError: a request alone exceeds the budget, lengths differ, or budget/max_batch < 1.
    """
    if len(prompt_lens) != len(predicted):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(predicted)} predictions")
    if budget < 1 or (max_batch is not None and max_batch < 1):
        raise ValueError(f"budget={budget}, max_batch={max_batch}: expected >= 1")
    size = [int(p) + int(round(float(q))) for p, q in zip(prompt_lens, predicted, strict=True)]
    batches: list[list[int]] = []
    for i in sorted(range(len(size)), key=lambda j: (-size[j], j)):
        if size[i] > budget:
            raise ValueError(
                f"request {i} needs {size[i]} KV tokens (prompt {prompt_lens[i]} + predicted "
                f"{float(predicted[i]):.0f}), more than the budget {budget}"
            )
        for g in batches:
            if (max_batch is None or len(g) < max_batch) and (len(g) + 1) * size[g[0]] <= budget:
                g.append(i)
                break
        else:
            batches.append([i])
    return batches


def schedule_order(
    scheduler: str,
    n: int,
    predicted: Sequence[float] | None = None,
    prompt_lens: Sequence[int] | None = None,
    budget: int | None = None,
) -> list[int]:
    """The admission order for `BatchDecoder.generate(order=...)`.

    Args:
        scheduler: `fifo` (arrival order) | `length` / `oracle` (decreasing `predicted`; with `budget`, the
            concatenated `first_fit_decreasing` batches).
        n: number of requests.
        predicted: (N,) lengths (predicted for `length`, measured for `oracle`).
        prompt_lens: (N,) prompt lengths (needed with `budget`).
        budget: optional KV budget in tokens.

    Returns:
        a permutation of range(n).
    """
    if scheduler == "fifo":
        return fifo_order(n)
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r}: expected one of {', '.join(SCHEDULERS)}")
    if predicted is None or len(predicted) != n:
        raise ValueError(f"scheduler={scheduler} needs one length per request ({n})")
    if budget is None:
        return longest_first(predicted)
    if prompt_lens is None:
        raise ValueError("a KV budget needs the prompt lengths")
    return [i for g in first_fit_decreasing(prompt_lens, predicted, budget) for i in g]
