"""Held-out evaluation of a drafter against the target's tokens, with a unigram baseline beside it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specdraft.models.base_llm import TargetOutput, forward_with_hidden
from specdraft.models.family import FamilySpec
from specdraft.models.losses import (
    IGNORE_INDEX,
    per_slot_ce,
    simulated_acceptance_length,
    topk_hits,
    unigram_hits,
)

if TYPE_CHECKING:
    from specdraft.eval.decode import Proposer
    from specdraft.eval.tree import DraftTree


class TargetFeatures:
    """Frozen-target features for batches, under `torch.no_grad()`, optionally memoised per row.

    With `cache=True` each row's hidden states (L, H) are computed once, by a forward over that row alone (so the
    values never depend on batch composition or padding, which keeps resumed runs exact), kept on the CPU in
    the target's dtype and reused in later epochs and evaluations. Cached distill/ features in the batch
    (`hidden`, and `hidden_layers` for the extra layers) are used as they are. Logits (online soft targets) are
    never memoised; extra layers (EAGLE-3) are memoised with the hidden states.
    """

    def __init__(self, target: Any, cache: bool = False, layers: tuple[int, ...] = ()) -> None:
        self.target, self.cache, self.layers = target, cache, tuple(layers)
        self.memo: dict[int, tuple[Tensor, Tensor | None]] = {}  # row index -> (hidden, layers)

    def __call__(self, batch: dict[str, Tensor], need_logits: bool = False) -> TargetOutput:
        """batch -> TargetOutput with hidden (B, L, H) (and logits (B, L, V) when `need_logits`)."""
        if "hidden" in batch and not need_logits and (not self.layers or "hidden_layers" in batch):
            # Cached by distill/: `hidden_layers` (B, L, m, H) already holds self.layers, in order.
            return TargetOutput(
                batch["hidden"].new_empty(0), batch["hidden"], batch.get("hidden_layers"), None
            )
        with torch.no_grad():
            if need_logits or not self.cache or "index" not in batch:
                return forward_with_hidden(
                    self.target,
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    layers=self.layers,
                    logits=need_logits,
                )
            ids, lens = batch["input_ids"], batch["attention_mask"].sum(1).tolist()
            rows = []
            for b, key in enumerate(batch["index"].tolist()):
                if key not in self.memo:
                    row = ids[b : b + 1, : lens[b]]  # (1, n)
                    out = forward_with_hidden(self.target, row, layers=self.layers, logits=False)
                    self.memo[key] = (
                        out.hidden[0].cpu(),
                        None if out.layers is None else out.layers[0].cpu(),
                    )
                rows.append(self.memo[key])  # (n, H), (n, m, H) | None
            hidden = ids.new_zeros((*ids.shape, rows[0][0].shape[-1]), dtype=rows[0][0].dtype)  # (B, L, H)
            layers = (
                None
                if rows[0][1] is None
                else ids.new_zeros((*ids.shape, *rows[0][1].shape[1:]), dtype=rows[0][1].dtype)
            )
            for b, (h, lay) in enumerate(rows):
                hidden[b, : h.shape[0]] = h.to(hidden.device)
                if layers is not None:
                    assert lay is not None  # every memoised row holds the same layers
                    layers[b, : lay.shape[0]] = lay.to(layers.device)  # (B, L, m, H)
            return TargetOutput(hidden.new_empty(0), hidden, layers, None)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    family: FamilySpec,
    features: TargetFeatures,
    batches: Any,
    opts: dict[str, Any],
    unigram_counts: Tensor,
    topk: int = 5,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Per-slot CE, top-1/top-k accuracy, simulated and chain acceptance length; the same for the unigram baseline.

    Acceptance estimates, each in tokens per step: `sim_accept_len` multiplies the per-slot top-1
    accuracies (independent slots, one chain); `chain_accept_len` counts each position's leading run of top-1
    hits (one greedy chain, measured); `tree_accept_len`, where the family declares `tree_accept` (Medusa), is
    what greedy verification of the decoder's own draft tree accepts at each position, and `tree_walk_len` the
    tokens/step of decoding each batch's first row with those counts (`row_walk`): the decoder starts a step
    only where the previous one ended, so it visits fewer positions of the easy stretches than an average over
    every position does.

    Args:
        model: the (unwrapped) drafter, switched to eval mode for the call.
        family: its family's declared contract (`compute_loss`).
        features: gives the frozen target's outputs for a batch.
        batches: iterable of collated batches on the model's device.
        opts: `compute_loss` options; `max_positions` is the fixed per-batch sample, `generator` is reseeded.
        unigram_counts: (V,) training label counts.
        topk: k of the top-k accuracy.
        max_batches: stop after this many batches (None: all).

    Returns:
        flat dict of floats keyed `eval/...` (slot k in `..._s{k}`).
    """
    was_training = model.training
    model.eval()
    sums: list[Tensor] = []  # ce * n, hits1, hitsk, unigram hits1, unigram hitsk, n: (D,) each
    lead_sum, tree_sum, rows = 0.0, 0.0, 0
    walk_tokens, walk_steps = 0, 0
    gen = torch.Generator().manual_seed(1234)  # the same positions at every evaluation
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        tout = features(batch, "kl" in opts.get("loss", "ce") and "topk_ids" not in batch)
        _, aux = family.compute_loss(model, batch, tout, {**opts, "generator": gen})
        logits, targets = aux["logits"], aux["targets"]  # (N, D, V), (N, D)
        ok = targets != IGNORE_INDEX  # (N, D)
        n = ok.sum(0).double()  # (D,)
        h1, hk = topk_hits(logits, targets, 1), topk_hits(logits, targets, topk)
        parts = (
            per_slot_ce(logits, targets).double() * n,
            h1.sum(0).double(),
            hk.sum(0).double(),
            unigram_hits(unigram_counts, targets, 1).sum(0).double(),
            unigram_hits(unigram_counts, targets, topk).sum(0).double(),
            n,
        )
        sums = [a + p.cpu() for a, p in zip(sums, parts)] if sums else [p.cpu() for p in parts]
        first = ok[:, 0]
        lead_sum += float(torch.cumprod((h1 & ok)[first].long(), dim=1).sum())
        if family.tree_accept is not None:  # the decoder's own tree on the same positions
            tree_sum += float(family.tree_accept(model, logits, targets)[first].sum())
            tokens, steps = row_walk(model, family, batch, tout, opts)  # and decoded along the first row
            walk_tokens, walk_steps = walk_tokens + tokens, walk_steps + steps
        rows += int(first.sum())
    if was_training:
        model.train()
    if not sums:
        return {}
    ce_sum, hits1, hitsk, uni1, unik, valid = sums
    denom = valid.clamp_min(1.0)
    acc1, acck, u1, uk = hits1 / denom, hitsk / denom, uni1 / denom, unik / denom
    out: dict[str, float] = {
        "eval/loss": float((ce_sum / denom).sum()),
        "eval/acc1_mean": float(acc1.mean()),
        f"eval/acc{topk}_mean": float(acck.mean()),
        "eval/sim_accept_len": simulated_acceptance_length(acc1),
        "eval/chain_accept_len": 1.0 + lead_sum / max(rows, 1),
        "eval/unigram_acc1_mean": float(u1.mean()),
        "eval/unigram_sim_accept_len": simulated_acceptance_length(u1),
        "eval/positions": float(rows),
    }
    if family.tree_accept is not None:
        out["eval/tree_accept_len"] = 1.0 + tree_sum / max(rows, 1)
        out["eval/tree_walk_len"] = walk_tokens / max(walk_steps, 1)
    for k in range(acc1.numel()):
        out[f"eval/acc1_s{k}"] = float(acc1[k])
        out[f"eval/acc{topk}_s{k}"] = float(acck[k])
        out[f"eval/unigram_acc1_s{k}"] = float(u1[k])
        out[f"eval/unigram_acc{topk}_s{k}"] = float(uk[k])
    return out


def walk(positions: list[int], accepted: list[int]) -> tuple[int, int]:
    """Greedy decoding along a row from per-position accepted drafts: a step at position t emits
    accepted[t] + 1 tokens (the drafts and the target's own token) and the next step starts at t + that.

    Args:
        positions: ascending row positions that train (a gap, e.g. between turns, restarts the walk at the next
            position); accepted: drafts accepted by a step starting at each of them.

    Returns:
        (tokens, steps) of the walk.
    """
    tokens = steps = j = 0
    while j < len(positions):
        emitted = accepted[j] + 1
        tokens, steps = tokens + emitted, steps + 1
        j = bisect.bisect_left(positions, positions[j] + emitted, lo=j + 1)
    return tokens, steps


def row_walk(
    model: torch.nn.Module,
    family: FamilySpec,
    batch: dict[str, Tensor],
    tout: TargetOutput,
    opts: dict[str, Any],
) -> tuple[int, int]:
    """`walk` along the batch's first row, every position of it, with `family.tree_accept`'s counts (one more
    `compute_loss` call over that row alone).

    Args:
        batch: a collated batch (B, L, ...); tout: the target's outputs for it (hidden (B, L, H)).

    Returns:
        (tokens, steps); (0, 0) for a row without positions.
    """
    assert family.tree_accept is not None  # the caller checked
    b = batch["pos_mask"].shape[0]
    one = {k: v[:1] if v.dim() and v.shape[0] == b else v for k, v in batch.items()}  # (1, L, ...)
    cut = TargetOutput(
        tout.logits[:1] if tout.logits.numel() else tout.logits,
        tout.hidden[:1],
        None if tout.layers is None else tout.layers[:1],
        None,
    )
    positions = one["pos_mask"][0].nonzero()[:, 0].tolist()  # (n,) the row's positions, ascending
    if not positions:
        return 0, 0
    _, aux = family.compute_loss(
        model, one, cut, {**opts, "max_positions": None}
    )  # the n positions, in order
    accepted = family.tree_accept(model, aux["logits"], aux["targets"]).tolist()  # (n,)
    return walk(positions, accepted)


# ---- simulated decoding with the decoder's own proposer (scripts/sim_vs_served.py) ---------------------------------
def greedy_accepted(tree: DraftTree, truth: Tensor) -> int:
    """Drafts greedy verification accepts from `tree` when the target's greedy continuation is known.

    Args:
        tree: a draft tree (N nodes, node 0 the root at depth 0).
        truth: (k,) the target's greedy tokens after the root: a depth-d node is right when its token is
            truth[d - 1] and its parent is right.

    Returns:
        the depth of the deepest right node (the accepted path's length, root excluded), at most k.
    """
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    truth_l = truth.tolist()
    depth, ok, best = [0] * len(tokens), [True] + [False] * (len(tokens) - 1), 0
    for i in range(1, len(tokens)):  # parents[i] < i: one pass in node order
        p = parents[i]
        depth[i] = depth[p] + 1
        ok[i] = ok[p] and depth[i] <= len(truth_l) and tokens[i] == truth_l[depth[i] - 1]
        best = max(best, depth[i]) if ok[i] else best
    return best


@torch.no_grad()
def replay_decode(
    proposer: Proposer,
    features: Tensor,
    tokens: Tensor,
    start: int,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """Simulated greedy speculative decoding of a row whose response is the target's greedy output.

    The decoder's loop with the target replaced by what the row already holds: the proposer (with its own
    tree/beam settings) drafts from the features of the committed positions, greedy verification accepts the
    deepest node matching the row (`greedy_accepted`), and the row supplies the bonus token. On a self-distilled
    greedy row this is the served decode up to floating-point ties, at the cost of drafting alone.

    Args:
        proposer: the decoder's proposer for the drafter (reset here).
        features: (L, F) target features of every row position as the decoder hands them to `propose`
            (the last layer, or `proposer.spec`'s layers; from one forward over the row).
        tokens: (L,) the row: the prompt tokens[:start], then the target's greedy response.
        start: first response position (tokens[start] is the first generated token, the first root).
        max_new_tokens: stop once this many tokens are emitted (as the decoder).
        stop_ids: tokens that end generation.

    Returns:
        accepted drafts per verification step (`DecodeStats.accepted`); tokens/step = mean + 1.
    """
    proposer.reset()
    n, r = int(tokens.shape[0]), start  # r: row position of the current root
    new_hidden, new_tokens = features[:start], tokens[1 : start + 1]  # (start, F), (start,)
    emitted, accepted = 1, []
    done = int(tokens[r]) in stop_ids or emitted >= max_new_tokens
    while not done and r + 1 < n:
        tree = proposer.propose(new_hidden, new_tokens)
        a = min(greedy_accepted(tree, tokens[r + 1 :]), n - r - 2)  # the bonus token must be in the row
        accepted.append(a)
        for tok in tokens[r + 1 : r + a + 2].tolist():  # a drafts + the bonus
            emitted += 1
            if tok in stop_ids or emitted >= max_new_tokens:
                done = True
                break
        new_hidden, new_tokens = features[r : r + a + 1], tokens[r + 1 : r + a + 2]  # (a + 1, F), (a + 1,)
        r += a + 1
    return accepted


def greedy_span(loss_mask: Sequence[int]) -> tuple[int, int] | None:
    """(start, end) of a distilled row's first response: the first run of trained positions.

    distill/ trains only the tokens it can vouch for: where the chat template's retokenised text stops matching
    the generated ids, the rest of the turn is masked, so ids[start:end] are the target's greedy tokens and
    whatever follows may not be. None for a row without trained positions.

    Args:
        loss_mask: (L,) 1 where the row trains.
    """
    mask = list(loss_mask)
    if 1 not in mask:
        return None
    start = mask.index(1)
    end = mask.index(0, start) if 0 in mask[start:] else len(mask)
    return start, end


def decoder_features(target: Any, ids: Tensor, layers: tuple[int, ...], keep_last: bool) -> Tensor:
    """Features of every position of a row as the decoder hands them to a proposer whose spec reads `layers`
    (`spec.feature_layers`) and keeps the last hidden state or not (`spec.keep_last_hidden`); the same layout as
    `eval.decode.target_forward`, from one forward over the row.

    Args:
        target: the frozen target; ids: (L,) token ids on its device.

    Returns:
        (L, F): the last hidden state (F = H) with no layers; else the layers flattened (F = m * H), after the
        last hidden state when `keep_last` (F = (1 + m) * H).
    """
    out = forward_with_hidden(target, ids[None], layers=layers, logits=False)
    hidden = out.hidden[0]  # (L, H)
    if not layers:
        return hidden
    assert out.layers is not None
    extra = out.layers[0].flatten(-2)  # (L, m*H)
    return torch.cat([hidden, extra], dim=-1) if keep_last else extra


@torch.no_grad()
def replay_estimate(
    model: torch.nn.Module,
    target: Any,
    rows: list[dict[str, Any]],
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    prefix: str = "eval/replay",
) -> dict[str, float]:
    """Tokens/step the decoder would serve on `rows`, simulated with the drafter's own proposer (`replay_decode`).

    The tree families' training-time estimate: the proposer `eval.proposers.make_proposer` builds for `model`
    (its own beam / tree settings, no node budget, the float products) drafts from one teacher-forced target
    forward over each row, and greedy verification is read off the row's first response (`greedy_span`). Exact
    for greedy self-distilled rows (the response is the target's greedy output; the caller checks that), except
    that where the span ends within a step's reach, drafts past its end are not counted (the decoder might
    accept them).

    Args:
        model: the (unwrapped) drafter, switched to eval mode for the call; its parameters' device and dtype
            receive the features.
        target: the frozen target.
        rows: distilled rows: `input_ids` (L,), `loss_mask` (L,) whose first 1 is the first response token.
        max_new_tokens: tokens decoded per row (at most its response).
        stop_ids: tokens that end generation (`eval.decode.default_stop_ids`).
        prefix: the metrics' name prefix (`eval/bench_replay` for `train.bench_probe`'s rows).

    Returns:
        `eval/replay_accept_len` (1 + mean accepted drafts per step) and `eval/replay_steps` (steps replayed),
        under `prefix`.
    """
    from specdraft.eval.proposers import make_proposer

    was_training = model.training
    model.eval()
    param = next(model.parameters())
    device = next(target.parameters()).device
    accepted: list[int] = []
    try:
        proposer = make_proposer(model)
        layers, keep_last = tuple(proposer.spec.feature_layers), bool(proposer.spec.keep_last_hidden)
        for row in rows:
            span = greedy_span(row["loss_mask"])
            if span is None:
                continue
            start, end = span  # ids[:start]: the templated prompt; ids[start:end]: greedy tokens
            ids = torch.as_tensor(row["input_ids"][:end], dtype=torch.long, device=device)  # (end,)
            feats = decoder_features(target, ids, layers, keep_last).to(param.device, param.dtype)  # (end, F)
            new = min(max_new_tokens, end - start)
            accepted += replay_decode(proposer, feats, ids.to(param.device), start, new, stop_ids)
    finally:
        model.train(was_training)
    return {
        f"{prefix}_accept_len": 1.0 + sum(accepted) / max(len(accepted), 1),
        f"{prefix}_steps": float(len(accepted)),
    }


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation of two equally long lists (nan with fewer than 2 points or no spread)."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} vs {len(ys)} values")
    if len(xs) < 2:
        return float("nan")
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else float("nan")
