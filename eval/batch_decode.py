"""Batched greedy speculative decoding with continuous batching (B rows, one target forward per step).

Every row r of a `BatchKVCache` decodes its own request with its own proposer; a step verifies all rows'
trees in ONE target forward:

    refill free rows from the queue: prefill row r alone, root_r = argmax, emit root_r, proposer_r.reset()
    repeat while a row is active:
        tree_r = proposer_r.propose(new states of row r)          # (AR mode: the root alone)
        pad every tree to b = max_r N_r nodes (dummy nodes see only their row's root, never accepted)
        forward (B, b) tokens, positions len_r + depth, (B, 1, b, max_len) mask:
            row r, node i sees its row's first len_r positions and its ancestors among the b new ones
        per row: greedy_verify_packed -> a_r, bonus_r, path_r          # one host sync for all rows
        compact every row's path in place; len_r += a_r; emit drafts + bonus; finished rows are refilled

Greedy acceptance only, so each row's output equals its own batch-1 `decode.ar_generate` output (up to
float ties). Inactive rows ride along with a dummy one-node-wide tree and commit nothing (fixed B).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.eval.batch_kv import BatchKVCache
from specdraft.eval.decode import DecodeStats, Proposer, _emit, default_stop_ids, sync_device
from specdraft.eval.tree import DraftTree
from specdraft.eval.verify import greedy_verify_packed
from specdraft.models.base_llm import forward_with_hidden, lm_logits


@dataclass
class BatchStats:
    """What one `BatchDecoder.generate` call did as a whole."""

    rows: int = 0  # B
    requests: int = 0  # requests served
    steps: int = 0  # batched verify forwards
    prefills: int = 0  # single-row prompt forwards
    new_tokens: int = 0  # emitted tokens over all requests
    time_s: float = 0.0  # wall time of the call
    idle_row_steps: int = 0  # rows without a request summed over steps (the forward still runs them)

    @property
    def row_utilisation(self) -> float:
        """Share of the steps' row slots that decoded a request: 1 - idle_row_steps / (rows * steps)."""
        return 1.0 - self.idle_row_steps / max(self.rows * self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        """Batch throughput: emitted tokens of all requests per second."""
        return self.new_tokens / max(self.time_s, 1e-9)


@dataclass
class RequestStats(DecodeStats):
    """`DecodeStats` of one request (steps it took part in, accepted drafts per step), plus the call's."""

    batch: BatchStats = field(default_factory=BatchStats)  # shared by every request of the call


@dataclass
class _Row:
    """A request being decoded in a row."""

    request: int
    max_new: int
    stats: RequestStats
    t0: float
    root: int = 0  # newest emitted token, not in the cache yet
    out: list[int] = field(default_factory=list)
    new_hidden: Tensor | None = None  # (n, H') states of the newly committed positions
    new_tokens: Tensor | None = None  # (n,) the token each of them predicts


class BatchDecoder:
    """Greedy AR / tree-speculative decoding of B requests at a time (see module docstring).

    Args:
        model: HF causal LM, frozen.
        batch_size: B, rows decoded together.
        max_len: cache capacity per row; grown (reallocated) when a call needs more.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int = 1024) -> None:
        emb = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
        self.model, self.device, self.dtype = model, emb.device, emb.dtype
        self.batch_size = batch_size
        self.cache = BatchKVCache(model, batch_size, max_len)
        self.committed: list[list[int]] = [[] for _ in range(batch_size)]  # tokens whose K/V row r holds

    def _forward(
        self,
        rows: slice,
        tokens: Tensor,
        ancestors: Tensor,
        depth: Tensor,
        layers: tuple[int, ...],
        keep_last: bool,
    ) -> tuple[Tensor, Tensor]:
        """One target forward of R rows over L new positions each, written after each row's committed ones.

        Args:
            rows: the cache rows (R of them).
            tokens: (R, L) long; ancestors: (R, L, L) bool ancestor-or-self; depth: (R, L) long.
            layers, keep_last: the proposer's features (as `decode.target_forward`).

        Returns:
            logits (R, L, V); hidden (R, L, H') last-layer states or the requested layers.
        """
        c, (r, n) = self.cache, tokens.shape
        lengths = c.lengths_t[rows]  # (R,)
        c.prepare_write(rows, lengths[:, None] + torch.arange(n, device=self.device))  # (R, L)
        rel = torch.arange(c.max_len, device=self.device)[None] - lengths[:, None]  # (R, max_len)
        in_tree = (rel >= 0) & (rel < n)
        col = rel.clamp(0, n - 1)[:, None, :].expand(r, n, c.max_len)  # (R, L, max_len)
        visible = (ancestors.gather(2, col) & in_tree[:, None]) | (rel < 0)[:, None]  # (R, L, max_len)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        mask = torch.where(visible, zero, torch.finfo(self.dtype).min)[:, None]  # (R, 1, L, max_len)
        out = forward_with_hidden(
            cast(PreTrainedModel, self.model),
            tokens,
            attention_mask=mask,
            position_ids=lengths[:, None] + depth,  # (R, L)
            past_key_values=c,
            layers=layers,
            use_cache=True,
            logits=False,
        )
        hidden = out.hidden  # (R, L, H)
        logits = lm_logits(cast(PreTrainedModel, self.model), hidden)  # (R, L, V)
        if layers:
            assert out.layers is not None
            extra = out.layers.flatten(-2)  # (R, L, m*H)
            hidden = torch.cat([hidden, extra], dim=-1) if keep_last else extra
        return logits, hidden

    def _start(
        self, row: int, request: int, prompt: list[int], st: _Row, layers: tuple[int, ...], keep_last: bool
    ) -> None:
        """Prefill `prompt` (P,) into `row` alone (the other rows keep their caches); set `st`'s root and
        the proposer inputs: hidden (P, H') and next tokens (P,)."""
        p = len(prompt)
        if p == 0:
            raise ValueError(f"request {request}: empty prompt")
        self.cache.set_length(row, 0)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # (1, P)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()[None]  # (1, P, P)
        depth = torch.arange(p, device=self.device)[None]  # (1, P)
        logits, hidden = self._forward(slice(row, row + 1), ids, causal, depth, layers, keep_last)
        self.cache.set_length(row, p)
        self.committed[row] = list(prompt)
        st.root = int(logits[0, -1].float().argmax())
        st.stats.prefill_s = time.perf_counter() - st.t0
        st.new_hidden = hidden[0]  # (P, H')
        st.new_tokens = torch.tensor([*prompt[1:], st.root], device=self.device)  # (P,)

    @torch.inference_mode()
    def generate(
        self,
        requests: list[list[int]],
        max_new_tokens: int | list[int],
        stop_ids: set[int] | None = None,
        proposer_factory: Callable[[], Proposer] | None = None,
        on_step: Callable[[BatchDecoder], None] | None = None,
        order: list[int] | None = None,
    ) -> list[tuple[list[int], RequestStats]]:
        """Decode every request greedily, B at a time, refilling rows as requests finish.

        Args:
            requests: prompt token ids per request (chat template already applied).
            max_new_tokens: budget of emitted tokens, one for all or one per request.
            stop_ids: tokens that end a request (kept); None: the model's generation-config EOS ids.
            proposer_factory: makes one proposer per row slot (`reset()` on every refill); None: AR.
            on_step: called after every batched step's compaction (tests inspect the cache there).
            order: the order in which queued requests are admitted to free rows, a permutation of the request
                indices (`eval.scheduler.schedule_order`); None: FIFO (arrival order). Outputs do not depend on it.

        Returns:
            (new tokens, stats) per request, in request order; `stats.batch` holds the call's throughput.
        """
        budgets = (
            [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        )
        if len(budgets) != len(requests):
            raise ValueError(f"{len(budgets)} max_new_tokens for {len(requests)} requests")
        if order is not None and sorted(order) != list(range(len(requests))):
            raise ValueError(f"order must be a permutation of the {len(requests)} request indices")
        stops = default_stop_ids(None, self.model) if stop_ids is None else set(stop_ids)
        B, dev = self.batch_size, self.device
        proposers = [proposer_factory() for _ in range(B)] if proposer_factory is not None else []
        layers = proposers[0].spec.feature_layers if proposers else ()
        keep_last = proposers[0].spec.keep_last_hidden if proposers else False
        margin = max(proposers[0].spec.node_budget, 1) + 64 if proposers else 2
        needed = max((len(p) + m for p, m in zip(requests, budgets, strict=True)), default=0) + margin
        if needed > self.cache.max_len:
            self.cache = BatchKVCache(self.model, B, max(needed, 2 * self.cache.max_len))
        for r in range(B):
            self.cache.set_length(r, 0)
            self.committed[r] = []
        batch = BatchStats(rows=B, requests=len(requests))
        results: list[tuple[list[int], RequestStats] | None] = [None] * len(requests)
        rows: list[_Row | None] = [None] * B
        queue = deque(range(len(requests)) if order is None else order)
        sync_device(dev)
        t_call = time.perf_counter()

        def finish(st: _Row) -> None:
            sync_device(dev)
            st.stats.time_s = time.perf_counter() - st.t0
            st.stats.new_tokens = len(st.out)
            st.stats.finish_reason = "stop" if st.out and st.out[-1] in stops else "length"
            results[st.request] = (st.out, st.stats)

        while True:
            for r in range(B):  # refill free rows; a request may finish at its first token
                while rows[r] is None and queue:
                    i = queue.popleft()
                    st = _Row(
                        i,
                        budgets[i],
                        RequestStats(prompt_tokens=len(requests[i]), batch=batch),
                        time.perf_counter(),
                    )
                    if st.max_new > 0:
                        self._start(r, i, requests[i], st, layers, keep_last)
                        batch.prefills += 1
                        if proposers:
                            proposers[r].reset()
                    if st.max_new <= 0 or _emit(st.out, [st.root], stops, st.max_new):
                        finish(st)
                    else:
                        rows[r] = st
            active = [r for r in range(B) if rows[r] is not None]
            if not active:
                break
            trees: dict[int, DraftTree] = {}
            for r in active:
                st = cast(_Row, rows[r])
                if proposers:
                    trees[r] = (
                        proposers[r].propose(cast(Tensor, st.new_hidden), cast(Tensor, st.new_tokens)).to(dev)
                    )
                else:
                    trees[r] = DraftTree(torch.tensor([st.root], device=dev), torch.tensor([-1], device=dev))
            cap = self.cache.max_len - max(
                self.cache.lengths[r] for r in active
            )  # room left in the fullest row
            trees = {r: t.truncated(cap) for r, t in trees.items()}
            b = max(t.num_nodes for t in trees.values())
            for r in range(B):  # an idle row's dummy writes must fit too: drop its stale cache
                if rows[r] is None and self.cache.lengths[r] + b > self.cache.max_len:
                    self.cache.set_length(r, 0)
                    self.committed[r] = []
            # every row starts as b dummies (children of node 0 that see only node 0 and themselves)
            eye = torch.eye(b, dtype=torch.bool, device=dev)
            anc = (eye | (torch.arange(b, device=dev) == 0)[None]).repeat(B, 1, 1)  # (B, b, b)
            depth = (torch.arange(b, device=dev) > 0).long().repeat(B, 1)  # (B, b)
            parents = torch.zeros(B, b, dtype=torch.long, device=dev)  # (B, b)
            parents[:, 0] = -1
            tokens = torch.zeros(B, b, dtype=torch.long, device=dev)  # (B, b)
            valid = torch.zeros(B, b, dtype=torch.bool, device=dev)  # (B, b)
            for r, t in trees.items():
                n = t.num_nodes
                tokens[r, :n], tokens[r, n:] = t.tokens, cast(_Row, rows[r]).root
                parents[r, :n], depth[r, :n], valid[r, :n] = t.parents, cast(Tensor, t.depth), True
                anc[r, :n, :n] = cast(Tensor, t.ancestors)
            logits, hidden = self._forward(slice(0, B), tokens, anc, depth, layers, keep_last)  # (B, b, V)
            packed = torch.stack(
                [
                    greedy_verify_packed(tokens[r], parents[r], anc[r], depth[r], logits[r], valid[r])
                    for r in range(B)
                ]
            )  # (B, 2 + 2b): [a, bonus, path (b,), path tokens (b,)] per row
            vals = packed.tolist()  # the step's one host sync
            accepted = [int(vals[r][0]) if rows[r] is not None else 0 for r in range(B)]
            path_t = packed[:, 2 : 2 + b]  # (B, b) padded paths
            self.cache.commit(path_t, accepted)
            batch.steps += 1
            batch.idle_row_steps += B - len(active)
            for r in active:
                st, a, bonus = cast(_Row, rows[r]), accepted[r], int(vals[r][1])
                path_tokens = [int(x) for x in vals[r][2 + b : 2 + b + a]]
                if path_tokens[0] != st.root:
                    raise RuntimeError(
                        f"proposer returned a tree rooted at {path_tokens[0]}, expected {st.root}"
                    )
                self.committed[r] += path_tokens
                st.stats.steps += 1
                st.stats.accepted.append(a - 1)
                st.stats.tree_sizes.append(trees[r].num_nodes)
                if proposers and proposers[r].last_compression is not None:
                    st.stats.compression.append(float(cast(float, proposers[r].last_compression)))
                st.new_hidden = hidden[r, path_t[r, :a]]  # (a, H')
                st.new_tokens = torch.tensor([*path_tokens[1:], bonus], device=dev)  # (a,)
                st.root = bonus
                if _emit(st.out, [*path_tokens[1:], bonus], stops, st.max_new):
                    finish(st)
                    rows[r] = None
            if on_step is not None:
                on_step(self)
        sync_device(dev)
        batch.time_s = time.perf_counter() - t_call
        batch.new_tokens = sum(len(res[0]) for res in results if res is not None)
        return [cast(tuple[list[int], RequestStats], res) for res in results]
