"""The static decode path: a preallocated KV cache, one host sync per step, CUDA graphs where they pay.

Same loops, acceptance rules and outputs as `decode.py` (the dynamic path, kept as the reference and for
old-vs-new benchmarks), but shaped the way gpt-fast shapes decoding:

  * the decoder owns a `StaticKVCache` (allocated once, reused across calls); accepted-path compaction is an
    in-place index copy and `length` a counter;
  * greedy verification runs on the device and returns one packed tensor `[a, bonus, path, path tokens]`;
    reading it is the step's single host sync;
  * with `static=True` every verify has a fixed shape: the tree is padded to a node budget (the next power of
    two, so a few shapes at most) with masked dummy nodes, the (1, 1, b, max_len) mask and the positions are
    computed on the device from the length counter, and with `graphs=True` (CUDA) each budget's target
    forward is captured once as a CUDA graph and replayed.

On a CPU the defaults (`static=False`) run the same code eagerly on exact-size trees: attention reads the
views `[:length + n]`, so no padding is paid for where launches cost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdraft.eval.budget import SIZES, CapPolicy, time_round_robin
from specdraft.eval.decode import (
    DecodeStats,
    Proposer,
    _emit,
    _finish,
    _setup,
    model_device,
    sync_device,
    target_forward,
)
from specdraft.eval.fallback import FallbackController
from specdraft.eval.graphs import CudaGraph, graphs_wanted, replay_or_run
from specdraft.eval.static_kv import StaticKVCache
from specdraft.eval.tree import DraftTree, tree_attention_mask, tree_position_ids
from specdraft.eval.verify import greedy_verify_host, greedy_verify_packed, sample_token, sample_verify
from specdraft.models.fast_target import one_call_layers, stack_linears

VerifyFn = Callable[[DraftTree, Tensor], tuple[Tensor, int]]
AR_QUEUE = 8  # greedy AR on the fixed-shape path: tokens per host sync (`StaticDecoder._ar_queued`)
# eager path on a CPU panel target: a prompt goes through the one-call layer loop in causal chunks of this many
# positions (`StaticDecoder._prefill_chunks`; 2-core EPYC fp32, session 49: 16 / 64 / 256 / 600 tokens
# 97 / 206 / 657 / 1,383 -> 42 / 142 / 491 / 1,412 ms against transformers' causal forward)
PREFILL_CHUNK = 256


def budget_for(n: int) -> int:
    """The padded node budget of an n-node tree: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(n - 1, 0).bit_length()


class _TreeInputs:
    """Static input buffers of one padded verify forward of b nodes (graph inputs keep their addresses)."""

    def __init__(self, b: int, device: torch.device) -> None:
        self.b = b
        self.tokens = torch.zeros(1, b, dtype=torch.long, device=device)  # (1, b)
        self.parents = torch.zeros(b, dtype=torch.long, device=device)  # (b,)
        self.ancestors = torch.zeros(b, b, dtype=torch.bool, device=device)  # (b, b)
        self.depth = torch.zeros(b, dtype=torch.long, device=device)  # (b,)
        self.valid = torch.zeros(b, dtype=torch.bool, device=device)  # (b,)

    def fill(self, tree: DraftTree) -> None:
        """Copy an n <= b node tree in; nodes n..b-1 become dummies: children of the root that see only the
        root and themselves, never accepted."""
        n, b = tree.num_nodes, self.b
        assert tree.ancestors is not None and tree.depth is not None
        self.tokens[0, :n] = tree.tokens
        self.tokens[0, n:] = tree.tokens[0]
        self.parents[:n] = tree.parents
        self.parents[n:] = 0
        self.ancestors.zero_()
        self.ancestors[:n, :n] = tree.ancestors
        pad = torch.arange(n, b, device=self.tokens.device)
        self.ancestors[pad, pad] = True
        self.ancestors[n:, 0] = True
        self.depth[:n] = tree.depth
        self.depth[n:] = 1
        self.valid[:n] = True
        self.valid[n:] = False


class StaticDecoder:
    """AR and tree-speculative decoding over a preallocated cache (see module docstring).

    Args:
        model: HF causal LM, frozen, batch size 1.
        max_len: cache capacity (prompt + new tokens + one tree); grown (reallocated) when a call needs more.
        static: fixed-shape verify (padded trees, whole-buffer attention, device-side positions and mask).
        graphs: capture each budget's verify forward as a CUDA graph (needs `static` and a CUDA model).
    """

    def __init__(
        self, model: nn.Module, max_len: int = 1024, static: bool = False, graphs: bool = False
    ) -> None:
        emb = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
        self.model, self.device, self.dtype = model, emb.device, emb.dtype
        if graphs and (not static or self.device.type != "cuda"):
            raise ValueError("graphs=True needs static=True and a model on a CUDA device")
        self.static, self.graphs = static, graphs
        stack_linears(model)  # the target's weights move into their stacks before any graph reads them
        self.cache = StaticKVCache(model, max_len, static)
        self._inputs: dict[int, _TreeInputs] = {}
        self._graphs: dict[tuple, CudaGraph[tuple[Tensor, Tensor]] | None] = {}
        # greedy steps: the verify forward and `greedy_verify_packed` in one graph (`_forward_verified`)
        self._verified: dict[tuple, CudaGraph[tuple[Tensor, Tensor, Tensor]] | None] = {}

    # -- cache ------------------------------------------------------------------------------------------
    def _reserve(self, needed: int) -> None:
        """A fresh call: empty the cache, reallocating it (and dropping graphs) when it is too small."""
        if needed > self.cache.max_len:
            self.cache = StaticKVCache(self.model, max(needed, 2 * self.cache.max_len), self.static)
            self._graphs.clear()
            self._verified.clear()
        self.cache.set_length(0)

    def _mask(self, inp: _TreeInputs) -> Tensor:
        """(1, 1, b, max_len) additive mask from the device length counter: the committed prefix, then each
        node's ancestors among the b positions written after it; everything else (stale) masked."""
        c, b = self.cache, inp.b
        rel = torch.arange(c.max_len, device=self.device) - c.length_t  # (max_len,) offset from the tree
        in_tree = (rel >= 0) & (rel < b)
        sees = inp.ancestors[:, rel.clamp(0, b - 1)] & in_tree  # (b, max_len)
        visible = sees | (rel < 0)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)[None, None]

    def _static_forward(
        self, inp: _TreeInputs, layers: tuple[int, ...], keep_last: bool
    ) -> tuple[Tensor, Tensor]:
        """One fixed-shape verify forward over `inp` (the function CUDA graphs capture)."""
        self.cache.prepare_write(inp.b)
        positions = (inp.depth + self.cache.length_t)[None]  # (1, b)
        return target_forward(
            self.model, inp.tokens, self.cache, positions, self._mask(inp), layers=layers, keep_last=keep_last
        )

    def _forward_tree(
        self, tree: DraftTree, layers: tuple[int, ...], keep_last: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, _TreeInputs | None]:
        """Verify forward over `tree` at the committed length; returns (logits (b, V), hidden (b, H'), valid
        (b,) | None, the padded inputs | None). b = n on the eager path, the padded budget when static."""
        n = tree.num_nodes
        self.cache.check_room(budget_for(n) if self.static else n)
        if not self.static:
            if n == 1:  # exactly AR's causal step
                mask, positions = None, None
            else:
                mask = tree_attention_mask(tree, self.cache.length, self.dtype)
                positions = tree_position_ids(tree, self.cache.length)
            logits, hidden = target_forward(
                self.model, tree.tokens[None], self.cache, positions, mask, layers=layers, keep_last=keep_last
            )
            return logits, hidden, None, None
        inp = self._padded(tree)
        b = inp.b
        if not self.graphs:
            logits, hidden = self._static_forward(inp, layers, keep_last)
            return logits, hidden, inp.valid, inp
        logits, hidden = replay_or_run(
            self._graphs,
            (b, layers, keep_last),
            lambda: self._static_forward(inp, layers, keep_last),
            self.device,
            f"a {b}-node verify",
        )
        return logits, hidden, inp.valid, inp

    def _padded(self, tree: DraftTree) -> _TreeInputs:
        """The static inputs of `tree`'s padded budget (one set per budget: graph inputs), filled with it."""
        b = budget_for(tree.num_nodes)
        inp = self._inputs.get(b)
        if inp is None:
            inp = self._inputs[b] = _TreeInputs(b, self.device)
        inp.fill(tree)
        return inp

    def _forward_verified(
        self, tree: DraftTree, layers: tuple[int, ...], keep_last: bool, prefix_accept: bool
    ) -> tuple[Tensor, Tensor, Tensor, _TreeInputs]:
        """Graph path, greedy steps: the verify forward and `greedy_verify_packed` captured together (the
        verification's ~30 small kernels replay with the forward instead of launching one by one). Returns
        (logits (b, V), hidden (b, H'), packed (2 + 2b [+ b],), the padded inputs)."""
        self.cache.check_room(budget_for(tree.num_nodes))
        inp = self._padded(tree)
        b = inp.b

        def step() -> tuple[Tensor, Tensor, Tensor]:
            logits, hidden = self._static_forward(inp, layers, keep_last)
            packed = greedy_verify_packed(
                inp.tokens.reshape(-1),
                inp.parents,
                inp.ancestors,
                inp.depth,
                logits,
                inp.valid,
                prefix_accept,
            )
            return logits, hidden, packed

        logits, hidden, packed = replay_or_run(
            self._verified,
            (b, layers, keep_last, prefix_accept),
            step,
            self.device,
            f"a {b}-node verify",
        )
        return logits, hidden, packed, inp

    def _prefill(self, ids: Tensor, layers: tuple[int, ...], keep_last: bool) -> tuple[Tensor, Tensor]:
        """Prompt forward (eager; a causal chain). Returns (last-row logits (1, V), hidden (P, H'))."""
        p = ids.shape[1]
        self.cache.check_room(p)
        if self.static:  # whole-buffer attention: an explicit causal mask over max_len
            self.cache.prepare_write(p)
            inp = _TreeInputs(p, self.device)
            inp.ancestors = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
            mask = self._mask(inp)
            positions = torch.arange(p, device=self.device)[None]
        elif self.device.type == "cpu" and one_call_layers(self.model):
            return self._prefill_chunks(ids, layers, keep_last)
        else:
            mask, positions = None, None
        logits, hidden = target_forward(
            self.model,
            ids,
            self.cache,
            positions,
            mask,
            logits_rows=slice(-1, None),
            layers=layers,
            keep_last=keep_last,
        )
        self.cache.advance(p)
        return logits, hidden

    def _prefill_chunks(self, ids: Tensor, layers: tuple[int, ...], keep_last: bool) -> tuple[Tensor, Tensor]:
        """`_prefill` on the eager path of a CPU panel target: the prompt in chunks of `PREFILL_CHUNK` positions,
        each a causal tree over the cache so far, so every layer runs in one kernel call (transformers' causal
        forward makes ~15 torch calls a layer). Returns (last-row logits (1, V), hidden (P, H'))."""
        p = ids.shape[1]
        parts: list[Tensor] = []
        logits = None
        for s in range(0, p, PREFILL_CHUNK):
            e = min(p, s + PREFILL_CHUNK)
            n, past = e - s, self.cache.length
            steps = torch.arange(n, device=self.device)
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            chain = DraftTree(ids[0, s:e], steps - 1, depth=steps, ancestors=causal)  # the chunk as a chain
            mask = tree_attention_mask(chain, past, self.dtype)  # (1, 1, n, past + n)
            positions = tree_position_ids(chain, past)  # (1, n)
            rows = slice(-1, None) if e == p else slice(0, 0)  # logits of the prompt's last position only
            logits, hidden = target_forward(
                self.model,
                chain.tokens[None],
                self.cache,
                positions,
                mask,
                rows,
                layers=layers,
                keep_last=keep_last,
            )
            self.cache.advance(n)
            parts.append(hidden)
        assert logits is not None
        return logits, torch.cat(parts) if len(parts) > 1 else parts[0]

    @torch.inference_mode()
    def measure_costs(
        self, sizes: tuple[int, ...] = SIZES, prefix: int = 256, reps: int = 7
    ) -> dict[int, float]:
        """Median ms of one verify forward of b nodes (a chain) after a `prefix`-token cache, for each size,
        on this decoder's path (eager / fixed / graph); nothing is committed. For `eval.budget.CostCurve`
        (sizes timed round-robin, `budget.time_round_robin`)."""
        return time_round_robin(self.cost_probe(sizes, prefix), sizes, reps, self.device)

    @torch.inference_mode()
    def cost_probe(self, sizes: tuple[int, ...], prefix: int = 256) -> Callable[[int], object]:
        """Fill the cache with a random `prefix`-token prompt; return `run(b)`, one verify forward of a b-node
        chain (b in `sizes`) after it that commits nothing (call it under `torch.inference_mode()`)."""
        g = torch.Generator(device="cpu").manual_seed(0)
        vocab = int(cast(PreTrainedModel, self.model).config.get_text_config(decoder=True).vocab_size)
        ids = torch.randint(0, vocab, (1, prefix), generator=g, device="cpu").to(self.device)
        self._reserve(prefix + 2 * max(sizes))
        self._prefill(ids, (), False)
        trees = {
            b: DraftTree(
                torch.randint(0, vocab, (b,), generator=g, device="cpu").to(self.device),
                torch.arange(b, device=self.device) - 1,
            )
            for b in sizes
        }
        return lambda b: self._forward_tree(trees[b], (), False)

    def path_name(self) -> str:
        """ "eager" | "fixed" | "graph": the shape of this decoder's verify (a cost-curve cache key)."""
        return "graph" if self.graphs else "fixed" if self.static else "eager"

    # -- loops ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def ar_generate(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_ids: Tensor | list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids: set[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], DecodeStats]:
        """Autoregressive decoding on this path (each step a one-node tree); same contract as
        `decode.ar_generate`. Returns (new tokens, stats)."""
        device, stop_ids, ids, stats = _setup(self.model, tokenizer, prompt_ids, stop_ids)
        sync_device(device)
        t0 = time.perf_counter()
        self._reserve(ids.shape[1] + max_new_tokens + 1)
        logits, _ = self._prefill(ids, (), False)
        out: list[int] = []
        done = max_new_tokens <= 0
        root = torch.zeros(1, dtype=torch.long, device=device)
        chain = DraftTree(
            root,
            torch.tensor([-1], device=device),
            torch.zeros(1, dtype=torch.long, device=device),
            torch.ones(1, 1, dtype=torch.bool, device=device),
        )
        if self.static and temperature <= 0.0 and not done:  # greedy, fixed shapes: no sync per token
            self._ar_queued(logits, root, chain, out, stop_ids, max_new_tokens)
            stats.steps = len(out) - 1  # as below: one step per token after the prefill's
            done = True
        while not done:
            tok = sample_token(logits[-1], temperature, top_k, top_p, generator)  # the step's one sync
            done = _emit(out, [tok], stop_ids, max_new_tokens)
            if not done:
                root.fill_(tok)
                logits, _, _, _ = self._forward_tree(chain, (), False)
                self.cache.advance(1)
                stats.steps += 1
        _finish(stats, out, stop_ids, device, t0)
        return out, stats

    def _ar_queued(
        self, logits: Tensor, root: Tensor, chain: DraftTree, out: list[int], stop_ids: set[int], max_new: int
    ) -> None:
        """Greedy AR on the fixed-shape path with one host sync per `AR_QUEUE` tokens (gpt-fast keeps the
        token on the device the same way): each step's argmax feeds the next step's input on the device, so
        the host queues steps while the GPU runs them; the round's tokens are read at once and checked for a
        stop token there (steps queued past it are dropped: the output is the same, at most AR_QUEUE - 1
        forwards are wasted once per call).

        Args:
            logits: (1, V) the prefill's last row; root: (1,) the chain's token (a static verify input);
            chain: the one-node tree; out: the new tokens, appended in place.
        """
        cur = logits[-1].float().argmax(-1, keepdim=True)  # (1,) the next token, on the device
        while True:
            toks = [cur]
            for _ in range(min(AR_QUEUE, max_new - len(out)) - 1):
                root.copy_(cur)
                logits, _, _, _ = self._forward_tree(chain, (), False)
                self.cache.advance(1)
                cur = logits[-1].float().argmax(-1, keepdim=True)
                toks.append(cur)
            if _emit(out, torch.cat(toks).tolist(), stop_ids, max_new):  # the round's one sync
                return
            root.copy_(cur)
            logits, _, _, _ = self._forward_tree(chain, (), False)
            self.cache.advance(1)
            cur = logits[-1].float().argmax(-1, keepdim=True)

    @torch.inference_mode()
    def speculative_generate(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_ids: Tensor | list[int],
        proposer: Proposer,
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids: set[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        profile: bool = False,
        verify_fn: VerifyFn | None = None,
        fallback: FallbackController | None = None,
        budget: CapPolicy | None = None,
    ) -> tuple[list[int], DecodeStats]:
        """Tree speculative decoding on this path; same contract and output as `decode.speculative_generate`.

        Args: as `decode.speculative_generate` (the model is the decoder's), plus
            budget: a node budget (`budget.CapPolicy`: a fitted `NodeBudget`, or a `BanditBudget` choosing each
                step's cap) that cuts every greedy step's tree to its first `drafting_cap` nodes, or takes a
                plain step when `cap == 1`; its state carries over calls.

        Returns:
            tokens: the new tokens; stats (accepted drafts per step, tree sizes, phase timings).
        """
        device, stop_ids, ids, stats = _setup(self.model, tokenizer, prompt_ids, stop_ids)

        def synced_clock() -> float:
            sync_device(device)
            return time.perf_counter()

        clock = synced_clock if profile else time.perf_counter
        sync_device(device)
        t0 = time.perf_counter()
        self._reserve(ids.shape[1] + max_new_tokens + budget_for(max(proposer.spec.node_budget, 1)) + 64)
        proposer.reset()
        layers, keep_last = proposer.spec.feature_layers, proposer.spec.keep_last_hidden
        logits, hidden = self._prefill(ids, layers, keep_last)
        root = sample_token(logits[-1], temperature, top_k, top_p, generator)
        t1 = clock()
        stats.prefill_s = t1 - t0
        out: list[int] = []
        done = max_new_tokens <= 0 or _emit(out, [root], stop_ids, max_new_tokens)
        new_hidden = hidden  # (n, H') states of the newly committed positions
        new_tokens = torch.cat([ids[0, 1:], torch.tensor([root], device=device)])  # (n,) what each predicts
        single = DraftTree(torch.zeros(1, dtype=torch.long, device=device), torch.tensor([-1], device=device))
        greedy = verify_fn is None and temperature <= 0.0  # the budget fits on greedy steps only
        valid: Tensor | None
        inp: _TreeInputs | None
        if budget is not None:  # its cap, or phase 1's probe (never past the largest size that could pay)
            proposer.fit_budget(budget.start(proposer.spec.max_depth, proposer.spec.node_budget))
        held: list[tuple[Tensor, int]] = []  # plain steps' (hidden (1, H'), next token), for the next draft
        while not done:
            if budget is not None and greedy and budget.tick():  # a refit: trees of the probe size again
                proposer.fit_budget(budget.refit_cap())
            fitting = budget is not None and greedy and not budget.settled
            off = budget is not None and budget.cap == 1  # drafting does not pay here: plain target steps
            drafted = not off and (fallback is None or fallback.should_draft())
            if not drafted and greedy and not self.static:  # a plain step taken as AR takes it (eager path)
                keep = budget is None or not budget.off_for_good  # the proposer reads these positions later
                root, row = self._plain_step(root, single, (layers, keep_last) if keep else None)
                done = _emit(out, [root], stop_ids, max_new_tokens)
                if row is not None:
                    held.append((row, root))
                t4 = clock()
                stats.record_step(1, 1, None, (t1, t1, t4, t4), False, fallback)  # (its time: verify)
                t1 = t4
                continue
            if drafted:
                if held:  # the plain steps since the last draft, in one copy
                    new_hidden = torch.cat([new_hidden, *(h for h, _ in held)])
                    new_tokens = torch.cat([new_tokens, new_tokens.new_tensor([t for _, t in held])])
                    held.clear()
                tree = proposer.propose(new_hidden, new_tokens).to(device)
                cut = budget.drafting_cap if budget is not None else None
                if cut is not None:
                    tree = tree.truncated(cut)
            else:  # a plain step on the fixed-shape path; the proposer sees it with the next drafted step's
                single.tokens.fill_(root)
                tree = single
            n = tree.num_nodes
            t2 = clock()
            prefix = fitting and drafted  # the gain curve too (phase 1 and phase 2's checks)
            if greedy and self.graphs:  # the verification replays with the forward
                logits, hidden, packed, inp = self._forward_verified(tree, layers, keep_last, prefix)
                valid = inp.valid
                t3 = clock()
            else:
                logits, hidden, valid, inp = self._forward_tree(tree, layers, keep_last)  # (b, V), (b, H')
                t3 = clock()
                if greedy:
                    src = inp if inp is not None else tree
                    # the eager CPU path: the rule on the host (a small tree's ops cost more than the rule); the
                    # fixed-shape path keeps the packed rule, what its graphs capture on a GPU
                    if logits.device.type == "cpu" and not self.static:
                        packed = None
                        host = greedy_verify_host(
                            src.tokens.reshape(-1).tolist(),
                            cast(Tensor, src.parents).tolist(),
                            cast(Tensor, src.depth).tolist(),
                            logits.argmax(-1).tolist(),
                            None if valid is None else valid.tolist(),
                            prefix_accept=prefix,
                        )
                    else:
                        packed = greedy_verify_packed(
                            src.tokens.reshape(-1),
                            cast(Tensor, src.parents),
                            cast(Tensor, src.ancestors),
                            cast(Tensor, src.depth),
                            logits,
                            valid,
                            prefix_accept=prefix,
                        )
            if greedy:
                vals = packed.tolist() if packed is not None else host  # the step's one host sync
                b = logits.shape[0]
                a, bonus = vals[0], vals[1]
                if budget is not None and greedy and drafted:  # fitting, or the drift test once settled
                    cap = budget.cap
                    gains = vals[2 + 2 * b : 2 + 2 * b + n] if prefix else None
                    # (the verify as this loop pays it: forward and rule, to the step's host read above)
                    budget.observe(t2 - t1, a, gains, time.perf_counter() - t2)
                    if budget.cap != cap:  # a new cap: the proposer may draft less from now on
                        proposer.fit_budget(cast(int, budget.cap))
                path_t = (
                    packed[2 : 2 + b] if packed is not None else torch.tensor(vals[2 : 2 + b], device=device)
                )  # (b,) padded path, device
                in_place = vals[1 + a] == a - 1  # path[a-1] == a-1: the accepted nodes are already in place
                path_tokens = vals[2 + b : 2 + b + a]
                if path_tokens[0] != root:
                    raise RuntimeError(
                        f"proposer returned a tree rooted at {path_tokens[0]}, expected {root}"
                    )
                drafts = path_tokens[1:]
            else:  # sampling or a custom rule: the exact rules of decode.py on the real n nodes
                in_place = None
                if int(tree.tokens[0]) != root:
                    raise RuntimeError(
                        f"proposer returned a tree rooted at {int(tree.tokens[0])}, expected {root}"
                    )
                rule = verify_fn or (lambda t, lg: sample_verify(t, lg, temperature, top_k, top_p, generator))
                path_t, bonus = rule(tree, logits[:n])
                a = path_t.shape[0]
                drafts = tree.tokens[path_t[1:]].tolist()
                if self.static:  # the fixed-shape commit takes a padded path
                    path_t = torch.cat(
                        [path_t, torch.arange(a, inp.b if inp is not None else a, device=device)]
                    )
            self.cache.commit(path_t, a, in_place)
            done = _emit(out, [*drafts, bonus], stop_ids, max_new_tokens)
            bonus_t = torch.tensor([bonus], device=device)
            if drafted:  # (a, H') states and (a,) next tokens of the newly committed positions
                new_hidden = hidden[path_t[:a]]
                new_tokens = torch.cat([tree.tokens[path_t[1:a]], bonus_t])
            elif budget is None or not budget.off_for_good:  # keep them for the proposer's next call
                held.append((hidden[:1].clone(), bonus))  # a copy: a graph's next replay overwrites `hidden`
            root = bonus
            t4 = clock()
            ratio = proposer.last_compression if drafted else None
            stats.record_step(a, n, ratio, (t1, t2, t3, t4), drafted, fallback)
            t1 = t4
        _finish(stats, out, stop_ids, device, t0)
        return out, stats

    def _plain_step(
        self,
        root: int,
        single: DraftTree,
        features: tuple[tuple[int, ...], bool] | None,
    ) -> tuple[int, Tensor | None]:
        """A greedy step that drafts nothing (the node budget is off, or the fallback skips drafting), on the
        eager path: `ar_generate`'s one-node forward and argmax instead of a tree verify and a commit by path.

        Args:
            root: the token committed last (the forward's input); single: the one-node tree, refilled here.
            features: (feature layers, keep_last) of the proposer that reads this position at its next call,
                or None (the budget is off for good: no features at all, exactly AR's step).

        Returns:
            (the next token, the committed position's features (1, H') or None).
        """
        single.tokens.fill_(root)
        layers, keep_last = features if features is not None else ((), False)
        logits, hidden, _, _ = self._forward_tree(single, layers, keep_last)  # (1, V), (1, H')
        bonus = sample_token(logits[-1], 0.0)  # the step's one sync, as AR's
        self.cache.advance(1)
        return bonus, hidden[:1] if features is not None else None


def make_decoder(
    model: nn.Module, decode_path: str, cuda_graphs: str, max_len: int = 1024
) -> StaticDecoder | None:
    """The decoder `eval.decode_path` / `eval.cuda_graphs` ask for (None: the dynamic path of `decode.py`).

    Args:
        model: the target.
        decode_path: "static" | "dynamic".
        cuda_graphs: "auto" (on exactly when the target is on CUDA) | "on" | "off".
        max_len: initial cache capacity (grown when a call needs more).
    """
    if decode_path == "dynamic":
        return None
    graphs = graphs_wanted(model_device(model), cuda_graphs)
    return StaticDecoder(model, max_len, static=graphs, graphs=graphs)
