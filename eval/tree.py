"""Draft trees for tree attention: structure, masks, position ids, paths, and beam packing.

A `DraftTree` is a flat list of N candidate tokens with parent pointers (`parents[i] < i`, node 0 is the
root = the token the target has already committed but whose K/V is not in the cache yet). Verification
runs the N nodes through the target in one forward: each node sees the whole cached prefix plus its own
ancestors (itself included), at position `prefix_len + depth`.

ReDrafter's beam search returns W beams of length 1+D that share prefixes (all share the root).
`dedup_prefix` packs them into a compact tree with tensor ops only (arXiv 2403.09919, Appendix A.1):
beam w's prefix of length d+1 is mapped to the first beam w' that has the same prefix, and only the
(w, d) pairs with w' == w become nodes. No Python trie, no per-node loop.

Example, W=3, 1+D=3 (root r):

    beams   r a b        tree   r(0) ─ a(1) ─ b(2)
            r a c                      │      └ c(3)
            r d b                      └ d(4) ─ b(5)        9 beam tokens -> 6 nodes (1.5x)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

PAD = -1  # right padding of shorter beams in `pack_beams`


@dataclass(frozen=True)
class ProposerSpec:
    """What a proposer declares to the decoder (read, never probed; design.md "Decoder contract")."""

    feature_layers: tuple[int, ...] = ()  # target hidden_states indices read per position (): last layer
    keep_last_hidden: bool = False  # with feature_layers: pass the last layer first, then those (ReDrafter)
    max_depth: int = 0  # deepest draft node, the acceptance-rate unit (0: not declared)
    node_budget: int = 0  # most nodes one tree can hold, root included (0: not declared)


@dataclass
class DraftTree:
    """Candidate tree for one verification forward (batch size 1).

    Args:
        tokens: (N,) long; node 0 is the root.
        parents: (N,) long; `parents[0] == -1`, `parents[i] < i`.
        depth: (N,) long, root depth 0 (computed from `parents` when omitted).
        ancestors: (N, N) bool, `ancestors[i, j]` = node j is on the root->i path, i included
            (computed from `parents` when omitted).
        beam_nodes: (W, 1+D) long, node index of each beam position when the tree was packed from beams.
        scores: (N,) float, the drafter's cumulative probability of each node (product along the root path,
            root 1.0), where the proposer reports one (None: not reported); read by `eval.adaptive`.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor | None = None
    ancestors: Tensor | None = None
    beam_nodes: Tensor | None = field(default=None, repr=False)
    scores: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"DraftTree: tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} "
                "must both be (N,)"
            )
        if self.ancestors is None or self.depth is None:
            self.ancestors, self.depth = ancestor_matrix(self.parents)

    @property
    def num_nodes(self) -> int:
        """N, the number of tree nodes (root included)."""
        return self.tokens.shape[0]

    def truncated(self, b: int) -> DraftTree:
        """The subtree of the first b nodes (a valid tree: `parents[i] < i`); proposers order nodes best
        first (beam rank, EAGLE-2 score, Medusa accuracy), so this is the tree a smaller budget would draft."""
        if b >= self.num_nodes:
            return self
        assert self.ancestors is not None and self.depth is not None
        scores = None if self.scores is None else self.scores[:b]
        return DraftTree(
            self.tokens[:b], self.parents[:b], self.depth[:b], self.ancestors[:b, :b], scores=scores
        )

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree with every tensor on `device`."""
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return DraftTree(
            self.tokens.to(device),
            self.parents.to(device),
            mv(self.depth),
            mv(self.ancestors),
            mv(self.beam_nodes),
            mv(self.scores),
        )


def reorder_tree(tree: DraftTree, order: list[int] | Tensor) -> DraftTree:
    """The nodes `order` of `tree` (old indices, every node listed after its parent, root first), renumbered
    in that order: a subset closed under ancestors, or a new ranking of all nodes.

    Args:
        tree: N nodes.
        order: (b,) old node indices, a list or a long tensor (on the tree's device: no host read).

    Returns:
        b nodes, with their depths, ancestors (the old matrix's rows and columns `order`) and scores.
    """
    assert tree.depth is not None and tree.ancestors is not None
    if isinstance(order, Tensor):
        idx = order.to(tree.tokens.device)  # (b,) new -> old
    else:
        idx = torch.tensor(order, dtype=torch.long, device=tree.tokens.device)
    new_of = torch.full((tree.num_nodes,), -1, dtype=torch.long, device=idx.device)
    new_of[idx] = torch.arange(idx.shape[0], device=idx.device)
    parents = torch.where(idx == 0, -1, new_of[tree.parents[idx].clamp(min=0)])  # (b,)
    scores = None if tree.scores is None else tree.scores[idx.to(tree.scores.device)]
    anc = tree.ancestors.to(idx.device)[idx][:, idx]  # (b, b): ancestors keep their relation, renumbered
    return DraftTree(tree.tokens[idx], parents, tree.depth[idx], anc, scores=scores)


def ancestor_matrix(parents: Tensor) -> tuple[Tensor, Tensor]:
    """Ancestor-or-self matrix and depth from parent pointers.

    One tensor op per tree level (pointer chasing on all nodes at once), no per-node loop.

    Args:
        parents: (N,) long, `parents[0] == -1`, `parents[i] < i`.

    Returns:
        ancestors: (N, N) bool, `ancestors[i, j]` = j is an ancestor of i or i itself.
        depth: (N,) long, distance to the root.
    """
    n = parents.shape[0]
    if n == 0 or int(parents[0]) != -1:
        raise ValueError("DraftTree: parents[0] must be -1 (node 0 is the root)")
    idx = torch.arange(n, device=parents.device)
    if n > 1 and not bool((parents[1:] >= 0).all() and (parents[1:] < idx[1:]).all()):
        raise ValueError(f"DraftTree: need 0 <= parents[i] < i for i >= 1, got {parents.tolist()}")
    par = parents.clamp(min=0)  # root points at itself
    anc = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    cur = idx
    for _ in range(n):  # at most max-depth + 1 iterations
        anc[idx, cur] = True
        nxt = par[cur]
        if bool((nxt == cur).all()):
            break
        cur = nxt
    depth = anc.sum(1) - 1  # (N,)
    return anc, depth


def tree_attention_mask(tree: DraftTree, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive 4D mask for one verification forward: prefix fully visible, nodes see their ancestors.

    Works for eager and SDPA attention (0 = attend, dtype-min = masked).

    Args:
        tree: N nodes.
        prefix_len: P, tokens already in the KV cache.
        dtype: the model's compute dtype.

    Returns:
        (1, 1, N, P + N) float mask.
    """
    assert tree.ancestors is not None  # set in __post_init__
    n = tree.num_nodes
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=tree.tokens.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~tree.ancestors, torch.finfo(dtype).min)  # (N, N)
    return mask


def tree_position_ids(tree: DraftTree, prefix_len: int) -> Tensor:
    """Position ids `prefix_len + depth`, shape (1, N)."""
    assert tree.depth is not None  # set in __post_init__
    return (tree.depth + prefix_len).unsqueeze(0)


def path_to(tree: DraftTree, node: int) -> Tensor:
    """Node indices on the root -> `node` path, root first: (depth+1,) long (ascending, as parents[i] < i)."""
    assert tree.ancestors is not None  # set in __post_init__
    return tree.ancestors[node].nonzero().squeeze(1)


def dedup_prefix(beams: Tensor) -> tuple[Tensor, Tensor]:
    """For every beam position, the first beam that shares the prefix up to and including it.

    Args:
        beams: (W, L) long token ids (L = 1 + draft_len).

    Returns:
        first: (W, L) long, `first[w, d]` = min w' with `beams[w', :d+1] == beams[w, :d+1]`.
        unique: (W, L) bool, `first[w, d] == w` (this position is a new tree node).
    """
    same = beams[:, None, :] == beams[None, :, :]  # (W, W, L)
    prefix_same = same.cumprod(dim=2).bool()  # (W, W, L): prefixes equal up to d
    first = prefix_same.int().argmax(dim=1)  # (W, L): argmax returns the first True
    w = torch.arange(beams.shape[0], device=beams.device)[:, None]
    return first, first == w


_CHAINS: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # chain length -> its topology (CPU)


def chain_topology(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An n-node chain's parents (n,), depth (n,), ancestors (n, n) and beam nodes (1, n) on the CPU, as
    `pack_beams` lays out one beam: fresh copies of one cached set per length (chains drafted without a beam
    search: the native chains, prompt lookup)."""
    topo = _CHAINS.get(n)
    if topo is None:
        ar = torch.arange(n, device="cpu")  # on the CPU whatever the default device (the cache outlives it)
        ones = torch.ones(n, n, dtype=torch.bool, device="cpu")
        topo = _CHAINS[n] = (ar - 1, ar, ones.tril(), ar[None])
    parents, depth, ancestors, nodes = (t.clone() for t in topo)
    return parents, depth, ancestors, nodes


def pack_beams(beams: Tensor) -> tuple[DraftTree, float]:
    """Pack W beams that all start with the root into a compact tree (shared prefixes merged).

    Node order is beam-major (w, d), which keeps `parents[i] < i`; beam 0 is the path 0..L-1. Beams of
    different lengths are right-padded with `PAD` (-1); padded positions make no nodes.

    Args:
        beams: (W, L) long, `beams[:, 0]` all equal to the root token, `PAD` only after a beam's tokens.

    Returns:
        tree: N unique nodes, with `beam_nodes` (W, L) mapping each beam position to its node (-1 = pad).
        compression: beam tokens / N (1.0 = no sharing).
    """
    if beams.ndim != 2 or beams.shape[1] < 1:
        raise ValueError(f"pack_beams: beams must be (W, 1+D), got {tuple(beams.shape)}")
    if not bool((beams[:, 0] == beams[0, 0]).all()) or int(beams[0, 0]) < 0:
        raise ValueError(f"pack_beams: all beams must start with the root token, got {beams[:, 0].tolist()}")
    W, L = beams.shape
    valid = beams != PAD  # (W, L), a prefix of each row
    if W == 1:  # one beam (a small node budget): a chain, nothing to share
        n = int(valid.sum())
        ar = torch.arange(n, device=beams.device)
        ancestors = torch.ones(n, n, dtype=torch.bool, device=beams.device).tril()
        beam_nodes = torch.where(valid, torch.arange(L, device=beams.device)[None], PAD)  # (1, L)
        return DraftTree(beams[0, :n].clone(), ar - 1, ar, ancestors, beam_nodes), 1.0
    first, unique = dedup_prefix(beams)
    flat_unique = (unique & valid).reshape(-1)  # (W*L,) beam-major
    node_of_flat = flat_unique.long().cumsum(0) - 1  # (W*L,) node index of unique positions
    d = torch.arange(L, device=beams.device)[None, :].expand(W, L)
    beam_nodes = node_of_flat[(first * L + d).reshape(-1)].reshape(W, L)  # (W, L)
    beam_nodes = torch.where(valid, beam_nodes, PAD)
    tokens = beams.reshape(-1)[flat_unique]  # (N,)
    n = tokens.shape[0]
    parents = torch.full((n,), -1, dtype=torch.long, device=beams.device)
    child = valid[:, 1:]  # (W, L-1) positions with a parent
    parents[beam_nodes[:, 1:][child]] = beam_nodes[:, :-1][child]  # (N,)
    depth = torch.empty(n, dtype=torch.long, device=beams.device)
    depth[beam_nodes[valid]] = d[valid]
    ancestors = torch.zeros(n, n, dtype=torch.bool, device=beams.device)
    pairs = (
        torch.ones(L, L, dtype=torch.bool, device=beams.device).tril()[None] & valid[:, :, None]
    )  # (W, L, L)
    rows = beam_nodes[:, :, None].expand(W, L, L)
    cols = beam_nodes[:, None, :].expand(W, L, L)
    ancestors[rows[pairs], cols[pairs]] = True  # each beam's path prefixes
    tree = DraftTree(tokens, parents, depth, ancestors, beam_nodes)
    return tree, int(valid.sum()) / n
