"""Acceptance rules for tree verification (batch size 1, one target forward over N tree nodes).

Inputs: a `DraftTree` and the target's logits at every node, `logits[i]` = the target's next-token
distribution after the root->i path. Output: the accepted path (node indices, root first) and the
target's own next token after it (the *bonus* token). tokens/step = len(path) - 1 + 1.

Greedy (temperature 0)
    Child c of node u is accepted iff `c.token == argmax(logits[u])`, and a node counts only if every
    node on its path is accepted. The deepest accepted node wins (ties: lowest index); the bonus is
    `argmax(logits[best])`. Output == greedy AR output token for token (up to float ties).

Sampling (temperature > 0): recursive rejection with deterministic candidates
    The candidates come from beam search, i.e. the draft "distribution" of each child is a point mass,
    so no draft probabilities are needed. Let p_u = warp(softmax(logits[u] / T)) (top-k / top-p applied
    the same way as in the AR baseline). Starting at the root, at node u visit its children c_1..c_k in
    index order and keep a working copy p' = p_u:
        accept c_j with probability p'(c_j)                 -> move to c_j, repeat there;
        on rejection set p'(c_j) = 0 and renormalise p'     -> try c_{j+1};
    if every child is rejected (or u is a leaf) emit the bonus x ~ p' (the residual) and stop.
    Child c_j is reached and accepted with probability prod_{l<j}(1 - p'_l) * p'(c_j) = p_u(c_j), and
    the residual covers exactly the non-children, so each emitted token is distributed as p_u: the
    output has the target's distribution exactly (duplicate sibling tokens get p' = 0 and never win).
    Vectorised: every non-root node i gets its own uniform; with m_i the p_u-mass of the *distinct*
    earlier siblings, i passes iff u_i < p_u(c_i) / (1 - m_i); a node is *selected* iff it passes and
    no earlier sibling passes - identical in law to the sequential procedure because later siblings'
    uniforms are only looked at after all earlier ones failed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdraft.eval.tree import DraftTree


def warp_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Sampling distribution from logits: temperature, then top-k, then top-p (nucleus).

    Args:
        logits: (..., V).
        temperature: > 0.
        top_k: keep the k largest logits (0: all).
        top_p: keep the smallest set of tokens with cumulative probability >= top_p (1.0: all).

    Returns:
        (..., V) float32 probabilities.
    """
    x = logits.float() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)  # (..., V)
        drop_sorted = cum - sorted_x.softmax(-1) >= top_p  # mass before this token already >= top_p
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def _best_path(tree: DraftTree, ok: Tensor) -> tuple[Tensor, int]:
    """Deepest node whose whole path is `ok`; returns (path (a,) long, node index)."""
    assert tree.ancestors is not None and tree.depth is not None  # set in DraftTree.__post_init__
    accepted = ~(tree.ancestors & ~ok[None, :]).any(1)  # (N,) every ancestor ok
    score = torch.where(accepted, tree.depth, torch.full_like(tree.depth, -1))
    best = int(score.argmax())  # first maximum
    return tree.ancestors[best].nonzero().squeeze(1), best


def greedy_verify(tree: DraftTree, logits: Tensor) -> tuple[Tensor, int]:
    """Longest path of exact argmax matches + the target's argmax after it.

    Args:
        tree: N nodes.
        logits: (N, V) target logits at every node.

    Returns:
        path: (a,) long node indices, root first; `a - 1` drafts accepted.
        bonus: the target's next token after the path.
    """
    top = logits.float().argmax(
        -1
    )  # (N,); fp32 copy: exact, and CPU argmax over many bf16 rows is ~10x slower
    ok = tree.tokens == top[tree.parents.clamp(min=0)]  # (N,) node matches its parent's argmax
    ok[0] = True
    path, best = _best_path(tree, ok)
    return path, int(top[best])


def sample_verify(
    tree: DraftTree,
    logits: Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int]:
    """Recursive rejection over deterministic children (see module docstring); lossless for T > 0.

    Args:
        tree: N nodes.
        logits: (N, V) target logits at every node.
        temperature, top_k, top_p: the target's sampling distribution (same as the AR baseline).
        generator: RNG (on the logits' device).

    Returns:
        path: (a,) long node indices, root first.
        bonus: token sampled from the residual at the last accepted node.
    """
    n = tree.num_nodes
    probs = warp_probs(logits, temperature, top_k, top_p)  # (N, V)
    parents, tokens = tree.parents, tree.tokens
    p_tok = probs[parents.clamp(min=0), tokens]  # (N,) p_parent(token)
    idx = torch.arange(n, device=tokens.device)
    earlier_sib = (parents[:, None] == parents[None, :]) & (idx[None, :] < idx[:, None])  # (N, N)
    dup = (earlier_sib & (tokens[:, None] == tokens[None, :])).any(1)  # (N,) repeats an earlier sibling
    mass_before = (earlier_sib & ~dup[None, :]).to(p_tok.dtype) @ p_tok  # (N,) rejected sibling mass
    ratio = (p_tok / (1.0 - mass_before).clamp_min(1e-12)).clamp(max=1.0)  # (N,) p'(c)
    u = torch.rand(n, generator=generator, device=probs.device)
    passes = ~dup & (u < ratio)  # (N,)
    passes[0] = True
    selected = passes & ~(earlier_sib & passes[None, :]).any(1)  # first passing sibling only
    path, last = _best_path(tree, selected)
    residual = probs[last].clone()  # (V,)
    residual[tokens[parents == last]] = 0.0  # every child of `last` was rejected
    if float(residual.sum()) <= 0.0:  # numerically all mass on rejected children
        residual = probs[last]
    bonus = int(torch.multinomial(residual, 1, generator=generator))
    return path, bonus


def sample_token(
    logits: Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token from (V,) logits: argmax when `temperature == 0`, else a draw from `warp_probs`."""
    if temperature <= 0.0:
        return int(logits.float().argmax(-1))
    return int(torch.multinomial(warp_probs(logits, temperature, top_k, top_p), 1, generator=generator))


def greedy_verify_packed(
    tokens: Tensor,
    parents: Tensor,
    ancestors: Tensor,
    depth: Tensor,
    logits: Tensor,
    valid: Tensor | None = None,
    prefix_accept: bool = False,
) -> Tensor:
    """`greedy_verify` with fixed shapes and no host sync: everything the decoder needs in one tensor.

    `greedy_verify_rows` for one tree: the same arguments without their leading B dimension (tokens,
    parents, depth, valid (b,); ancestors (b, b); logits (b, V)) and the same rule. The path comes back
    padded to b entries with the identity (slot k holds k for k >= a), the form `StaticKVCache.commit` takes.

    Returns:
        (2 + 2b,) long: [a, bonus, path (b,), tokens[path] (b,)], `a` nodes accepted (root included),
        followed by (b,) accepted-with-the-first-k-nodes counts when `prefix_accept`.
    """
    rows = greedy_verify_rows(
        tokens[None], parents[None], ancestors[None], depth[None], logits[None],
        None if valid is None else valid[None], prefix_accept,
    )  # fmt: skip
    return rows[0]


def greedy_verify_host(
    tokens: list[int],
    parents: list[int],
    depth: list[int],
    top: list[int],
    valid: list[bool] | None = None,
    prefix_accept: bool = False,
) -> list[int]:
    """`greedy_verify_packed(...).tolist()` computed on the host from the target's argmax at every node: the same
    rule and the same packed row, for a CPU decode where a small tree's ~15 tensor ops cost more than the rule
    (0.1-0.2 ms a step against ~20 us here).

    Args:
        tokens, parents, depth: (b,) node tokens, parents (-1 at the root) and depths of the tree.
        top: (b,) the target's argmax at every node (`logits.argmax(-1)`).
        valid: (b,) real nodes (None: all); padding is never accepted.
        prefix_accept: also the accepted-with-the-first-k-nodes counts (`greedy_verify_rows`).

    Returns:
        [a, bonus, path (b,), tokens[path] (b,)] (+ (b,) prefix counts), as `greedy_verify_packed`.
    """
    b = len(tokens)
    accepted = [False] * b
    for i in sorted(range(b), key=depth.__getitem__):  # parents before children
        p = parents[i]
        ok = i == 0 or (tokens[i] == top[p] and (valid is None or bool(valid[i])))
        accepted[i] = ok and (p < 0 or accepted[p])
    score = [depth[i] if accepted[i] else -1 for i in range(b)]
    best = max(range(b), key=lambda i: (score[i], -i))  # the first deepest accepted node
    on_path, i = set(), best
    while i >= 0:
        on_path.add(i)
        i = parents[i]
    path = sorted(on_path)  # in node order, as the packed path
    path += list(range(len(path), b))  # padded with the identity
    out = [depth[best] + 1, top[best], *path, *(tokens[j] for j in path)]
    if prefix_accept:
        run = -1
        for s in score:
            run = max(run, s)
            out.append(run + 1)
    return out


def greedy_verify_rows(
    tokens: Tensor,
    parents: Tensor,
    ancestors: Tensor,
    depth: Tensor,
    logits: Tensor,
    valid: Tensor | None = None,
    prefix_accept: bool = False,
) -> Tensor:
    """`greedy_verify` for B padded trees at once, with fixed shapes and no host sync: one packed row each.

    Same rule as `greedy_verify` (deepest fully matched node, ties to the lowest index). Padding nodes
    (`valid` False) are never accepted. Each path comes back padded to b entries with the identity (slot k
    holds k for k >= a), the form `StaticKVCache.commit` and `BatchKVCache.commit` take.

    Args:
        tokens: (B, b) long node tokens, node 0 the root.
        parents: (B, b) long, `parents[:, 0] == -1`.
        ancestors: (B, b, b) bool ancestor-or-self matrices.
        depth: (B, b) long.
        logits: (B, b, V) target logits at every node.
        valid: (B, b) bool real nodes (None: all).
        prefix_accept: also return, for every k, the nodes the first k nodes alone would have accepted
            (the gain curve of `eval.budget`).

    Returns:
        (B, 2 + 2b) long rows [a, bonus, path (b,), tokens[path] (b,)], `a` nodes accepted (root included),
        each followed by (b,) accepted-with-the-first-k-nodes counts when `prefix_accept`.
    """
    B, b = tokens.shape
    top = logits.float().argmax(-1)  # (B, b)
    ok = tokens == top.gather(1, parents.clamp(min=0))  # (B, b) node matches its parent's argmax
    if valid is not None:
        ok = ok & valid
    ok[:, 0] = True
    accepted = ~(ancestors & ~ok[:, None, :]).any(2)  # (B, b) every ancestor ok
    score = torch.where(accepted, depth, torch.full_like(depth, -1))  # (B, b)
    best = score.argmax(1, keepdim=True)  # (B, 1) first deepest
    row = ancestors.gather(1, best[:, :, None].expand(B, 1, b))[:, 0]  # (B, b) nodes on the root->best path
    idx = torch.arange(b, device=tokens.device).expand(B, b)  # (B, b)
    slot = torch.where(row, row.long().cumsum(1) - 1, b)  # (B, b) path position; others -> trash slot b
    path = torch.arange(b + 1, device=tokens.device).repeat(B, 1).scatter(1, slot, idx)[:, :b]  # (B, b)
    parts = [depth.gather(1, best) + 1, top.gather(1, best), path, tokens.gather(1, path)]
    if prefix_accept:  # (B, b) deepest accepted node among the first k, + 1
        parts.append(torch.cummax(score, 1).values + 1)
    return torch.cat(parts, 1)
