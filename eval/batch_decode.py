"""Batched greedy speculative decoding with continuous batching (B rows, one target forward per step).

Every row r of a `BatchKVCache` decodes its own request with its own proposer; a step verifies all rows'
trees in ONE target forward:

    refill free rows from the queue once `refill_rows` are free: prefill the admitted rows' prompts (up to
        `prefill_rows` rows, adjacent or not, in one padded forward), root_r = argmax, emit root_r,
        proposer_r.reset()
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

Two shapes of the same step, as for the single-prompt `static_decode.StaticDecoder`:
  * eager (`static=False`, the CPU default): trees padded to the largest tree of the step, attention over
    the longest active row's filled prefix (`span`), so the cost follows what is filled; only the rows
    from the first to the last active one run (once the queue is empty, finished rows at either end drop
    out of the forward);
  * fixed (`static=True`): trees padded to `rows_budget_for` (powers of two up to 8, then multiples of 8),
    copied into persistent (B, b) buffers,
    attention over the whole cache with the mask and write positions computed on the device from the
    per-row lengths, so every step of a budget has the same shapes and addresses; with `graphs=True`
    (CUDA) each budget's forward is captured once as a CUDA graph and replayed
    (`make_batch_decoder`: `eval.cuda_graphs`).
Either way greedy acceptance runs for all rows at once (`verify.greedy_verify_rows`) and the step reads one
packed (B, 2 + 2b) tensor: its only host sync.
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
from specdraft.eval.batch_width import WidthPolicy
from specdraft.eval.budget import (
    FULL,
    RECHECK_SIZES,
    SIZES,
    CapPolicy,
    CostCurve,
    NodeBudget,
    machine_key,
    time_round_robin,
)
from specdraft.eval.decode import (
    DecodeStats,
    Proposer,
    RowBatchedProposer,
    _emit,
    default_stop_ids,
    model_device,
    sync_device,
)
from specdraft.eval.graphs import CudaGraph, graphs_wanted, replay_or_run
from specdraft.eval.static_decode import budget_for
from specdraft.eval.tree import DraftTree
from specdraft.eval.verify import greedy_verify_rows, sample_token, sample_verify
from specdraft.models.attention import varying_shape_sdpa
from specdraft.models.base_llm import forward_with_hidden, lm_logits
from specdraft.models.fast_target import Packing, stack_linears

Sampling = tuple[float, int, float, torch.Generator | None]  # (temperature, top_k, top_p, generator)
PREFILL_TOKENS = 16384  # most padded prompt tokens one batched prefill forward takes (rows x longest prompt)
# where a profiled call's time goes: admitting and prefilling rows, drafting every row's tree, packing and
# verifying the trees (one target forward), the acceptance rule and its host read (plus the budget's
# bookkeeping), and the cache commit with every row's emitted tokens and next proposer inputs
PHASES = ("prefill", "draft", "verify", "accept", "commit")


def rows_budget_for(n: int) -> int:
    """The padded width of a batched fixed-shape verify whose largest tree has n nodes: the next power of two
    up to 8, then the next multiple of 8 (a 33-node ReDrafter tree verifies 40 nodes per row, not 64; a 17-node
    EAGLE tree 24, not 32). At batch 16 on an H100 the verify is no longer launch-bound (5.9 ms for 16 x 64
    nodes against 3.2 for 16 x 1, session 44), so padding costs arithmetic; a few more widths are captured."""
    return budget_for(n) if n <= 8 else -(-n // 8) * 8


def cache_margin(proposer: Proposer | None) -> int:
    """Cache positions per row beyond prompt + new tokens that a call with `proposer` (None: AR) needs: its
    largest padded tree and a slack of 64."""
    return budget_for(max(proposer.spec.node_budget, 1)) + 64 if proposer is not None else 2


@dataclass
class BatchStats:
    """What one `BatchDecoder.generate` call did as a whole."""

    rows: int = 0  # B
    requests: int = 0  # requests served
    steps: int = 0  # batched verify forwards
    prefills: int = 0  # prompts prefilled (up to `prefill_rows` of them per forward)
    new_tokens: int = 0  # emitted tokens over all requests
    time_s: float = 0.0  # wall time of the call
    idle_row_steps: int = 0  # rows without a request summed over steps (the forward still runs them)
    phase_s: dict[str, float] = field(default_factory=dict)  # profile=True: synced s per phase (PHASES)

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
            a call needs more. Each eager step attends over the longest active row's positions only (finished
            rows are emptied), so attention and GQA key expansion cost what is filled, not max_len.
        static: fixed-shape verify (power-of-two trees, whole-cache attention, device-side mask and positions).
        graphs: capture each budget's verify forward as a CUDA graph (needs `static` and a CUDA model).
        prefill_rows: most rows admitted together whose prompts are prefilled in one forward (any rows,
            padded to the longest prompt, at most `PREFILL_TOKENS` padded tokens); 1: one forward per prompt.
        pack_padding: on a CPU, leave the padding of an eager verify out of the per-token products
            (`fast_target.Packing`); False: compute every padded position (an A/B: the same tokens).
        refill_rows: free rows needed before queued requests are admitted (fewer when the queue holds
            fewer, and always when no row is active): on a GPU each refill is one eager prefill forward
            (~22 ms for SmolLM2 on an H100, session 44), and a drafter's rows finish at different steps, so
            refilling them one by one costs a forward each; 1: refill every free row at once.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size: int,
        max_len: int = 1024,
        static: bool = False,
        graphs: bool = False,
        prefill_rows: int = 1,
        pack_padding: bool = True,
        refill_rows: int = 1,
    ) -> None:
        emb = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
        self.model, self.device, self.dtype = model, emb.device, emb.dtype
        if graphs and (not static or self.device.type != "cuda"):
            raise ValueError("graphs=True needs static=True and a model on a CUDA device")
        if prefill_rows < 1:
            raise ValueError(f"prefill_rows={prefill_rows}: must be >= 1")
        if not 1 <= refill_rows <= batch_size:
            raise ValueError(f"refill_rows={refill_rows}: must be in [1, batch size {batch_size}]")
        self.batch_size, self.static, self.graphs = batch_size, static, graphs
        self.prefill_rows, self.pack_padding, self.refill_rows = prefill_rows, pack_padding, refill_rows
        stack_linears(model)  # the target's weights move into their stacks before any graph reads them
        self.cache = BatchKVCache(model, batch_size, max_len)
        self.committed: list[list[int]] = [[] for _ in range(batch_size)]  # tokens whose K/V row r holds
        self._inputs: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # static: b -> (tokens, ancestors, depth)
        self._graphs: dict[tuple, CudaGraph[tuple[Tensor, Tensor]] | None] = {}
        # the proposers of the last factory, kept for the next call with the same factory (their CUDA graphs
        # and buffers with them: a timed call then replays what a warm-up captured)
        self._made: tuple[Callable[[], Proposer], list[Proposer]] | None = None
        self._capped = False  # whether a call fitted those proposers to a node cap (undone on reuse)

    def reserve(self, max_len: int) -> None:
        """Grow the cache to at least `max_len` positions per row now (a benchmark sizes it once before its
        warm-ups, so that no timed call reallocates it and drops the verify graphs captured on it)."""
        if max_len > self.cache.max_len:
            self._new_cache(max_len)

    def proposers_for(self, factory: Callable[[], Proposer] | None) -> list[Proposer]:
        """One proposer per row from `factory` (None: AR, no proposers). A call with the factory of the previous
        call gets the same proposers back, with their full trees restored (`fit_budget(FULL)`) if that call
        capped them; each row's proposer is reset when the row takes a request, so only what outlives a
        request carries over: captured draft graphs, buffers, calibrations."""
        if factory is None:
            return []
        if self._made is not None and self._made[0] is factory:
            for p in self._made[1] if self._capped else ():
                p.fit_budget(FULL)
            self._capped = False
            return self._made[1]
        self._made, self._capped = (factory, [factory() for _ in range(self.batch_size)]), False
        return self._made[1]

    def _fit_proposers(self, proposers: list[Proposer], nodes: int) -> None:
        """Tell every row's proposer the node cap `nodes` (`Proposer.fit_budget`), remembering that they are
        capped (`proposers_for` restores their full trees on reuse)."""
        for p in proposers:
            p.fit_budget(nodes)
        self._capped = True

    def _new_cache(self, max_len: int) -> None:
        """Reallocate the cache at `max_len` positions per row (captured graphs read the old one: dropped)."""
        self.cache = BatchKVCache(self.model, self.batch_size, max_len)
        self._graphs.clear()

    def path_name(self) -> str:
        """ "eager" | "fixed" | "graph": the shape of this decoder's verify (a cost-curve cache key)."""
        return "graph" if self.graphs else "fixed" if self.static else "eager"

    def _forward(
        self,
        rows: slice | list[int],
        tokens: Tensor,
        ancestors: Tensor,
        depth: Tensor,
        layers: tuple[int, ...],
        keep_last: bool,
        span: int | None = None,
        logits_at: Tensor | None = None,
        valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One target forward of R rows over L new positions each, written after each row's committed ones.

        Args:
            rows: the cache rows (R of them): a slice, or a list of row indices (a prefill of rows that are not
                adjacent; their keys are read as a copy).
            tokens: (R, L) long; ancestors: (R, L, L) bool ancestor-or-self; depth: (R, L) long.
            layers, keep_last: the proposer's features (as `decode.target_forward`).
            span: positions attention reads per row; None: the longest of these rows' filled prefixes + L
                (read from the host lengths); the fixed shape passes `max_len` (nothing read on the host).
            logits_at: (R,) long, the one position per row whose logits are wanted (a prefill's last prompt
                token: the LM head is ~a fifth of a small model's FLOPs per position); None: all L.
            valid: (R, L) bool, the real tree nodes; on a CPU (the eager path, where a product's cost follows
                its rows) the padding is left out of every per-token product and the LM head
                (`fast_target.Packing`); its logits and states are then unspecified (never accepted or read).

        Returns:
            logits (R, L, V), or (R, 1, V) with `logits_at`; hidden (R, L, H') last-layer states or the
            requested layers.
        """
        c, (r, n) = self.cache, tokens.shape
        if isinstance(rows, slice):
            where: slice | Tensor = rows
            host = c.lengths[rows]
        else:
            where, host = torch.tensor(rows, device=self.device), [c.lengths[i] for i in rows]  # (R,)
        lengths = c.lengths_t[where]  # (R,)
        if span is None:
            span = max(host) + n  # attend over the filled prefix only (host lengths: no sync)
        c.prepare_write(where, lengths[:, None] + torch.arange(n, device=self.device), span)  # (R, L)
        rel = torch.arange(c.span, device=self.device)[None] - lengths[:, None]  # (R, S)
        in_tree = (rel >= 0) & (rel < n)
        col = rel.clamp(0, n - 1)[:, None, :].expand(r, n, c.span)  # (R, L, S)
        visible = (ancestors.gather(2, col) & in_tree[:, None]) | (rel < 0)[:, None]  # (R, L, S)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        mask = torch.where(visible, zero, torch.finfo(self.dtype).min)[:, None]  # (R, 1, L, S)
        on_cpu = self.pack_padding and self.device.type == "cpu"
        pack = Packing.of(valid) if valid is not None and on_cpu else None
        with varying_shape_sdpa(
            self.device
        ):  # eager spans and prefills vary (a capture keeps torch's choice)
            out = forward_with_hidden(
                cast(PreTrainedModel, self.model),
                tokens,
                attention_mask=mask,
                position_ids=lengths[:, None] + depth,  # (R, L)
                past_key_values=c,
                layers=layers,
                use_cache=True,
                logits=False,
                fast=True,
                packed=pack,
            )
        hidden = out.hidden  # (R, L, H)
        if pack is not None and logits_at is None:  # the head on the real nodes only, into an unfilled buffer
            wanted = lm_logits(cast(PreTrainedModel, self.model), pack.gather(hidden))  # (T, V)
            logits = pack.spread(wanted, zeros=False)  # (R, L, V)
        else:
            head_in = (
                hidden
                if logits_at is None
                else hidden[torch.arange(r, device=self.device), logits_at][:, None]
            )
            logits = lm_logits(cast(PreTrainedModel, self.model), head_in)  # (R, L, V) | (R, 1, V)
        if layers:
            assert out.layers is not None
            extra = out.layers.flatten(-2)  # (R, L, m*H)
            hidden = torch.cat([hidden, extra], dim=-1) if keep_last else extra
        return logits, hidden

    def _verify(
        self,
        tokens: Tensor,
        ancestors: Tensor,
        depth: Tensor,
        layers: tuple[int, ...],
        keep_last: bool,
        rows: slice | None = None,
        valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One verify forward of every row's padded tree, on this decoder's path.

        Args:
            tokens: (R, b) long; ancestors: (R, b, b) bool; depth: (R, b) long (`_pack_trees`), for the R
                cache rows `rows` (None: all B; the fixed-shape path always runs all B).
            layers, keep_last: the proposer's features.
            valid: (R, b) bool, the real nodes (the eager path on a CPU computes only those; see `_forward`).

        Returns:
            logits (R, b, V); hidden (R, b, H'). On the graph path both are the graph's own output buffers,
            overwritten by the next replay (callers index them, which copies).
        """
        rows = slice(0, self.batch_size) if rows is None else rows
        if not self.static:
            return self._forward(rows, tokens, ancestors, depth, layers, keep_last, valid=valid)
        b = tokens.shape[1]
        if b not in self._inputs:
            self._inputs[b] = (torch.empty_like(tokens), torch.empty_like(ancestors), torch.empty_like(depth))
        buf = self._inputs[b]
        for dst, src in zip(buf, (tokens, ancestors, depth), strict=True):
            dst.copy_(src)

        def run() -> tuple[Tensor, Tensor]:
            return self._forward(rows, *buf, layers, keep_last, span=self.cache.max_len)

        if not self.graphs:
            return run()
        what = f"a {self.batch_size}-row {b}-node verify"
        return replay_or_run(self._graphs, (b, layers, keep_last), run, self.device, what)

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
            self._new_cache(prefix + max(sizes))
        for r in range(B):
            self._release(r)
        ids = torch.randint(0, vocab, (B, prefix), generator=g, device="cpu").to(dev)  # (B, P)
        causal = torch.ones(prefix, prefix, dtype=torch.bool, device=dev).tril()[None].expand(B, -1, -1)
        self._forward(
            slice(0, B), ids, causal, torch.arange(prefix, device=dev)[None].expand(B, -1), (), False
        )
        for r in range(B):
            self.cache.set_length(r, prefix)
        toks = {
            b: torch.randint(0, vocab, (B, b), generator=g, device="cpu").to(dev) for b in sizes
        }  # (B, b) each

        def verify(b: int) -> None:
            chain = torch.ones(b, b, dtype=torch.bool, device=dev).tril()[None].expand(B, -1, -1)  # (B, b, b)
            depth = torch.arange(b, device=dev)[None].expand(B, -1)  # (B, b)
            logits, _ = self._verify(toks[b], chain, depth, (), False)
            logits.float().argmax(-1).tolist()  # the step's host sync, as in `generate`

        ms = time_round_robin(verify, sizes, reps, dev)
        for r in range(B):
            self._release(r)
        return ms

    def row_cost_curve(self, refresh: bool = False, log: Callable[[str], None] = print) -> CostCurve:
        """This batch size's verify cost per row (ms of a B-row forward / B), cached per machine and B: with it
        a `NodeBudget` fed one observation per row and step maximises the batch's tokens/s, since
        sum_r gain_r / (cost_B(b) + sum_r draft_r) = mean gain / (cost_B(b) / B + mean draft)."""
        path = "" if not self.static else f"-{self.path_name()}"  # eager keeps its earlier key
        key = machine_key(self.model, f"batch{self.batch_size}{path}")
        curve = CostCurve.load_or_measure(
            key,
            self.measure_costs,
            refresh=refresh,
            log=log,
            recheck=lambda: self.measure_costs(RECHECK_SIZES, reps=3),  # this machine's speed and shape now
        )
        return CostCurve({b: ms / self.batch_size for b, ms in curve.ms.items()})

    def _release(self, row: int) -> None:
        """Empty `row` (no committed positions): an idle row's dummy writes land at its start, and it never
        widens the attention span."""
        self.cache.set_length(row, 0)
        self.committed[row] = []

    def _prefill(
        self,
        starts: list[tuple[int, _Row]],
        prompts: list[list[int]],
        layers: tuple[int, ...],
        keep_last: bool,
        sampling: Sampling | None,
    ) -> None:
        """Prefill each started row's prompt (the other rows keep their caches), `prefill_rows` rows per forward,
        adjacent or not (their prompts padded to the longest; the padding's K/V land past each row's length and
        are overwritten later); set each state's root (argmax, or drawn with `sampling`, in row order) and its
        proposer inputs: hidden (P, H') and next tokens (P,).

        Args:
            starts: (row, state) of the rows admitted this round, rows ascending.
            prompts: their prompts (P_i,) each, in the same order.
        """
        groups: list[list[int]] = []  # indices into `starts`: at most `prefill_rows` rows each
        for k in range(len(starts)):
            g = groups[-1] if groups else None
            widest = max([len(prompts[j]) for j in g] + [len(prompts[k])]) if g else 0
            fits = g is not None and len(g) < self.prefill_rows and widest * (len(g) + 1) <= PREFILL_TOKENS
            if g is not None and fits:
                g.append(k)
            else:
                groups.append([k])
        for g in groups:
            lens = [len(prompts[k]) for k in g]
            if min(lens) == 0:
                raise ValueError(f"request {starts[g[lens.index(0)]][1].request}: empty prompt")
            at = [starts[k][0] for k in g]  # the group's rows, ascending
            n, p = len(g), max(lens)
            rows: slice | list[int] = slice(at[0], at[0] + n) if at[-1] - at[0] == n - 1 else at
            for k in g:
                self.cache.set_length(starts[k][0], 0)
            padded = [prompts[k] + [prompts[k][-1]] * (p - len(prompts[k])) for k in g]
            ids = torch.tensor(padded, dtype=torch.long, device=self.device)  # (n, P)
            causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()[None].expand(n, -1, -1)
            depth = torch.arange(p, device=self.device)[None].expand(n, -1)  # (n, P)
            last = torch.tensor([x - 1 for x in lens], device=self.device)  # (n,)
            logits, hidden = self._forward(
                rows, ids, causal, depth, layers, keep_last, logits_at=last
            )  # (n, 1, V), (n, P, H')
            if sampling is None:
                roots = logits[:, 0].float().argmax(-1).tolist()
            else:
                roots = [sample_token(logits[i, 0], *sampling) for i in range(n)]
            for i, k in enumerate(g):
                row, st = starts[k]
                self.cache.set_length(row, lens[i])
                self.committed[row] = list(prompts[k])
                st.root = int(roots[i])
                st.stats.prefill_s = time.perf_counter() - st.t0
                st.new_hidden = hidden[i, : lens[i]]  # (P_i, H')
                st.new_tokens = torch.tensor([*prompts[k][1:], st.root], device=self.device)  # (P_i,)

    @torch.inference_mode()
    def generate(
        self,
        requests: list[list[int]],
        max_new_tokens: int | list[int],
        stop_ids: set[int] | None = None,
        proposer_factory: Callable[[], Proposer] | None = None,
        on_step: Callable[[BatchDecoder], None] | None = None,
        order: list[int] | None = None,
        budget: CapPolicy | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        profile: bool = False,
        width: WidthPolicy | None = None,
    ) -> list[tuple[list[int], RequestStats]]:
        """Decode every request greedily, B at a time, refilling rows as requests finish.

        Args:
            requests: prompt token ids per request (chat template already applied).
            max_new_tokens: budget of emitted tokens, one for all or one per request.
            stop_ids: tokens that end a request (kept); None: the model's generation-config EOS ids.
            proposer_factory: makes one proposer per row slot (`reset()` on every refill); None: AR. The same
                factory as the previous call's reuses that call's proposers (`proposers_for`).
            on_step: called after every batched step's compaction (tests inspect the cache there).
            order: the order in which queued requests are admitted to free rows, a permutation of the request
                indices (`eval.scheduler.schedule_order`); None: FIFO (arrival order). Outputs do not depend on it.
            budget: one node budget for all rows (`budget.CapPolicy`): a `NodeBudget` fitted on this batch
                size's cost curve per row (`row_cost_curve`), or a `BanditBudget` choosing each step's cap from
                the batch's measured tokens per second; every row's tree is cut to its first `cap` nodes, or no
                row drafts when `cap == 1`; its state carries over calls (greedy calls only). Outputs do not
                depend on it.
            temperature, top_k, top_p: 0 = greedy; > 0 = sample every row from the target's warped
                distribution (`verify.warp_probs`), losslessly, as `decode.speculative_generate` does.
            generator: RNG for sampling (on the model's device), shared by the rows in row order.
            profile: synchronise the device at every phase boundary and add each phase's time to
                `stats.batch.phase_s` (`PHASES`; the syncs cost a little time: profile a separate call).
            width: one verify width per step chosen from every row's calibrated confidence, with a fallback
                to plain steps (`batch_width.WidthPolicy`, `eval.batch_width`), within a fixed `budget`'s cap if
                one is given (a fitted budget is refused); greedy calls only; its state (calibration, fallback)
                carries over calls. Outputs do not depend on it.

        Returns:
            (new tokens, stats) per request, in request order; `stats.batch` holds the call's throughput.
        """
        budgets = (
            [max_new_tokens] * len(requests) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        )
        if len(budgets) != len(requests):
            raise ValueError(f"{len(budgets)} max_new_tokens for {len(requests)} requests")
        fixed = isinstance(budget, NodeBudget) and budget.settled and budget.refit_gap <= 0
        if budget is not None and width is not None and not fixed:
            raise ValueError(
                "generate: a width policy takes a fixed node budget (NodeBudget.fixed), not a fitted one"
            )
        if order is not None and sorted(order) != list(range(len(requests))):
            raise ValueError(f"order must be a permutation of the {len(requests)} request indices")
        stops = default_stop_ids(None, self.model) if stop_ids is None else set(stop_ids)
        B, dev = self.batch_size, self.device
        proposers = self.proposers_for(proposer_factory)
        layers = proposers[0].spec.feature_layers if proposers else ()
        keep_last = proposers[0].spec.keep_last_hidden if proposers else False
        margin = cache_margin(proposers[0] if proposers else None)
        needed = max((len(p) + m for p, m in zip(requests, budgets, strict=True)), default=0) + margin
        if needed > self.cache.max_len:  # exactly what this call needs
            self._new_cache(needed)
        for r in range(B):
            self._release(r)
        batch = BatchStats(rows=B, requests=len(requests))
        results: list[tuple[list[int], RequestStats] | None] = [None] * len(requests)
        rows: list[_Row | None] = [None] * B
        queue = deque(range(len(requests)) if order is None else order)
        sampling: Sampling | None = (temperature, top_k, top_p, generator) if temperature > 0 else None
        # the budget's cap, or its phase-1 probe (never past the largest size that could pay on this curve)
        spec = proposers[0].spec if proposers else None
        limit = budget.start(spec.max_depth, spec.node_budget) if budget is not None and spec else FULL
        # the node cap the proposers draft at now: the budget's, or lower where the width policy left them
        drafting_at = min(limit, width.draft_nodes or FULL) if width is not None else limit
        if drafting_at < FULL:
            self._fit_proposers(proposers, drafting_at)
        sync_device(dev)
        t_call = time.perf_counter()
        mark = [t_call]  # profile: when the current phase began

        def lap(phase: str) -> None:
            """profile: the time since the last lap goes to `phase` (after a device sync)."""
            if profile:
                sync_device(dev)
                now = time.perf_counter()
                batch.phase_s[phase] = batch.phase_s.get(phase, 0.0) + now - mark[0]
                mark[0] = now

        def finish(st: _Row, row: int) -> None:
            self._release(row)  # its K/V are not needed any more
            sync_device(dev)
            st.stats.time_s = time.perf_counter() - st.t0
            st.stats.new_tokens = len(st.out)
            st.stats.finish_reason = "stop" if st.out and st.out[-1] in stops else "length"
            results[st.request] = (st.out, st.stats)

        while True:
            lap("commit")  # the previous step's commit and bookkeeping (first: the call's set-up)
            t_refill = time.perf_counter()  # (what refilling takes is no decode step's: `budget.tick`)
            # refill free rows, prefilled together, once `refill_rows` are free (or as many as are queued, or
            # no row is active); a request may finish at its first token
            while queue and (
                sum(st is None for st in rows) >= min(self.refill_rows, len(queue))
                or all(st is None for st in rows)
            ):
                starts: list[tuple[int, _Row]] = []
                for r in range(B):
                    while rows[r] is None and queue:
                        i = queue.popleft()
                        st = _Row(
                            i,
                            budgets[i],
                            RequestStats(prompt_tokens=len(requests[i]), batch=batch),
                            time.perf_counter(),
                        )
                        if st.max_new <= 0:
                            finish(st, r)
                            continue
                        rows[r] = st
                        starts.append((r, st))
                if not starts:
                    break
                self._prefill(starts, [requests[st.request] for _, st in starts], layers, keep_last, sampling)
                batch.prefills += len(starts)
                for r, st in starts:
                    if proposers:
                        proposers[r].reset()
                    if _emit(st.out, [st.root], stops, st.max_new):
                        finish(st, r)
                        rows[r] = None
            active = [r for r in range(B) if rows[r] is not None]
            lap("prefill")
            if not active:
                break
            refill_s = time.perf_counter() - t_refill
            if budget is not None and proposers and sampling is None and budget.tick(len(active), refill_s):
                self._fit_proposers(proposers, budget.refit_cap())  # a refit's probe size, a bandit's new cap
            fitting = budget is not None and not budget.settled and bool(proposers) and sampling is None
            off = budget is not None and budget.cap == 1  # drafting does not pay at this batch size
            widths = width if width is not None and proposers and sampling is None else None
            off = off or (widths is not None and not widths.drafting())  # the width policy's fallback
            trees: dict[int, DraftTree] = {}  # drafted rows; the others verify their root alone (AR)
            draft_s: dict[int, float] = {}  # per row: the proposer's time this step
            if proposers and not off:
                drafted, draft_s = _draft_rows(proposers, active, cast(list[_Row], rows), dev)
                cap = budget.drafting_cap if budget is not None else None
                trees = {r: t.truncated(cap) if cap else t for r, t in drafted.items()}
                if widths is not None:  # one width for the step, from every row's confidence
                    n_rows = B if self.static else active[-1] - active[0] + 1
                    pad = rows_budget_for if self.static else (lambda n: n)
                    real_only = (
                        not self.static and self.pack_padding and dev.type == "cpu"
                    )  # cost: real nodes
                    trees = widths.choose(trees, 1e3 * sum(draft_s.values()), n_rows, pad, real_only)
                    if widths.draft_nodes and min(widths.draft_nodes, limit) != drafting_at:
                        drafting_at = min(widths.draft_nodes, limit)  # draft what the batch keeps, and more
                        self._fit_proposers(proposers, drafting_at)
            lap("draft")
            room = self.cache.max_len - max(self.cache.lengths[r] for r in active)  # in the fullest row
            if self.static:  # the padded size must fit: the largest power of two that does
                room = 1 << (room.bit_length() - 1)
            trees = {r: t.truncated(room) for r, t in trees.items()}
            b = max((t.num_nodes for t in trees.values()), default=1)
            b = rows_budget_for(b) if self.static else b
            roots = [st.root if st is not None else 0 for st in rows]
            tokens, parents, anc, depth, valid = _pack_trees(
                trees, roots, b, dev
            )  # (B, b) each, anc (B, b, b)
            # the eager path verifies only the rows from the first to the last active one (the queue's tail)
            lo, hi = (active[0], active[-1] + 1) if not self.static else (0, B)
            live = slice(lo, hi)
            logits, hidden = self._verify(
                tokens[live], anc[live], depth[live], layers, keep_last, live, valid[live]
            )  # (R, b, V), (R, b, H'), R = hi - lo
            lap("verify")
            gains = fitting and not off and budget is not None and budget.cap is None  # phase 1: gain curves
            # (B, 2 + 2b [+ b]): [a, bonus, path (b,), path tokens (b,) [, gains (b,)]]; rows outside
            # `live` (idle) accept nothing, with the identity path
            packed = torch.zeros(B, 2 + 2 * b + (b if gains else 0), dtype=torch.long, device=dev)
            packed[:, 2 : 2 + b] = torch.arange(b, device=dev)
            if sampling is None:
                packed[live] = greedy_verify_rows(
                    tokens[live], parents[live], anc[live], depth[live], logits, valid[live], gains
                )
            else:  # the same layout from the sampling rule, row by row
                for r in active:
                    tree = trees[r] if r in trees else DraftTree(tokens[r, :1], parents[r, :1])
                    lg = logits[r - lo, : tree.num_nodes]  # (n, V)
                    path, bonus = sample_verify(tree, lg, *sampling)  # (a,), int
                    a = path.shape[0]
                    packed[r, 0], packed[r, 1] = a, bonus
                    packed[r, 2 : 2 + a], packed[r, 2 + b : 2 + b + a] = path, tokens[r, path]
            vals = packed.tolist()  # the step's one host sync
            accepted = [int(vals[r][0]) if rows[r] is not None else 0 for r in range(B)]
            if widths is not None and trees:  # the calibration learns which verified nodes were accepted
                widths.observe(
                    {r: vals[r][2 : 2 + accepted[r]] for r in trees},
                    {r: t.num_nodes for r, t in trees.items()},
                )
            if budget is not None and proposers and sampling is None and not off:  # fit, drift test, bandit
                prev_cap = budget.cap
                for r in active:
                    n = trees[r].num_nodes
                    budget.observe(
                        draft_s[r], accepted[r], vals[r][2 + 2 * b : 2 + 2 * b + n] if gains else None
                    )
                if budget.cap != prev_cap:  # a new cap: the proposers may draft less from now on
                    self._fit_proposers(proposers, cast(int, budget.cap))
            lap("accept")
            path_t = packed[:, 2 : 2 + b]  # (B, b) padded paths
            # path[a-1] == a-1 in every row (paths ascend from 0): nothing to move, known without a sync
            in_place = all(vals[r][1 + accepted[r]] == accepted[r] - 1 for r in active)
            self.cache.commit(path_t, accepted, in_place)
            batch.steps += 1
            batch.idle_row_steps += B - len(active)
            if (
                proposers
            ):  # every live row's next proposer inputs in a few kernels (not 2 per row): the states
                # of its newly committed positions (a gather: graph outputs are overwritten) and the token each
                # predicts, path tokens 1 .. a - 1 then the bonus at a - 1
                lp = path_t[live]  # (R, b)
                new_hs = hidden.gather(1, lp[..., None].expand(-1, -1, hidden.shape[-1]))  # (R, b, H')
                new_ts = torch.cat([packed[live, 3 + b : 2 + 2 * b], packed[live, :1]], dim=1)  # (R, b)
                new_ts.scatter_(1, packed[live, :1].clamp_min(1) - 1, packed[live, 1:2])
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
                st.stats.tree_sizes.append(trees[r].num_nodes if r in trees else 1)
                if proposers and proposers[r].last_compression is not None:
                    st.stats.compression.append(float(cast(float, proposers[r].last_compression)))
                if proposers:  # the proposer's next inputs: the newly committed positions
                    new_h, new_t = new_hs[r - lo, :a], new_ts[r - lo, :a]  # (a, H'), (a,)
                    if off and not (budget is not None and budget.off_for_good):  # kept for its next call
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


class OneRowAtATime:
    """`inner` drafted row by row even where its family drafts rows together: the A/B of batched drafting
    (`scripts/bench_batch.py --draft-rows each`); trees and output are the same, only the drafting time differs.

    Args:
        inner: any proposer (its spec and budget pass through).
    """

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.spec = inner, inner.spec
        self.last_compression: float | None = None

    def reset(self) -> None:
        """Forget the previous prompt."""
        self.inner.reset()

    def fit_budget(self, nodes: int) -> None:
        """As `inner`."""
        self.inner.fit_budget(nodes)

    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """`inner.propose`: hidden (n, F), tokens (n,)."""
        tree = self.inner.propose(hidden, tokens)
        self.last_compression = self.inner.last_compression
        return tree


def _draft_rows(
    proposers: list[Proposer], active: list[int], rows: list[_Row], device: torch.device
) -> tuple[dict[int, DraftTree], dict[int, float]]:
    """Every active row's tree: one call for all of them when the proposers draft rows together
    (`RowBatchedProposer`: ReDrafter's beams of every row in one search, Medusa's heads run once, EAGLE's
    levels one head pass each), else
    `propose` row by row.

    Args:
        proposers: one per batch row.
        active: the rows with a request (R of them).
        rows: per row its request state (`new_hidden` (n, F), `new_tokens` (n,)); active rows are set.
        device: the target's device (trees are moved there).

    Returns:
        trees per active row, and per active row its share of the drafting time in s (a batched call's time
        split evenly over its rows, so a `NodeBudget` fed one observation per row sees the batch's cost).
    """
    hidden = [cast(Tensor, rows[r].new_hidden) for r in active]  # R of (n_r, F)
    tokens = [cast(Tensor, rows[r].new_tokens) for r in active]  # R of (n_r,)
    lead = proposers[active[0]]
    t0 = time.perf_counter()
    if isinstance(lead, RowBatchedProposer):
        together = lead.propose_rows([proposers[r] for r in active], hidden, tokens)
        if together is not None:
            share = (time.perf_counter() - t0) / len(active)
            return {r: t.to(device) for r, t in zip(active, together, strict=True)}, dict.fromkeys(
                active, share
            )
    trees: dict[int, DraftTree] = {}
    times: dict[int, float] = {}
    for r, h, t in zip(active, hidden, tokens, strict=True):
        t0 = time.perf_counter()
        trees[r] = proposers[r].propose(h, t).to(device)
        times[r] = time.perf_counter() - t0
    return trees, times


def _pack_trees(
    trees: dict[int, DraftTree], roots: list[int], b: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The (B, b) verify inputs of one step: row r holds `trees[r]` (a row without a tree: its root alone),
    then dummy nodes, children of node 0 that see only node 0 and themselves and are never accepted.

    Args:
        trees: drafted rows' trees (at most b nodes each).
        roots: (B,) each row's root token (an idle row: anything).
        b: padded nodes per row.
        device: the target's device.

    Returns:
        tokens (B, b) long, parents (B, b) long, ancestors (B, b, b) bool, depth (B, b) long, valid (B, b) bool.
    """
    B = len(roots)
    tokens = torch.tensor(roots, dtype=torch.long, device=device)[:, None].repeat(1, b)  # (B, b)
    eye = torch.eye(b, dtype=torch.bool, device=device)
    anc = (eye | (torch.arange(b, device=device) == 0)[None]).repeat(B, 1, 1)  # (B, b, b)
    depth = (torch.arange(b, device=device) > 0).long().repeat(B, 1)  # (B, b)
    parents = torch.zeros(B, b, dtype=torch.long, device=device)  # (B, b)
    parents[:, 0] = -1
    valid = torch.zeros(B, b, dtype=torch.bool, device=device)  # (B, b)
    valid[:, 0] = True
    sizes = {t.num_nodes for t in trees.values()}
    if len(trees) > 1 and len(sizes) == 1:  # one size (the fixed-shape proposers): a few kernels for all rows
        n, ts = sizes.pop(), list(trees.values())
        at = torch.tensor(list(trees), device=device)  # (R,) rows
        tokens[at, :n] = torch.stack([t.tokens for t in ts])  # (R, n)
        parents[at, :n] = torch.stack([t.parents for t in ts])
        depth[at, :n] = torch.stack([cast(Tensor, t.depth) for t in ts])
        valid[at, :n] = True
        anc[at, :n, :n] = torch.stack([cast(Tensor, t.ancestors) for t in ts])  # (R, n, n)
        return tokens, parents, anc, depth, valid
    for r, t in trees.items():
        n = t.num_nodes
        tokens[r, :n], parents[r, :n], depth[r, :n] = t.tokens, t.parents, cast(Tensor, t.depth)
        valid[r, :n] = True
        anc[r, :n, :n] = cast(Tensor, t.ancestors)
    return tokens, parents, anc, depth, valid


def make_batch_decoder(
    model: nn.Module,
    batch_size: int,
    cuda_graphs: str = "auto",
    max_len: int = 1,
    prefill_rows: int = 0,
    refill_rows: int = 0,
) -> BatchDecoder:
    """The batch decoder `eval.cuda_graphs` asks for: fixed-shape verify captured as CUDA graphs when on
    (auto: exactly when the target is on CUDA), else the eager path.

    Args:
        model: the target.
        batch_size: B.
        cuda_graphs: "auto" | "on" | "off".
        max_len: initial cache capacity per row (default 1: sized snugly by the first call).
        prefill_rows: `eval.prefill_rows`, rows prefilled per forward (0: `auto_prefill_rows`).
        refill_rows: `eval.refill_rows`, free rows before a refill (0: `auto_refill_rows`; at most B).
    """
    device = model_device(model)
    graphs = graphs_wanted(device, cuda_graphs)
    rows = prefill_rows or auto_prefill_rows(device, batch_size)
    refill = min(refill_rows or auto_refill_rows(device, batch_size), batch_size)
    return BatchDecoder(
        model, batch_size, max_len, static=graphs, graphs=graphs, prefill_rows=rows, refill_rows=refill
    )


def auto_prefill_rows(device: torch.device, batch_size: int) -> int:
    """`eval.prefill_rows=0`: every admitted row in one forward on a GPU, where an eager forward costs its
    launches whatever its size (~41 ms for SmolLM2 on an H100); one row at a time on a CPU, where padding to
    the longest prompt costs compute (AR at batch 16 on a 2-core EPYC, 32 MT-Bench first turns: 0.61-0.77x
    of row by row)."""
    return batch_size if device.type == "cuda" else 1


def auto_refill_rows(device: torch.device, batch_size: int) -> int:
    """`eval.refill_rows=0`: a quarter of the rows on a GPU, where every refill is an eager prefill forward
    (~22 ms for SmolLM2 on an H100 whatever its rows: at batch 16 a drafter spent 4.2 ms a step refilling
    rows one by one, AR 0.9, session 44); every free row at once on a CPU, where a prefill costs its tokens,
    not its launches (and `auto_prefill_rows` prefills one row per forward there anyway)."""
    return max(1, batch_size // 4) if device.type == "cuda" else 1
