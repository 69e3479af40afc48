"""Medusa static trees: trees built from per-head rank accuracies, the proposer, and Medusa's *typical
acceptance* (a LOSSY alternative to exact verification). The tree's shape (the default tree, validation,
pruning, node arrays) lives in `models/medusa_choices.py`, which training-time evaluation shares.

A static tree is a list of rank paths ("Medusa choices"): path (r_0, .., r_{d-1}) is the node at depth d whose
token is head d-1's rank-r_{d-1} candidate, under the node (r_0, .., r_{d-2}); the root (the committed token)
is the empty path. At each step every head's top-k is computed once from h_t and the same tree shape is
filled with tokens, so the node layout, ancestor mask and depths are computed once per proposer.

Tree construction (Medusa paper, s3.3.1): with a_k(i) = P(head k's rank-i token is the right one) measured on
held-out data and assumed independent across heads, a node's path is fully accepted with probability
prod_j a_j(r_j), and since siblings carry distinct tokens at most one node per depth is accepted, so

    E[tokens/step] = 1 + sum over non-root nodes of prod_j a_j(r_j).

Every node's value is at most its parent's, so adding nodes greedily by value (a heap over the children of
the current tree) yields a prefix-closed tree that maximises that sum for every node budget at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from specdraft.eval.graphs import CudaGraph, replay_or_run
from specdraft.eval.tree import DraftTree, ProposerSpec, ancestor_matrix
from specdraft.models.medusa_choices import resolve_paths, tree_layout
from specdraft.models.medusa_copy import copy_ngram

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdraft.eval.decode import Proposer
    from specdraft.eval.medusa_copy_tree import CopyTreeFill
    from specdraft.eval.medusa_native import MedusaNative
    from specdraft.models.medusa import Medusa


# ---- trees from measured accuracies ----------------------------------------------------------------------------
def rank_hits(logits: Tensor, targets: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """Per-head, per-rank hit counts: how often head k's rank-i token is the label.

    Args:
        logits: (N, D, V) head logits.
        targets: (N, D) long labels, -100 = ignored.
        topk: ranks counted.

    Returns:
        hits (D, topk) float64 counts, valid (D,) float64 number of labelled entries per head.
    """
    top = logits.topk(topk, dim=-1).indices  # (N, D, k)
    ok = targets != -100  # (N, D)
    hit = (top == targets[..., None]) & ok[..., None]  # (N, D, k)
    return hit.sum(0).double(), ok.sum(0).double()


def expected_accept_length(choices: Sequence[Sequence[int]], acc: Tensor) -> float:
    """E[tokens/step] of a tree under independent heads: 1 + sum over nodes of prod_j acc[j, r_j].

    Args:
        choices: rank paths.
        acc: (K, k) rank accuracies, acc[j, i] = P(head j's rank-i token is right).
    """
    a = acc.double()
    total = 1.0
    for p in choices:
        total += float(torch.prod(torch.stack([a[j, r] for j, r in enumerate(p)])))
    return total


def build_tree(acc: Tensor, num_nodes: int) -> tuple[list[tuple[int, ...]], float]:
    """Greedy (optimal) tree for a node budget from per-head rank accuracies (Medusa paper s3.3.1).

    Args:
        acc: (K, k) rank accuracies, acc[j, i] = P(head j's rank-i token is right) (see `rank_hits`).
        num_nodes: N, nodes of the verified tree including the root (>= 1).

    Returns:
        paths: the N-1 rank paths in the order they were added (every prefix is itself a tree for a
            smaller budget, and `check_tree` keeps that order);
        expected: E[tokens/step] of the tree (1 + the sum of the node values).
    """
    if num_nodes < 1:
        raise ValueError(f"build_tree: num_nodes={num_nodes} must be >= 1 (the root)")
    a = acc.double().cpu()
    heads, k = a.shape
    heap: list[tuple[float, tuple[int, ...]]] = [(-float(a[0, i]), (i,)) for i in range(k)] if heads else []
    heapq.heapify(heap)
    paths: list[tuple[int, ...]] = []
    expected = 1.0
    while heap and len(paths) + 1 < num_nodes:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        expected += -neg
        if len(path) < heads:
            for i in range(k):
                heapq.heappush(heap, (neg * float(a[len(path), i]), (*path, i)))
    return paths, expected


@torch.no_grad()
def measure_rank_accuracies(
    drafter: Medusa,
    target: PreTrainedModel,
    batches: Iterable[dict[str, Tensor]],
    topk: int,
    max_batches: int | None = None,
    chunk: int = 256,
) -> tuple[Tensor, int]:
    """Per-head rank accuracies of a Medusa on held-out batches (the input of `build_tree`).

    Args:
        drafter: Medusa heads (`head_logits(hidden (..., H), root=(...)) -> (..., K, Vd)`, `to_draft_ids` with a
            reduced draft vocabulary: a label outside it is a miss at every rank).
        target: the frozen target (one no-grad forward per batch for h_t).
        batches: collated batches (`data.collate.Collator` with draft_len = K): `input_ids`, `attention_mask`,
            `root` (B, L), `targets` (B, L, K), `pos_mask` (B, L); with `copy_ids`, `copy_len` (B, L, K) (the
            collator's `copy_ngram`) heads with a copy gate are ranked by their mixtures.
        topk: ranks measured per head.
        max_batches: stop after this many batches (None: all).
        chunk: positions per head-logits call (bounds the (chunk, K, V) buffer).

    Returns:
        acc (K, topk) float64, acc[k, i] = P(head k's rank-i token is the label); positions used.
    """
    from specdraft.models.base_llm import forward_with_hidden

    hits: Tensor | None
    valid: Tensor | None
    hits = valid = None
    positions = 0
    dev = next(target.parameters()).device
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        ids, mask = batch["input_ids"].to(dev), batch["attention_mask"].to(dev)
        hidden = forward_with_hidden(target, ids, attention_mask=mask, logits=False).hidden  # (B, L, H)
        sel = batch["pos_mask"].to(dev)  # (B, L)
        h, tg = hidden[sel], batch["targets"].to(dev)[sel]  # (N, H), (N, K)
        root = batch["root"].to(dev)[sel]  # (N,) x_{t+1}, read by root-conditioned heads
        # heads with a copy gate: their mixtures' ranks (models/medusa_copy.py)
        gated = drafter.copy is not None and "copy_ids" in batch
        cands = (batch["copy_ids"].to(dev)[sel], batch["copy_len"].to(dev)[sel]) if gated else None  # (N, K)
        for s in range(0, h.shape[0], chunk):
            part = slice(s, s + chunk)
            if cands is not None:
                logits = drafter(h[part], root[part], tg[part], copy=(cands[0][part], cands[1][part])).float()
            else:
                logits = drafter.head_logits(h[part], tg.shape[-1], root=root[part]).float()
            labels = tg[s : s + chunk].to(logits.device)  # (n, K) target ids, -100 = ignored
            if drafter.reduced_vocab:  # draft ids; -1 (never a hit) outside the vocabulary
                labels = drafter.to_draft_ids(labels, missing=-1).masked_fill(labels == -100, -100)
            hh, vv = rank_hits(logits, labels, topk)
            hits, valid = (hh, vv) if hits is None else (hits + hh, cast(Tensor, valid) + vv)  # set together
        positions += int(h.shape[0])
    if hits is None:
        raise ValueError("measure_rank_accuracies: no held-out batch")
    assert valid is not None  # set together with `hits`
    return (hits / valid.clamp_min(1.0)[:, None]).cpu(), positions


# ---- decoding ---------------------------------------------------------------------------------------------------
class MedusaProposer:
    """Static-tree proposer: fill one fixed tree with every head's top-k tokens (one drafter call per step).

    Args:
        drafter: a `models.medusa.Medusa` (`topk_tokens(hidden (H,), k, num_heads, linears, root) -> (num_heads,
            k)` target ids, mapped from the draft vocabulary; `config.draft_len`, `config.topk`,
            `config.tree_choices`).
        choices: rank paths (None: the export's `tree_choices`, else `DEFAULT_TREE` pruned to the heads and
            `config.topk`).
        max_nodes: node budget N (root included) applied to the tree (None: the whole tree).
        int8_head: on CPU, run each head's vocabulary Linear as a shared dynamic-int8 copy
            (`proposers.int8_copy`): the K (Vd, H) products stream most of the drafter's weights every step.
            Only the drafts can change, never the output.
        graphs: drafter on CUDA: capture the draft step (heads, top-k, the tree's tokens) as a CUDA graph,
            once per node cap (`fit_budget`), and replay it (eager where capture fails; else ignored).
        int8_layers: on CPU, the heads' residual blocks as dynamic-int8 products
            through `eval.int8_clone.int8_clone` (`eval.draft_block=int8`); the vocabulary Linears follow
            `int8_head`.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        choices: Sequence[Sequence[int]] | None = None,
        max_nodes: int | None = None,
        int8_head: bool = False,
        graphs: bool = False,
        int8_layers: bool = False,
    ) -> None:
        drafter = cast("Medusa", drafter)  # duck-typed: any module with Medusa's `config` and `topk_tokens`
        cfg = drafter.config
        heads = int(cfg.draft_len)
        given = choices if choices is not None else cfg.tree_choices
        paths = resolve_paths(given, heads, int(cfg.topk), max_nodes)
        self.drafter = drafter
        self._search = drafter  # what drafts: the drafter, or its int8 view (below)
        if int8_layers:
            from specdraft.eval.int8_clone import int8_clone

            vocab = tuple(lin for _, lin in drafter.vocab_heads())
            # the root input slices its weight per call (`models/medusa_root.py`): it keeps its float product
            # (the copy gate reads the target's embeddings through its own Linear's weight: kept too)
            self._search = cast("Medusa", int8_clone(drafter, keep=("root_input", "copy"), skip=vocab))
        self.paths = paths
        self.parents, self.head, self.rank = tree_layout(paths)  # (N,) each
        self.ancestors, self.depth = ancestor_matrix(self.parents)  # (N, N), (N,)
        self.topk = int(self.rank.max()) + 1
        self.depth_used = int(self.depth.max())  # heads the tree reaches (deeper heads are never run)
        self.last_compression: float | None = None
        self.spec = ProposerSpec(max_depth=self.depth_used, node_budget=int(self.parents.shape[0]))
        self._cap = int(self.parents.shape[0])  # nodes proposed (`fit_budget`); the whole tree by default
        self._run = (self.topk, self.depth_used)  # ranks and heads those nodes need
        self.int8: list[torch.nn.Module] | None = None  # int8 copies of the heads' vocabulary Linears (CPU)
        if int8_head and next(drafter.parameters()).device.type == "cpu":
            from specdraft.eval.proposers import int8_copy, int8_supported

            if int8_supported():
                self.int8 = [int8_copy(lin) for _, lin in drafter.vocab_heads()]
        # with int8 heads on the CPU one row's heads draft as one C call (eval/medusa_native.py, int8 blocks and
        # root input too); rows drafted together (`propose_rows`) stay in torch
        self._native: MedusaNative | None = None
        gated = copy_ngram(cfg) > 0  # a copy gate (models/medusa_copy.py)
        if self.int8 is not None:
            from specdraft.eval.medusa_native import make_native

            self._native = make_native(drafter)
        weight = next(iter(drafter.parameters()), None)
        dev = weight.device if weight is not None else torch.device("cpu")
        # with a copy gate the children depend on each node's path, looked up on the host: eager (no draft graph)
        self._copy: CopyTreeFill | None = None
        if gated:
            from specdraft.eval.medusa_copy_tree import CopyTreeFill

            self._copy = CopyTreeFill(
                drafter, self._search, self.int8, self.parents, self.depth, self.rank, dev, self._native
            )
        self.graphs = graphs and dev.type == "cuda" and not gated
        self._captured: dict[int, CudaGraph[Tensor] | None] = {}  # per node cap
        self._hidden_in = torch.zeros(0, device=dev)  # (H,) graph input, sized at the first call
        self._root_in = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) graph input

    def reset(self) -> None:
        """Forget the previous prompt (the copy gate's committed tokens; plain heads keep nothing)."""
        if self._copy is not None:
            self._copy.reset()

    def fit_budget(self, nodes: int) -> None:
        """Propose only the first `nodes` nodes (paths are in importance order, so they are the tree a smaller
        budget keeps) and run only the heads and ranks they reach; a larger cap (a refit: `budget.FULL`)
        restores the whole tree."""
        self._cap = max(1, min(int(nodes), int(self.parents.shape[0])))
        self._run = (int(self.rank[: self._cap].max()) + 1, int(self.depth[: self._cap].max()))

    @property
    def num_nodes(self) -> int:
        """N, nodes of every proposed tree (root included; `fit_budget` may lower it)."""
        return self._cap

    def _topk(self, hidden: Tensor, root: Tensor) -> Tensor:
        """hidden (..., H), root (...) -> (..., depth, k) target ids of the heads and ranks the proposed nodes
        need, through the int8 copies when there are some (root-conditioned heads read `root`); one row's through
        the native heads where they run."""
        if self._native is not None and hidden.dim() == 1:
            return self._native.topk(hidden, root, *self._run)
        return self._search.topk_tokens(hidden, *self._run, linears=self.int8, root=root)

    def _layout_on(self, dev: torch.device) -> None:
        """Move the static layout to the decoding device (once, not every step)."""
        if self.parents.device != dev:
            self.parents, self.head, self.rank = self.parents.to(dev), self.head.to(dev), self.rank.to(dev)
            self.ancestors, self.depth = self.ancestors.to(dev), self.depth.to(dev)

    @torch.inference_mode()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """The static tree filled from the heads at the newest position.

        Args:
            hidden: (n, H) target states of the newly committed positions (only hidden[-1] is used).
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            DraftTree with N = `num_nodes` nodes; node i's token is head[i]'s rank[i] candidate.
        """
        dev = tokens.device
        self._layout_on(dev)
        n = self._cap
        if self._copy is not None:
            out = self._copy.fill(hidden[-1], tokens, n, *self._run)
        elif self.graphs:
            if self._hidden_in.shape != hidden[-1].shape or self._hidden_in.dtype != hidden.dtype:
                self._hidden_in, self._captured = hidden[-1].clone(), {}  # (H,)
            self._hidden_in.copy_(hidden[-1])
            self._root_in.copy_(tokens[-1:])
            out = replay_or_run(
                self._captured,
                n,
                lambda: self._fill(self._hidden_in, self._root_in),
                dev,
                "the Medusa draft step",
            ).clone()  # the graph's output is overwritten by the next replay
        else:
            out = self._fill(hidden[-1], tokens[-1:])
        return DraftTree(out, self.parents[:n], self.depth[:n], self.ancestors[:n, :n])

    def _fill(self, hidden: Tensor, root: Tensor) -> Tensor:
        """The tree's tokens (N,) from the newest state `hidden` (H,) and the root (1,): fixed shapes for a
        given cap, no host sync (the function a CUDA graph captures)."""
        n = self._cap
        out = root.repeat(n)  # (N,)
        if n > 1:
            top = self._topk(hidden, root[0]).to(out.device)  # (depth, k)
            out[1:] = top[self.head[1:n], self.rank[1:n]]
        return out

    @torch.inference_mode()
    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """Every row's `propose` from one run of the heads over the R rows' newest states. None when the
        rows' proposers differ (drafter, tree or cap).

        Args:
            rows: R `MedusaProposer`s (this one among them); hidden: R (n_i, H); tokens: R (n_i,).

        Returns:
            R trees of `num_nodes` nodes, each equal to `rows[i].propose(hidden[i], tokens[i])` (with int8 heads
            up to their shared activation scale); a lone row with native heads is its `propose`.
        """
        if not all(isinstance(p, MedusaProposer) for p in rows):
            return None
        ps = cast("list[MedusaProposer]", list(rows))
        if any(p._copy is not None for p in ps):  # each row's candidates are its own text's: row by row
            return [p.propose(h, t) for p, h, t in zip(ps, hidden, tokens, strict=True)]
        same = (self._search, self.paths, self._cap, self.int8 is None)
        if any((p._search, p.paths, p._cap, p.int8 is None) != same for p in ps):
            return None
        if len(ps) == 1 and self._native is not None:  # a row drafting alone: its native heads
            return [self.propose(hidden[0], tokens[0])]
        n, dev = self._cap, tokens[0].device
        self._layout_on(dev)
        roots = torch.stack([t[-1] for t in tokens])  # (R,)
        out = roots[:, None].repeat(1, n)  # (R, N)
        if n > 1:
            last = torch.stack([h[-1] for h in hidden])  # (R, H)
            top = self._topk(last, roots).to(dev)  # (R, d, k)
            out[:, 1:] = top[:, self.head[1:n], self.rank[1:n]]
        return [DraftTree(o, self.parents[:n], self.depth[:n], self.ancestors[:n, :n]) for o in out]


def typical_verify(
    tree: DraftTree,
    logits: Tensor,
    temperature: float,
    epsilon: float = 0.09,
    delta: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, int]:
    """Medusa typical acceptance. **LOSSY**: the output does NOT follow the target's distribution.

    With p_u = softmax(logits[u] / T) and H(p_u) its entropy, child c of node u is accepted iff
    p_u(c) > min(epsilon, delta * exp(-H(p_u))); the deepest fully accepted node wins (ties: the highest
    sum of log p along the path, as in Medusa), and the bonus token is drawn from p at that node restricted
    to the same typical set (Medusa's `get_typical_one_token`). top-k / top-p are not applied.

    Args:
        tree: N nodes.
        logits: (N, V) target logits at every node.
        temperature: > 0 (at T = 0 use exact greedy verification, which is lossless).
        epsilon: the posterior threshold (Medusa's `posterior_threshold`).
        delta: the entropy-dependent threshold scale (Medusa's `posterior_alpha`).
        generator: RNG for the bonus token.

    Returns:
        path: (a,) long node indices, root first; bonus: the next token.
    """
    if temperature <= 0.0:
        raise ValueError("typical acceptance needs temperature > 0 (use exact verification at temperature 0)")
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (N, V)
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)  # (N,)
    thresh = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))  # (N,)
    par = tree.parents.clamp(min=0)
    p_tok = probs[par, tree.tokens]  # (N,) p_parent(token)
    ok = p_tok > thresh[par]  # (N,)
    ok[0] = True
    assert tree.ancestors is not None and tree.depth is not None  # set in DraftTree.__post_init__
    accepted = ~(tree.ancestors & ~ok[None, :]).any(1)  # (N,) whole path accepted
    logp = torch.log(p_tok.clamp_min(1e-30))
    logp[0] = 0.0
    path_logp = tree.ancestors.double() @ logp.double()  # (N,) sum along each path
    depth = torch.where(accepted, tree.depth, torch.full_like(tree.depth, -1))
    best_depth = depth.max()
    score = torch.where(depth == best_depth, path_logp, torch.full_like(path_logp, float("-inf")))
    best = int(score.argmax())
    path = tree.ancestors[best].nonzero().squeeze(1)
    p = probs[best]
    typical = torch.where(p >= thresh[best], p, torch.zeros_like(p))  # (V,)
    if float(typical.sum()) <= 0.0:
        typical = p
    bonus = int(torch.multinomial(typical / typical.sum(), 1, generator=generator))
    return path, bonus


def typical_rule(
    temperature: float, epsilon: float = 0.09, delta: float = 0.3, seed: int = 0
) -> Callable[[DraftTree, Tensor], tuple[Tensor, int]]:
    """`typical_verify` bound to its settings, as `decode.speculative_generate(verify_fn=...)` takes it
    (**LOSSY**); the bonus-token RNG is seeded once and created on the logits' device at the first call."""
    if temperature <= 0.0:
        raise ValueError(
            f"typical acceptance needs eval.temperature > 0 (got {temperature}); at 0 exact greedy is lossless"
        )
    gens: dict[torch.device, torch.Generator] = {}

    def rule(tree: DraftTree, logits: Tensor) -> tuple[Tensor, int]:
        gen = gens.setdefault(logits.device, torch.Generator(logits.device).manual_seed(seed))
        return typical_verify(tree, logits, temperature, epsilon, delta, gen)

    return rule
