"""Batched greedy speculative decoding with continuous batching (B rows, one target forward per step).

Every row r of a `BatchKVCache` decodes its own request with its own proposer; a step verifies all rows'
trees in ONE target forward:

    refill free rows from the queue: prefill row r alone, root_r = argmax, emit root_r, proposer_r.reset()
    repeat while a row is active:
        tree_r = proposer_r.propose(new states of row r)          # (AR mode: the root alone)
        pad every tree to b = max_r N_r nodes (dummy nodes see only their row's root, never accepted)
        forward (B, b) tokens, positions len_r + depth, (B, 1, b, S) mask, S = max_r len_r + b:
            row r, node i sees its row's first len_r positions and its ancestors among the b new ones
        per row: greedy_verify_packed -> a_r, bonus_r, path_r          # one host sync for all rows
        compact every row's path in place; len_r += a_r; emit drafts + bonus; finished rows are refilled

Greedy acceptance: each row's output equals its own batch-1 `decode.ar_generate` output (up to float ties).
With `temperature > 0` every row runs the recursive rejection rule of `verify.sample_verify` on its own tree
(one host sync per row instead of one per step), so each row's tokens follow the target's sampling
distribution. Inactive rows ride along with a dummy one-node-wide tree and commit nothing (fixed B).
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
from specdraft.eval.budget import FULL, SIZES, CostCurve, NodeBudget, machine_key, time_round_robin
from specdraft.eval.decode import DecodeStats, Proposer, _emit, default_stop_ids, sync_device
from specdraft.eval.tree import DraftTree
from specdraft.eval.verify import greedy_verify_packed, sample_token, sample_verify
from specdraft.models.base_llm import forward_with_hidden, lm_logits

Sampling = tuple[float, int, float, torch.Generator | None]  # (temperature, top_k, top_p, generator)


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
        max_len: cache capacity per row; grown (reallocated to exactly the longest prompt + budget + one tree) when
            a call needs more. Each step attends over the longest active row's positions only (finished rows
            are emptied), so attention and GQA key expansion cost what is filled, not max_len.
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
        span = max(c.lengths[rows]) + n  # attend over the filled prefix only (host lengths: no sync)
        c.prepare_write(rows, lengths[:, None] + torch.arange(n, device=self.device), span)  # (R, L)
        rel = torch.arange(c.span, device=self.device)[None] - lengths[:, None]  # (R, S)
        in_tree = (rel >= 0) & (rel < n)
        col = rel.clamp(0, n - 1)[:, None, :].expand(r, n, c.span)  # (R, L, S)
        visible = (ancestors.gather(2, col) & in_tree[:, None]) | (rel < 0)[:, None]  # (R, L, S)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        mask = torch.where(visible, zero, torch.finfo(self.dtype).min)[:, None]  # (R, 1, L, S)
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

    @torch.inference_mode()
    def measure_costs(
        self, sizes: tuple[int, ...] = SIZES[:5], prefix: int = 256, reps: int = 5
    ) -> dict[int, float]:
        """Median ms of one batched verify forward of b nodes (a chain) in every one of the B rows, after a
        `prefix`-token cache in each, for each size; nothing is committed. For `eval.budget.CostCurve`
        (`row_cost_curve` divides by B). Sizes are timed round-robin, so drift shifts them alike."""
        B, dev = self.batch_size, self.device
        g = torch.Generator(device="cpu").manual_seed(0)
        vocab = int(cast(PreTrainedModel, self.model).config.get_text_config(decoder=True).vocab_size)
        if prefix + max(sizes) > self.cache.max_len:
            self.cache = BatchKVCache(self.model, B, prefix + max(sizes))
        for r in range(B):
            self._release(r)
        ids = torch.randint(0, vocab, (B, prefix), generator=g).to(dev)  # (B, P)
        causal = torch.ones(prefix, prefix, dtype=torch.bool, device=dev).tril()[None].expand(B, -1, -1)
        self._forward(
            slice(0, B), ids, causal, torch.arange(prefix, device=dev)[None].expand(B, -1), (), False
        )
        for r in range(B):
            self.cache.set_length(r, prefix)
        toks = {b: torch.randint(0, vocab, (B, b), generator=g).to(dev) for b in sizes}  # (B, b) each

        def verify(b: int) -> None:
            chain = torch.ones(b, b, dtype=torch.bool, device=dev).tril()[None].expand(B, -1, -1)  # (B, b, b)
            depth = torch.arange(b, device=dev)[None].expand(B, -1)  # (B, b)
            logits, _ = self._forward(slice(0, B), toks[b], chain, depth, (), False)
            logits.float().argmax(-1).tolist()  # the step's host sync, as in `generate`

        ms = time_round_robin(verify, sizes, reps, dev)
        for r in range(B):
            self._release(r)
        return ms

    def row_cost_curve(self, refresh: bool = False, log: Callable[[str], None] = print) -> CostCurve:
        """This batch size's verify cost per row (ms of a B-row forward / B), cached per machine and B: with it
        a `NodeBudget` fed one observation per row and step maximises the batch's tokens/s, since
        sum_r gain_r / (cost_B(b) + sum_r draft_r) = mean gain / (cost_B(b) / B + mean draft)."""
        key = machine_key(self.model, f"batch{self.batch_size}")
        curve = CostCurve.load_or_measure(key, self.measure_costs, refresh=refresh, log=log)
        return CostCurve({b: ms / self.batch_size for b, ms in curve.ms.items()})

    def _release(self, row: int) -> None:
        """Empty `row` (no committed positions): an idle row's dummy writes land at its start, and it never
        widens the attention span."""
        self.cache.set_length(row, 0)
        self.committed[row] = []

    def _start(
        self,
        row: int,
        request: int,
        prompt: list[int],
        st: _Row,
        layers: tuple[int, ...],
        keep_last: bool,
        sampling: Sampling | None,
    ) -> None:
        """Prefill `prompt` (P,) into `row` alone (the other rows keep their caches); set `st`'s root (argmax,
        or drawn with `sampling`) and the proposer inputs: hidden (P, H') and next tokens (P,)."""
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
        st.root = sample_token(logits[0, -1], *sampling) if sampling else int(logits[0, -1].float().argmax())
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
        budget: NodeBudget | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
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
            budget: one `NodeBudget` for all rows, fitted on this batch size's cost curve per row
                (`row_cost_curve`): every row's tree is cut to its first `cap` nodes, or no row drafts when
                `cap == 1`; its state carries over calls (fitted on greedy calls only). Outputs do not depend on it.
            temperature, top_k, top_p: 0 = greedy; > 0 = sample every row from the target's warped
                distribution (`verify.warp_probs`), losslessly, as `decode.speculative_generate` does.
            generator: RNG for sampling (on the model's device), shared by the rows in row order.

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
        if needed > self.cache.max_len:  # exactly what this call needs
            self.cache = BatchKVCache(self.model, B, needed)
        for r in range(B):
            self._release(r)
        batch = BatchStats(rows=B, requests=len(requests))
        results: list[tuple[list[int], RequestStats] | None] = [None] * len(requests)
        rows: list[_Row | None] = [None] * B
        queue = deque(range(len(requests)) if order is None else order)
        sampling: Sampling | None = (temperature, top_k, top_p, generator) if temperature > 0 else None
        if budget is not None and budget.cap is not None:
            for p in proposers:
                p.fit_budget(budget.cap)
        sync_device(dev)
        t_call = time.perf_counter()

        def finish(st: _Row, row: int) -> None:
            self._release(row)  # its K/V are not needed any more
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
                        self._start(r, i, requests[i], st, layers, keep_last, sampling)
                        batch.prefills += 1
                        if proposers:
                            proposers[r].reset()
                    if st.max_new <= 0 or _emit(st.out, [st.root], stops, st.max_new):
                        finish(st, r)
                    else:
                        rows[r] = st
            active = [r for r in range(B) if rows[r] is not None]
            if not active:
                break
            if budget is not None and proposers and sampling is None and budget.tick():  # a refit: full trees
                for p in proposers:
                    p.fit_budget(FULL)
            fitting = budget is not None and not budget.settled and bool(proposers) and sampling is None
            off = budget is not None and budget.cap == 1  # drafting does not pay at this batch size
            trees: dict[int, DraftTree] = {}
            draft_s: dict[int, float] = {}  # per row: the proposer's time this step
            for r in active:
                st = cast(_Row, rows[r])
                if proposers and not off:
                    t_draft = time.perf_counter()
                    tree = (
                        proposers[r].propose(cast(Tensor, st.new_hidden), cast(Tensor, st.new_tokens)).to(dev)
                    )
                    draft_s[r] = time.perf_counter() - t_draft
                    trees[r] = tree.truncated(budget.cap) if budget is not None and budget.cap else tree
                else:
                    trees[r] = DraftTree(torch.tensor([st.root], device=dev), torch.tensor([-1], device=dev))
            cap = self.cache.max_len - max(
                self.cache.lengths[r] for r in active
            )  # room left in the fullest row
            trees = {r: t.truncated(cap) for r, t in trees.items()}
            b = max(t.num_nodes for t in trees.values())
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
            gains = fitting and not off and cast(NodeBudget, budget).cap is None  # phase 1: the gain curves
            if sampling is None:
                packed = torch.stack(
                    [
                        greedy_verify_packed(
                            tokens[r], parents[r], anc[r], depth[r], logits[r], valid[r], gains
                        )
                        for r in range(B)
                    ]
                )  # (B, 2 + 2b [+ b]): [a, bonus, path (b,), path tokens (b,) [, gain curve (b,)]] per row
            else:  # the same layout from the sampling rule, row by row; idle rows accept nothing
                packed = torch.zeros(B, 2 + 2 * b, dtype=torch.long, device=dev)
                packed[:, 2 : 2 + b] = torch.arange(b, device=dev)
                for r in active:
                    n = trees[r].num_nodes
                    path, bonus = sample_verify(trees[r], logits[r, :n], *sampling)  # (a,), int
                    a = path.shape[0]
                    packed[r, 0], packed[r, 1] = a, bonus
                    packed[r, 2 : 2 + a], packed[r, 2 + b : 2 + b + a] = path, tokens[r, path]
            vals = packed.tolist()  # the step's one host sync
            accepted = [int(vals[r][0]) if rows[r] is not None else 0 for r in range(B)]
            if budget is not None and proposers and sampling is None and not off:  # fit or drift test
                fit, prev_cap = cast(NodeBudget, budget), cast(NodeBudget, budget).cap
                for r in active:
                    n = trees[r].num_nodes
                    fit.observe(
                        draft_s[r], accepted[r], n, vals[r][2 + 2 * b : 2 + 2 * b + n] if gains else None
                    )
                if fit.cap != prev_cap:  # a new cap: the proposers may draft less from now on
                    for p in proposers:
                        p.fit_budget(cast(int, fit.cap))
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
                new_h = hidden[r, path_t[r, :a]]  # (a, H')
                new_t = torch.tensor([*path_tokens[1:], bonus], device=dev)  # (a,)
                # not drafted: the proposer gets these with its next call (after a refit)
                if proposers and off and not cast(NodeBudget, budget).off_for_good:
                    new_h = torch.cat([cast(Tensor, st.new_hidden), new_h])
                    new_t = torch.cat([cast(Tensor, st.new_tokens), new_t])
                st.new_hidden, st.new_tokens = new_h, new_t
                st.root = bonus
                if _emit(st.out, [*path_tokens[1:], bonus], stops, st.max_new):
                    finish(st, r)
                    rows[r] = None
            if on_step is not None:
                on_step(self)
        sync_device(dev)
        batch.time_s = time.perf_counter() - t_call
        batch.new_tokens = sum(len(res[0]) for res in results if res is not None)
        return [cast(tuple[list[int], RequestStats], res) for res in results]
