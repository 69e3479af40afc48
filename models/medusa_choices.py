"""Medusa's static draft tree as rank paths, and how much of it greedy verification accepts.

A path (r_0, .., r_{d-1}) is the node at depth d whose token is head d-1's rank-r_{d-1} candidate, under the node
(r_0, .., r_{d-2}); the root (the committed token) is the empty path. This module holds the tree's *shape* (the
default tree, validation, pruning to fewer heads / ranks / nodes, node arrays), shared by the decoder's proposer
(`eval/medusa_tree.py`) and training-time evaluation, which measures the tree the decoder will serve:

    accepted drafts at position t = the deepest d such that (rank of label_{t+1+j} under head j, j < d) is a path

Medusa's heads read only h_t (and the root token x_{t+1}, known before they run), so from the teacher-forced head
logits of a held-out position this is exactly what greedy verification of the static tree accepts there
(`tree_accepted`), up to ties between logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100  # a label that does not train (past the row's end)

# Medusa's default tree for 4 heads x top-10 (`mc_sim_7b_63` in FasterDecoding/Medusa medusa_choices.py, tuned for
# Vicuna-7B): 63 nodes + root. For another target, build one from measured accuracies (scripts/build_medusa_tree.py).
DEFAULT_TREE: list[tuple[int, ...]] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
]  # fmt: skip


# ---- tree shapes ----------------------------------------------------------------------------------------------
def check_tree(
    choices: Sequence[Sequence[int]], num_heads: int, what: str = "Medusa tree"
) -> list[tuple[int, ...]]:
    """Validate rank paths and return them in their given (importance) order, each after its parent (a
    parent listed later moves up to just before its first child), so cutting the first nodes of the tree
    (`DraftTree.truncated`: the decoder's node budget) keeps the most valuable ones.

    Raises:
        ValueError: naming the offending path (empty, negative rank, deeper than the heads, duplicate,
            or missing its parent path).
    """
    paths = [tuple(int(r) for r in p) for p in choices]
    seen = set(paths)
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"{what}: path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > num_heads:
            raise ValueError(
                f"{what}: path {list(p)} has depth {len(p)} but the drafter has {num_heads} heads"
            )
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"{what}: path {list(p)} has no parent path {list(p[:-1])}")
    if len(seen) != len(paths):
        raise ValueError(f"{what}: duplicate paths")
    ordered: list[tuple[int, ...]] = []
    placed: set[tuple[int, ...]] = {()}
    for p in paths:
        missing = [p[:i] for i in range(1, len(p) + 1) if p[:i] not in placed]  # ancestors first, then p
        ordered.extend(missing)
        placed.update(missing)
    return ordered


def prune_tree(
    choices: Sequence[Sequence[int]], num_heads: int, topk: int, max_nodes: int | None = None
) -> list[tuple[int, ...]]:
    """Fit a tree to fewer heads / candidates / nodes: keep, in list order, the paths within depth
    `num_heads` and ranks < `topk` whose parent was kept, until `max_nodes` nodes (root included).

    Returns:
        rank paths in list (importance) order, parents first (a valid tree for `check_tree`).
    """
    kept: list[tuple[int, ...]] = []
    have: set[tuple[int, ...]] = {()}
    for p in map(tuple, choices):
        if max_nodes is not None and len(kept) + 1 >= max_nodes:
            break
        if 0 < len(p) <= num_heads and max(p) < topk and p[:-1] in have and p not in have:
            kept.append(p)
            have.add(p)
    return kept


def tree_layout(paths: Sequence[tuple[int, ...]]) -> tuple[Tensor, Tensor, Tensor]:
    """Node arrays of a tree whose paths list parents first (node 0 = root, node i = paths[i-1]).

    Returns:
        parents (N,) long (parents[0] = -1), head (N,) long (depth - 1; -1 at the root),
        rank (N,) long (0 at the root).
    """
    index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
    parents = torch.tensor([-1] + [index[p[:-1]] for p in paths], dtype=torch.long)
    head = torch.tensor([-1] + [len(p) - 1 for p in paths], dtype=torch.long)
    rank = torch.tensor([0] + [p[-1] for p in paths], dtype=torch.long)
    return parents, head, rank


def resolve_paths(
    given: Sequence[Sequence[int]] | None, num_heads: int, topk: int, max_nodes: int | None = None
) -> list[tuple[int, ...]]:
    """The tree a Medusa drafts: `given` rank paths (an export's `tree_choices`; validated, cut to `max_nodes`
    in their importance order) or, when None/empty, `DEFAULT_TREE` pruned to `num_heads` heads, ranks < `topk`
    and `max_nodes` nodes (root included)."""
    if given:
        paths = check_tree(given, num_heads)
        if max_nodes is not None:  # keep the first paths in the given (importance) order
            paths = prune_tree(given, num_heads, 1 << 30, max_nodes)
        return paths
    return prune_tree(DEFAULT_TREE, num_heads, topk, max_nodes)


# ---- greedy acceptance of the static tree from label ranks ------------------------------------------------------
def label_ranks(logits: Tensor, targets: Tensor, chunk: int = 64) -> Tensor:
    """Rank of each slot's label among that slot's logits: how many tokens score strictly higher.

    Args:
        logits: (N, D, V) head logits (a token outside a reduced draft vocabulary at -inf).
        targets: (N, D) long label ids, `IGNORE_INDEX` where the slot does not train.
        chunk: positions compared at a time.

    Returns:
        (N, D) long ranks; V (never in a tree) for ignored labels and labels scored -inf.
    """
    label = logits.gather(-1, targets.clamp_min(0)[..., None])  # (N, D, 1) in the logits' own dtype
    ranks = torch.cat(  # (N, D); compared in chunks of positions: a (chunk, D, V) bool buffer at a time
        [(logits[i : i + chunk] > label[i : i + chunk]).sum(-1) for i in range(0, logits.shape[0], chunk)]
        or [targets.new_zeros((0, targets.shape[1]))]
    )
    miss = (targets == IGNORE_INDEX) | torch.isneginf(label[..., 0])
    return ranks.masked_fill(miss, logits.shape[-1])


def tree_accepted(ranks: Tensor, paths: Sequence[Sequence[int]]) -> Tensor:
    """Drafts greedy verification accepts from a static tree when head j's label has rank `ranks[:, j]`.

    A node (r_0, .., r_{d-1}) is right when every r_j equals the label's rank under head j; siblings carry
    distinct tokens, so at most one node per depth is right and the accepted path is the deepest right node.

    Args:
        ranks: (N, D) long label ranks (`label_ranks`); a head the tree does not reach is never read.
        paths: the tree's rank paths, parents first (`check_tree` / `prune_tree` order).

    Returns:
        (N,) long accepted drafts per position (the bonus token excluded), in [0, tree depth].
    """
    n = ranks.shape[0]
    right: dict[tuple[int, ...], Tensor] = {(): torch.ones(n, dtype=torch.bool, device=ranks.device)}
    best = torch.zeros(n, dtype=torch.long, device=ranks.device)
    for p in map(tuple, paths):
        ok = right[p[:-1]] & (ranks[:, len(p) - 1] == p[-1])  # (N,)
        right[p] = ok
        best = torch.where(ok, torch.full_like(best, len(p)), best)  # deeper paths come after their parents
    return best


def teacher_forced_tree_accept(model: Any, logits: Tensor, targets: Tensor) -> Tensor:
    """`FamilySpec.tree_accept` for Medusa: drafts accepted per held-out position by the tree the decoder serves
    (the export's `tree_choices`, else `DEFAULT_TREE` pruned to the heads and `config.topk`), whole.

    Args:
        model: the (possibly accelerate-wrapped) Medusa.
        logits: (N, D, V) teacher-forced head logits in target ids (evaluation mode); targets: (N, D) label ids.

    Returns:
        (N,) long accepted drafts; heads beyond D are not judged (paths are cut to D).
    """
    cfg = getattr(model, "module", model).config
    heads = min(int(cfg.draft_len), logits.shape[1])
    paths = resolve_paths(getattr(cfg, "tree_choices", None), int(cfg.draft_len), int(cfg.topk))
    paths = [p for p in paths if len(p) <= heads]  # parents first still holds
    return tree_accepted(label_ranks(logits[:, :heads], targets[:, :heads]), paths)
