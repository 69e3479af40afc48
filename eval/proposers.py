"""Proposers: turn the newest committed target state into a `DraftTree` (see design.md).

`ReDrafterProposer` runs the drafter's beam search from the last committed hidden state and packs the
W beams into a compact tree with `pack_beams` (tensor-only prefix dedup); `last_compression` reports
W*(1+D) / N for the latest tree. `make_proposer` dispatches on the drafter family.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from specdraft.eval.copy_context import CopyContext
from specdraft.eval.graphs import CudaGraph, capture_or_none
from specdraft.eval.tree import PAD, DraftTree, ProposerSpec, chain_topology, pack_beams
from specdraft.hardware import cpu_int8_full_range
from specdraft.models.layers import CopyCache, weights_key
from specdraft.models.redrafter_beam import beam_search_fixed_rows, beam_search_rows
from specdraft.models.registry import spec_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from specdraft.eval.decode import Proposer
    from specdraft.eval.native_chain import NativeChain
    from specdraft.eval.redrafter_rows import RowsState
    from specdraft.models.family import FamilySpec
    from specdraft.models.panel_linear import PanelLinear
    from specdraft.models.redrafter import ReDrafter
    from specdraft.models.redrafter_config import ReDrafterConfig


class Int8Linear(torch.nn.Module):
    """Dynamic-int8 copy of a `Linear` for CPU drafting (fbgemm: int8 weights per output channel, activations
    quantised per call). The drafter's vocabulary head is a (V, X) matmul per beam step that is bound by
    streaming its weights; int8 makes it ~4-10x cheaper. Only the drafts change (slightly), never the output.
    """

    def __init__(self, linear: torch.nn.Linear | PanelLinear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (V, X)
        scales = (w.abs().amax(1) / 127.0).clamp_min(1e-8).double()  # (V,)
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream but still the fbgemm path
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w.cpu(), scales, zeros, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.packed = torch.ops.quantized.linear_prepack(qw, bias)
        # 8-bit activations where int8 dot products accumulate in 32 bits (VNNI: half the error of 7-bit ones
        # at the same speed), else 7 bits against fbgemm's saturating 16-bit pair sums
        self.reduce_range = not cpu_int8_full_range()

    def forward(self, x: Tensor) -> Tensor:
        """x (..., X) -> (..., V) float32."""
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)


_INT8_COPIES: CopyCache[Int8Linear] = CopyCache()


def int8_copy(linear: torch.nn.Linear | PanelLinear) -> Int8Linear:
    """The `Int8Linear` of `linear` (an `nn.Linear`, or the `PanelLinear` a panel target's layout made of one),
    quantised once and shared by every proposer of the same drafter (a batch
    of B rows makes B proposers); quantised again when the weights were changed (trained, moved or cast)."""
    return _INT8_COPIES.get(linear, weights_key(linear.weight), lambda: Int8Linear(linear))


def int8_supported() -> bool:
    """Whether the fbgemm int8 dynamic linear ops exist in this torch build."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
            torch.ops.quantized, "linear_dynamic"
        )
    except (AttributeError, RuntimeError):
        return False


def prompt_lookup(context: Tensor, max_ngram: int, num_tokens: int) -> Tensor:
    """Prompt-lookup drafting: the tokens that followed an earlier occurrence of the context's last n-gram
    (n = max_ngram down to 1; the first n with a match wins). Among the matches, the most recent one with
    `num_tokens` tokens after it is used, else the earliest (the longest continuation).

    Args:
        context: (T,) long, the committed sequence (ends with the root).
        max_ngram: longest suffix n-gram tried.
        num_tokens: at most this many continuation tokens.

    Returns:
        (k,) long continuation, k <= num_tokens (empty when nothing matches).
    """
    return prompt_lookup_scored(context, max_ngram, num_tokens)[0]


def prompt_lookup_scored(context: Tensor, max_ngram: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """`prompt_lookup` with a count-based cumulative probability of each continuation token: of the h earlier
    occurrences of the matched n-gram, those whose next d tokens equal the continuation's first d, over h + 1
    (one escape count for "none of these"), so one match gives 0.5 and agreeing repeats approach 1.

    Returns:
        cont (k,) long; probs (k,) float32, non-increasing (empty when nothing matches).
    """
    index = LookupIndex(max_ngram)
    index.extend(context.tolist())
    cont, probs = index.scored(num_tokens)
    return torch.tensor(cont, dtype=torch.long, device=context.device), probs.to(context.device)


def host_rows(tokens: Sequence[Tensor]) -> list[list[int]]:
    """R rows' tokens (n_i,) read on the host in one call (one device sync for a batch, not one per row)."""
    flat = torch.cat([t.to(tokens[0].device) for t in tokens]).tolist()
    ends = list(accumulate(t.shape[0] for t in tokens))
    return [flat[e - t.shape[0] : e] for t, e in zip(tokens, ends, strict=True)]


class LookupIndex:
    """`prompt_lookup_scored` on the host, incrementally: the committed tokens and, per m-gram (m <= max_ngram),
    the start of every occurrence, so a step costs its new tokens and the matched n-gram's occurrences instead
    of a pass over the whole context per n with a host sync each (on a GPU, prompt lookup at batch 16 took
    7.5 ms a step that way, one row after another: docs/gpu.md, session 44). The vectorised search it replaced
    is the reference it equals bit for bit (tests/unit/test_decode_proposers.py).

    Args:
        max_ngram: longest suffix n-gram matched.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = int(max_ngram)
        self.ids: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}  # m-gram -> start of each occurrence, ascending

    def extend(self, tokens: list[int]) -> None:
        """Append committed `tokens` to the context."""
        for tok in tokens:
            self.ids.append(int(tok))
            p = len(self.ids) - 1
            for m in range(1, min(self.max_ngram, p + 1) + 1):
                self.starts.setdefault(tuple(self.ids[p - m + 1 : p + 1]), []).append(p - m + 1)

    def scored(self, num_tokens: int) -> tuple[list[int], Tensor]:
        """`prompt_lookup_scored(context, max_ngram, num_tokens)` of the context so far: the continuation (k,)
        as a list, and its probabilities (k,) float32 (host tensor)."""
        ids, t = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, t - 1), 0, -1):
            hits = self.starts[tuple(ids[t - n :])][:-1]  # the last occurrence is the suffix itself
            if not hits:
                continue
            full = [i for i in hits if i + n + num_tokens <= t]  # followed by a full-length continuation
            start = (full[-1] if full else hits[0]) + n  # the most recent full one, else the longest
            cont = ids[start : start + num_tokens]
            agree = [0] * len(cont)  # occurrences agreeing with the continuation up to each depth
            for i in hits:
                for d, tok in enumerate(cont):
                    j = i + n + d
                    if j >= t or ids[j] != tok:
                        break
                    agree[d] += 1
            return cont, torch.tensor(agree, dtype=torch.float32, device="cpu") / (len(hits) + 1)
        return [], torch.zeros(0, device="cpu")


def beam_scores(tree: DraftTree, cum: Tensor) -> Tensor:
    """Per-node cumulative probability of a tree packed from beams (`pack_beams`).

    Args:
        tree: with `beam_nodes` (W, L).
        cum: (W', L') cumulative log-probs of the first W' <= W beams (L' <= L); missing rows/columns are
            positions with no drafter score (0 here unless another beam shares the node).

    Returns:
        (N,) float32: exp(cum) of each node (max over the beams sharing it), root 1.
    """
    assert tree.beam_nodes is not None
    w, length = cum.shape
    nodes = tree.beam_nodes[:w, :length]  # (W', L')
    valid = nodes >= 0
    probs = torch.zeros(tree.num_nodes, dtype=torch.float32, device=cum.device)
    probs.scatter_reduce_(0, nodes[valid].to(cum.device), cum[valid].float().exp(), "amax")
    probs[0] = 1.0
    return probs


class PromptLookupProposer:
    """Prompt-lookup decoding through the tree decoder: one chain root + `prompt_lookup(...)` per step.

    Args:
        num_tokens: continuation length (draft depth).
        max_ngram: longest suffix n-gram matched against the context.
    """

    last_compression: float | None = None  # a chain: nothing to pack

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3) -> None:
        self.draft_len, self.max_ngram = int(num_tokens), int(max_ngram)
        self.full_len = self.draft_len  # the length `fit_budget` caps (and restores)
        self.spec = ProposerSpec(max_depth=self.draft_len, node_budget=1 + self.draft_len)
        self.index: LookupIndex | None = None  # the committed tokens, on the host
        self.last_chain: list[int] = []  # the latest continuation (root excluded), on the host

    def reset(self) -> None:
        """Forget the previous prompt."""
        self.index = None

    def fit_budget(self, nodes: int) -> None:
        """Look up at most `nodes - 1` tokens (a chain of `nodes` nodes); a larger cap restores the full
        length."""
        self.draft_len = min(self.full_len, max(nodes - 1, 0))

    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """A chain tree on `tokens`' device: root, then the lookup continuation after the context extended by
        the newly committed `tokens` (n,) (one host read of them), with per-node scores (`LookupIndex.scored`);
        hidden is unused."""
        return self.chain(tokens.tolist(), tokens.device)

    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """Every row's `propose` with one host read of all rows' new tokens (None unless every row is a
        `PromptLookupProposer`).

        Args:
            rows: R proposers (this one among them); hidden: unused; tokens: R of (n_i,), tokens[i][-1] the root.
        """
        if not all(isinstance(p, PromptLookupProposer) for p in rows) or not tokens:
            return None
        ps = cast("list[PromptLookupProposer]", list(rows))
        return [p.chain(ids, t.device) for p, ids, t in zip(ps, host_rows(tokens), tokens, strict=True)]

    def chain(self, ids: list[int], device: torch.device) -> DraftTree:
        """`propose` from the newly committed tokens read on the host, `ids` (n,): the chain tree on `device`;
        its continuation also in `last_chain` (host)."""
        if self.index is None:
            self.index = LookupIndex(self.max_ngram)
        self.index.extend(ids)
        cont, probs = self.index.scored(self.draft_len)  # k tokens, (k,) float32
        self.last_chain = cont
        chain = torch.tensor([ids[-1], *cont], dtype=torch.long, device=device)  # (1+k,)
        topo = (t.to(device) for t in chain_topology(1 + len(cont)))  # as `pack_beams` packs one beam
        tree = DraftTree(chain, *topo)
        tree.scores = torch.cat([torch.ones(1, device="cpu"), probs]).to(device)  # (1+k,)
        return tree


# ReDrafter `min_prob` above which one beam finds every node kept (1/2, with a margin for rounding in the
# softmax: two sequences of one depth at p each need 2p <= 1 + rounding)
GREEDY_ABOVE = 0.5 + 1e-4


class ReDrafterProposer:
    """Beam search with a ReDrafter RNN drafter + dynamic tree attention (prefix dedup).

    Args:
        drafter: exposes `beam_search(hidden (F,), root: int, beam_width, draft_len, context, head, copy, min_logp)
            -> (beams (W, 1+draft_len) long, cum (W, 1+draft_len))` with `beams[:, 0] == root`.
        beam_width: W.
        beam_length: 1 + draft_len (root included).
        int8_head: draft with an int8 copy of the vocabulary head (CPU only; ignored where unsupported).
        min_prob: drop beam positions whose drafter probability (product along the beam) is below this
            (dynamic tree size; 0: keep all). Above 1/2 the search is one beam wide: the drafts of one depth
            are distinct sequences whose probabilities sum to at most 1, so at most one reaches p > 1/2, and a
            sequence above 1/2 is the argmax at every slot of it, i.e. the greedy chain's prefix. The tree is
            the W-wide search's pruned one, for 1/W of its head and recurrence work.
        static: fixed shapes for the static decode path: all W beams from the first slot
            (`beam_search_fixed_rows`, one row) laid out as a tree of constant topology, 1 + W * D nodes without prefix
            dedup, so a draft step makes no host sync. The copy gate looks up on the device in a buffer of
            the committed tokens (`copy_lookup.lookup_fixed_rows`); prefix attention and `min_prob` keep the
            dynamic step.
        graphs: with `static`, capture the draft step as a CUDA graph (drafter on CUDA).
        int8_layers: search through `int8_clone(drafter)`: the recurrence, blocks, input projection and copy
            gate as dynamic-int8 products (CPU only; `eval.draft_block=int8`).
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        beam_width: int,
        beam_length: int,
        int8_head: bool = False,
        min_prob: float = 0.0,
        static: bool = False,
        graphs: bool = False,
        int8_layers: bool = False,
    ) -> None:
        if beam_width < 1 or beam_length < 1:
            raise ValueError(
                f"ReDrafterProposer: beam_width={beam_width}, beam_length={beam_length} must be >= 1"
            )
        if min_prob > GREEDY_ABOVE:  # one sequence at most reaches p > 1/2: the greedy one (see Args)
            beam_width = 1
        # duck-typed: any module with ReDrafter's `head` and `beam_search`
        drafter = cast("ReDrafter", drafter)
        self.drafter = drafter
        # the module the beam search runs: the drafter, or its int8 view (`eval/int8_clone.py`) on a CPU
        self._search = cast("ReDrafter", _int8_view(drafter) if int8_layers else drafter)
        # one-beam searches (the fitted budget's usual CPU trees) one C call per slot (eval/native_chain.py)
        self._native = _native_chain(drafter) if int8_layers and not static else None
        self.beam_width = beam_width
        self.draft_len = beam_length - 1
        self._full = (beam_width, self.draft_len)  # the search `fit_budget` caps (and restores)
        self.last_compression: float | None = None
        on_cpu = drafter.head.weight.device.type == "cpu"
        self.head = int8_copy(drafter.head) if int8_head and on_cpu and int8_supported() else None
        self.max_depth = self.draft_len  # deepest possible draft (acceptance-rate unit)
        self.min_logp = math.log(min_prob) if min_prob > 0 else None
        # extra target layers the drafter reads after h (`ReDrafterConfig.target_layers`): the decoder returns
        # [h; layers] for every verified position (`spec.keep_last_hidden`)
        cfg = cast("ReDrafterConfig", drafter.config)  # its declared fields, read as they are
        spec = spec_of(drafter)  # the family's declared contract
        self.target_layers = spec.layers_for(cfg)  # its feature layers
        self.spec = ProposerSpec(  # the decoder passes h first, then the drafter's `target_layers` (if any)
            feature_layers=self.target_layers,
            keep_last_hidden=True,
            max_depth=self.max_depth,
            node_budget=1 + beam_width * self.draft_len,
        )
        # prefix attention (`context_heads` > 0): keys/values of every committed position, grown each step
        self.uses_context = bool(cfg.context_heads)
        self.hidden_size = int(cfg.base_hidden_size)
        self._history: Tensor | None = None  # (m,) x_1 .. x_m: the token after each committed position
        # keys, values (capacity, A): rows [: self._used] are the sink, then positions 2 .. m - 1
        self._memory: tuple[Tensor, Tensor] | None = None
        self._used = 0
        # copy gate (`copy_ngram` > 0): m-grams up to this, looked up in `copy_ctx` (below)
        self.copy_ngram = spec.copy_ngram_of(cfg)
        plain = not (self.uses_context or min_prob > 0)
        self.static = static and plain and self.draft_len > 0
        self.graphs = graphs and self.static and drafter.head.weight.device.type == "cuda"  # else eager
        self._draft_graph: CudaGraph[tuple[Tensor, Tensor]] | None = None
        if self.static:  # the constant topology: root, then W chains of D nodes (node 1 + w * D + d)
            dev = drafter.head.weight.device
            d = (
                torch.arange(beam_width * self.draft_len, device=dev) % self.draft_len
            )  # (W*D,) slot of each node
            node = torch.arange(1, 1 + beam_width * self.draft_len, device=dev)
            self._parents = torch.cat([torch.tensor([-1], device=dev), torch.where(d == 0, 0, node - 1)])
            fixed = DraftTree(torch.zeros_like(self._parents), self._parents)
            self._ancestors, self._depth = fixed.ancestors, fixed.depth
            self._hidden_in = torch.zeros(0, device=dev)  # (F,) graph input, sized at the first call
            self._root_in = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) graph input
        # copy gate: the committed tokens before the root, a host index (searches) and, on the fixed-shape
        # step, a device buffer (a graph input; room for 2,048 tokens under graphs: each doubling recaptures)
        room = (2048 if self.graphs else 256) if self.copy_ngram and self.static else 1
        self.copy_ctx = CopyContext(self.copy_ngram, drafter.head.weight.device, room)
        self._rows_state: RowsState | None = None  # drafted with other rows (`eval/redrafter_rows.py`)

    def reset(self) -> None:
        """Forget the previous prompt."""
        self.last_compression = None
        self._history, self._memory, self._used = None, None, 0
        self.copy_ctx.reset()  # the buffer and graph stay; the graph reads the count

    def fit_budget(self, nodes: int) -> None:
        """Search only the beams a `nodes`-node tree can use: trees are laid out beam by beam, so the first
        `nodes` nodes hold ceil((nodes - 1) / D) beams (one beam: its first nodes - 1 tokens). The fixed-shape
        step keeps its size (its topology is set up front). A cap the full search fits in (a refit:
        `budget.FULL`) restores it."""
        if self.static:
            return
        width, length = self._full
        self.beam_width, self.draft_len = width, length
        if nodes < 1 + width * length:
            self.beam_width = max(1, -(-(nodes - 1) // max(length, 1)))
            if self.beam_width == 1:
                self.draft_len = min(length, max(nodes - 1, 0))

    def _update_memory(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Append the newly committed positions to the prefix-attention memory; returns keys, values (1 + M, A),
        the attention's sink first (views of a buffer that doubles when full: appending copies only new rows).

        Position j stores (x_{j-1}, x_j, x_{j+1}, h_j) as in training; positions 0 and 1 are skipped (their
        x_{j-1} / x_j are not handed to the proposer: the first call's tokens start at x_1).

        Args:
            hidden: (n, F) features of the new positions m0 .. m0 + n - 1 (h_j: the first H columns).
            tokens: (n,) the token after each, x_{m0+1} .. x_{m0+n}.
        """
        old = self._history
        m0 = 0 if old is None else int(old.shape[0])
        hist = tokens if old is None else torch.cat([old, tokens.to(old)])  # (m,)
        end = m0 + tokens.shape[0]
        js = torch.arange(min(max(m0, 2), end), end, device=hist.device)  # new positions with j >= 2
        first = self._memory is None
        keys, values = self._search.context_memory(
            hidden[js - m0, : self.hidden_size], hist[js - 2], hist[js - 1], hist[js], sink=first
        )  # (first + n', A) each
        self._history = hist
        if first:  # the sink (and any visible positions): a buffer with room to grow
            cap = max(64, 2 * keys.shape[0])
            self._memory = (keys.new_empty(cap, keys.shape[-1]), values.new_empty(cap, values.shape[-1]))
            self._used = 0
        assert self._memory is not None
        used, cap = self._used + keys.shape[0], self._memory[0].shape[0]
        if used > cap:  # double: amortised O(1) copy per position
            grown = [x.new_empty(max(2 * cap, used), x.shape[-1]) for x in self._memory]
            for dst, src in zip(grown, self._memory, strict=True):
                dst[: self._used] = src[: self._used]
            self._memory = (grown[0], grown[1])
        self._memory[0][self._used : used] = keys
        self._memory[1][self._used : used] = values
        self._used = used
        return self._memory[0][:used], self._memory[1][:used]

    def _chain_now(self) -> NativeChain | None:
        """The native chain `propose` drafts through now, else None: a one-beam search with drafts, of a drafter
        the chain supports (`_native`, set only off the fixed-shape step), without prefix attention."""
        one_beam = self.beam_width == 1 and self.draft_len > 0 and not self.uses_context
        return self._native if one_beam else None

    @torch.inference_mode()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """Beams from the newest position (hidden[-1], root tokens[-1]) packed into a tree.

        Args:
            hidden: (n, F) target features of the newly committed positions (F = H, or H * (1 + m) with the
                drafter's extra `target_layers`).
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            The packed tree (N <= W * (1 + D) nodes).
        """
        if self.static:
            if self.copy_ngram and self.copy_ctx.commit(tokens):  # the buffer moved: capture again
                self._draft_graph = None
            return self._propose_fixed(hidden[-1], tokens[-1:])
        root = int(tokens[-1])
        if self.draft_len == 0:
            self.last_compression = 1.0
            return DraftTree(
                tokens[-1:].clone(), torch.full((1,), -1, dtype=torch.long, device=tokens.device)
            )
        context = self._update_memory(hidden, tokens) if self.uses_context else None
        copy = self.copy_ctx.update_index(tokens) if self.copy_ngram else None
        native = self._chain_now()
        if native is not None:  # one C call a token
            chain, logps = native.chain(hidden[-1], root, self.draft_len, copy)
            self.last_compression = 1.0
            return native.tree(chain, logps, self.min_logp).to(tokens.device)
        beams, cum = self._search.beam_search(
            hidden[-1], root, self.beam_width, self.draft_len, context, self.head, copy, self.min_logp
        )  # (W, 1+D) each (a search that stops early once every beam is below `min_prob`)
        return self._pack(beams, cum, tokens.device)

    def _pack(self, beams: Tensor, cum: Tensor, device: torch.device) -> DraftTree:
        """beams, cum (W, 1 + D) of one search -> the tree (pruned with `min_prob`, prefixes shared), with
        per-node scores, on `device`; records `last_compression`."""
        if self.min_logp is not None:
            beams = beams.masked_fill(cum < self.min_logp, PAD)  # (W, 1+D), pruned tails
        tree, self.last_compression = pack_beams(beams.to(device))
        tree.scores = beam_scores(tree, cum.to(device))  # (N,)
        return tree

    @torch.inference_mode()
    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """Every row's `propose` in one beam search over all rows (`beam_search_rows`: R roots, then R * W beams
        per slot), each row's copy-gate index advanced as `propose` does; on the fixed-shape step one
        `beam_search_fixed_rows` for all rows (`eval/redrafter_rows.py`, one CUDA graph under `graphs`). None
        with prefix attention (a memory per row), or when the rows' proposers differ (drafter, search size,
        head, static or graphs).

        Args:
            rows: R `ReDrafterProposer`s (this one among them); hidden: R (n_i, F); tokens: R (n_i,).

        Returns:
            R trees, each equal to what `rows[i].propose(hidden[i], tokens[i])` gives (with the int8 head the
            rows share one activation scale, so a draft may differ slightly; the output never does).
        """
        search = (self._search, self.beam_width, self.draft_len, self.min_logp)
        if self.uses_context or self.draft_len == 0:
            return None
        if not all(isinstance(p, ReDrafterProposer) for p in rows):
            return None
        ps = cast("list[ReDrafterProposer]", list(rows))
        if any((p._search, p.beam_width, p.draft_len, p.min_logp) != search for p in ps):
            return None
        if len(ps) == 1 and ps[0]._chain_now() is not None:
            # one drafting row (batch 1, a queue's tail, the other rows paused): its own one-beam search, one C
            # call a token (in place 0.56 against 1.42 ms a one-token draft through torch, Session 52)
            return [ps[0].propose(hidden[0], tokens[0])]
        if self.static:  # one fixed-shape search (one CUDA graph under `graphs`) for every row
            if any(not p.static or p.head is not self.head or p.graphs != self.graphs for p in ps):
                return None
            from specdraft.eval.redrafter_rows import propose_fixed_rows

            return propose_fixed_rows(ps, hidden, tokens)
        copies = (
            [p.copy_ctx.update_index(t) for p, t in zip(ps, tokens, strict=True)] if self.copy_ngram else None
        )
        roots = torch.stack([t[-1] for t in tokens])  # (R,)
        feats = torch.stack([h[-1] for h in hidden])  # (R, F)
        beams, cum = beam_search_rows(
            self._search,
            feats,
            roots,
            self.beam_width,
            self.draft_len,
            self.head,
            copies,
            min_logp=self.min_logp,
        )  # (R, W, 1 + D) each (stopped early once every row's beams are below `min_prob`)
        return [p._pack(b, c, t.device) for p, b, c, t in zip(ps, beams, cum, tokens, strict=True)]

    def _propose_fixed(self, hidden: Tensor, root: Tensor) -> DraftTree:
        """The fixed-shape draft step (optionally a CUDA graph): W beams -> a (1 + W*D)-node tree whose
        topology never changes. hidden (F,), root (1,) long."""
        if self._hidden_in.shape != hidden.shape:  # first call (or new feature size): (re)size the inputs
            self._hidden_in, self._draft_graph = hidden.new_zeros(hidden.shape), None
        self._hidden_in.copy_(hidden)
        self._root_in.copy_(root)

        def step() -> tuple[Tensor, Tensor]:
            ctx = self.copy_ctx
            copy = (ctx.buf[None], ctx.length.reshape(1), self.copy_ngram) if self.copy_ngram else None
            beams, cum = beam_search_fixed_rows(
                self._search,
                self._hidden_in[None],
                self._root_in,
                self.beam_width,
                self.draft_len,
                self.head,
                copy,
            )  # (1, W, 1 + D) each
            return beams[0], cum[0]

        if self.graphs and self._draft_graph is None:
            self._draft_graph = capture_or_none(step, self._root_in.device, "the ReDrafter draft step")
            self.graphs = self._draft_graph is not None
        beams, cum = self._draft_graph() if self._draft_graph is not None else step()  # (W, 1 + D) each
        tokens = torch.cat([self._root_in, beams[:, 1:].reshape(-1)])  # (1 + W*D,)
        scores = torch.cat([cum.new_ones(1), cum[:, 1:].float().exp().reshape(-1)])  # (1 + W*D,)
        self.last_compression = 1.0
        return DraftTree(tokens, self._parents, self._depth, self._ancestors, scores=scores)


def _native_chain(drafter: torch.nn.Module) -> NativeChain | None:
    """`eval.native_chain.NativeChain` of `drafter` where it can draft (`native_chain.unsupported`) and
    `SPECDRAFT_NATIVE_CHAIN` is not 0, else None (one-beam searches then run in torch). One per drafter and
    weights, shared by every proposer of it (calls run one at a time: the decoders are single-threaded)."""
    from specdraft.eval.native_chain import NativeChain, enabled, unsupported

    if not enabled() or unsupported(drafter) is not None:
        return None
    key = weights_key(*drafter.parameters())  # shared by a batch's proposers; rebuilt after training
    return _NATIVE_CHAINS.get(drafter, key, lambda: NativeChain(cast("ReDrafter", drafter)))


_NATIVE_CHAINS: CopyCache[NativeChain] = CopyCache()


def _int8_view(drafter: torch.nn.Module) -> torch.nn.Module:
    """`int8_clone(drafter)` without its vocabulary head (the proposers swap that one themselves)."""
    from specdraft.eval.int8_clone import int8_clone

    return int8_clone(drafter, keep=("head",))


def drafter_family(drafter: torch.nn.Module) -> str:
    """The declared family name (`FamilySpec.name`, models/family.py) of a registered drafter.

    Raises:
        ValueError: no `config.architecture`, or a family not in models/registry.py.
    """
    return spec_of(drafter).name


def drafter_label(drafter: torch.nn.Module, path: str) -> str:
    """`family:name` for tables and records, the name being the run's folder for `<run>/export` (several runs'
    exports side by side stay told apart), else the path's last part (a Hub id's name, a checkpoint folder)."""
    from pathlib import Path

    where = Path(path)
    name = where.parent.name if where.name == "export" and where.parent.name else where.name or path
    return f"{drafter_family(drafter)}:{name}"


def make_proposer(
    drafter: torch.nn.Module,
    beam_width: int | None = None,
    beam_length: int | None = None,
    tree_nodes: int | None = None,
    int8_head: bool = False,
    lookup_tokens: int = 0,
    min_prob: float = 0.0,
    static: bool = False,
    graphs: bool = False,
    draft_block: str = "hf",
    verify_cost: Callable[[float], float] | None = None,
) -> Proposer:
    """The proposer for `drafter`'s family, with decode settings (None: the drafter's defaults).

    Args:
        drafter: a loaded drafter (`specdraft.models.hub.load_drafter`).
        beam_width: ReDrafter W (None: `config.beam_width`, else 8).
        beam_length: ReDrafter 1 + D (None: `config.draft_len + 1`).
        tree_nodes: Medusa node budget / EAGLE-2 `total_tokens` (None: the drafter's default).
        int8_head: ReDrafter / Medusa / EAGLE draft with int8 vocabulary heads on CPU (`Int8Linear`).
        lookup_tokens: > 0: merge a prompt-lookup chain of this length into every tree (`eval.hybrid.LookupBranch`,
            any family; 0: off).
        min_prob: ReDrafter prunes beam positions below this drafter probability (0: off).
        static, graphs: ReDrafter's fixed-shape draft step / EAGLE-2's fixed-shape tree expansion (and its CUDA
            graph) for the static decode path.
        draft_block: EAGLE heads' decoder layer while drafting: "hf" (its modules), "fused" or "int8" (a
            decode-time copy with fused / int8 products on CPU: `eval/draft_block.py`), "auto" (int8 where the
            family declares `int8_draft_layer`, else fused). ReDrafter: "int8" (or "auto" where declared)
            searches through int8 products of its recurrence, blocks and copy gate (`eval/int8_clone.py`).
        verify_cost: with `lookup_tokens`: the target's verify ms per node count on this decode path
            (`budget.CostCurve`), so the branch drafts with the drafter only on steps where that is expected to pay
            over lookup's chain alone (None: the drafter drafts every step lookup does not beat it).
    """
    try:
        spec = spec_of(drafter)  # the family's declared contract: `spec.proposer` names the builder
    except ValueError as err:
        raise NotImplementedError(f"no proposer for {type(drafter).__name__}: {err}") from err
    proposer = _family_proposer(
        drafter, spec, beam_width, beam_length, tree_nodes, int8_head, min_prob, static, graphs, draft_block
    )
    if lookup_tokens > 0:
        from specdraft.eval.hybrid import LookupBranch

        return LookupBranch(proposer, lookup_tokens, cost=verify_cost)
    return proposer


def pruned_factories(
    drafter: torch.nn.Module, **settings: Any
) -> Callable[[float], Callable[[], Any]] | None:
    """min_prob -> a factory of `drafter`'s proposers (`make_proposer` with `settings`) whose trees drop the beam
    positions below that drafter probability (`eval.batch_min_prob`, `bench_batch.py --min-prob`); None for a
    family whose proposer takes no `min_prob` (only ReDrafter's beam search prunes by it)."""
    if spec_of(drafter).proposer != "redrafter_beams":
        return None
    return lambda min_prob: partial(make_proposer, drafter, min_prob=min_prob, **settings)


def _family_proposer(
    drafter: torch.nn.Module,
    spec: FamilySpec,
    beam_width: int | None,
    beam_length: int | None,
    tree_nodes: int | None,
    int8_head: bool,
    min_prob: float,
    static: bool,
    graphs: bool,
    draft_block: str = "hf",
):
    """The proposer `spec.proposer` names, built with `make_proposer`'s settings (prompt lookup aside)."""
    cfg = cast("PretrainedConfig", drafter.config)
    from specdraft.eval.draft_block import resolve_kind

    # ReDrafter / Medusa: draft through an int8 view of the drafter's products (`eval/int8_clone.py`)
    int8_layers = resolve_kind(draft_block, spec) == "int8"
    if spec.proposer == "redrafter_beams":
        rcfg = cast("ReDrafterConfig", cfg)  # the family's declared config (`FamilySpec.config`)
        w = beam_width or rcfg.beam_width or 8
        length = beam_length or rcfg.draft_len + 1
        return ReDrafterProposer(
            drafter, int(w), int(length), int8_head, min_prob, static, graphs, int8_layers
        )
    if spec.proposer == "medusa_tree":
        from specdraft.eval.medusa_tree import MedusaProposer

        return MedusaProposer(
            drafter, max_nodes=tree_nodes, int8_head=int8_head, graphs=graphs, int8_layers=int8_layers
        )
    if spec.proposer == "eagle_tree":
        from specdraft.eval.eagle_tree import EagleTreeProposer

        total = tree_nodes or int(cfg.tree_total_tokens)
        return EagleTreeProposer(
            drafter,
            total,
            int(cfg.tree_depth),
            int(cfg.tree_top_k),
            int8_head,
            static,
            graphs,
            draft_block=draft_block,
        )
    if ":" in spec.proposer:  # a plugged-in family's builder "package.module:callable"
        import importlib

        module, _, name = spec.proposer.partition(":")
        settings: dict[str, object] = {"beam_width": beam_width, "beam_length": beam_length}
        settings.update(tree_nodes=tree_nodes, int8_head=int8_head)
        settings.update(min_prob=min_prob, static=static, graphs=graphs)
        return getattr(importlib.import_module(module), name)(drafter, **settings)
    raise NotImplementedError(f"no proposer {spec.proposer!r} for drafter family {spec.name!r}")
