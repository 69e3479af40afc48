"""Speculative (tree-attention) decoding and the autoregressive baseline, batch size 1.

Both loops share `target_forward` (decoder + LM head on the rows needed), the same `DynamicCache`, the
same prefill, sampling rule and stop rule, so their timings compare like for like.

Speculative loop (design.md "Decoder contract"):

    prefill(prompt) -> root = pick(logits[-1]); emit root
    repeat:
        tree  = proposer.propose(hidden of newly committed positions, their next tokens)   # node 0 = root
        forward(tree.tokens, 4D ancestor mask, positions P + depth)                        # one target call
        path, bonus = verify(tree, logits)              # longest accepted path + the target's own token
        keep only the path's K/V in the cache (gather + crop); emit tree.tokens[path[1:]] + [bonus]

Emitted tokens stop right after the first stop token (kept) or at `max_new_tokens`, exactly as in AR.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.data.chat import stop_token_ids
from specdraft.eval.fallback import FallbackController
from specdraft.eval.kv import cache_len, check_supported, keep_accepted, new_cache
from specdraft.eval.tree import DraftTree, ProposerSpec, tree_attention_mask, tree_position_ids
from specdraft.eval.verify import greedy_verify, sample_token, sample_verify
from specdraft.models.attention import varying_shape_sdpa
from specdraft.models.base_llm import forward_with_hidden, lm_logits

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedTokenizerBase


class Proposer(Protocol):
    """Turns the newest committed state into a candidate tree (see design.md)."""

    spec: ProposerSpec  # the features it reads, its depth and node budget
    last_compression: (
        float | None
    )  # beam tokens / tree nodes of the latest tree (None: not packed from beams)

    def reset(self) -> None: ...

    def fit_budget(self, nodes: int) -> None:
        """The decoder will cut every tree to its first `nodes` nodes from now on: draft no more than that
        (e.g. fewer beams). A later call may raise the cap again (a budget refit passes `budget.FULL`: draft
        full-size trees). A no-op is always correct; the output never depends on it."""
        ...

    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """hidden (n, H): target last-layer states of the n newly committed positions;
        tokens (n,): the token each of those positions predicts (tokens[-1] is the new root)."""
        ...


@runtime_checkable
class RowBatchedProposer(Protocol):
    """A proposer family that drafts several rows' trees in one drafter call (declared by ReDrafter, Medusa,
    EAGLE and the lookup branch around them); the batched decoder (`batch_decode`) asks the first active row's
    proposer for all rows' trees at once instead of calling `propose` row by row."""

    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """`rows[i].propose(hidden[i], tokens[i])` for every i, in one drafter call (this proposer is one of
        `rows`; each row's own state is read and advanced as `propose` would; int8 products quantise the rows'
        activations together, so their drafts may differ slightly, never the output). None: these rows cannot be
        drafted together (e.g. another class or search size): nothing was changed, call `propose` per row.

        Args:
            rows: R proposers (one per batch row) of this proposer's kind.
            hidden: R tensors (n_i, F), the rows' newly committed positions' features.
            tokens: R tensors (n_i,), the token each predicts; tokens[i][-1] is row i's root.
        """
        ...


@dataclass
class DecodeStats:
    """What one generate call did. `accepted[i]` = drafts accepted at verification step i."""

    new_tokens: int = 0  # emitted tokens (incl. a final stop token)
    prompt_tokens: int = 0  # prompt length
    steps: int = 0  # target forwards after the prefill
    accepted: list[int] = field(default_factory=list)  # accepted drafts per step (speculative only)
    tree_sizes: list[int] = field(default_factory=list)  # N per step (speculative only)
    compression: list[float] = field(default_factory=list)  # beam tokens / tree nodes per step (if reported)
    finish_reason: str = "length"  # "stop" | "length"
    time_s: float = 0.0  # wall time of the whole call (incl. prefill)
    prefill_s: float = 0.0  # prefill forward
    draft_s: float = 0.0  # proposer time
    verify_s: float = 0.0  # target forward over the tree
    accept_s: float = 0.0  # acceptance + cache compaction + bookkeeping
    target_steps: int = 0  # steps the fallback controller ran without drafting (included in `steps`)

    def record_step(
        self,
        accepted: int,
        nodes: int,
        compression: float | None,
        clock: tuple[float, float, float, float],
        drafted: bool = True,
        fallback: FallbackController | None = None,
    ) -> None:
        """One verification step: `accepted` nodes kept (root included) out of `nodes`, the proposer's
        compression (None: not reported or not drafted), and the clock at the step's start, after drafting,
        after the verify forward and at its end; tells the fallback controller how it went."""
        t1, t2, t3, t4 = clock
        self.steps += 1
        self.accepted.append(accepted - 1)
        self.tree_sizes.append(nodes)
        if compression is not None:
            self.compression.append(float(compression))
        if fallback is not None:
            fallback.observe(drafted, accepted, t4 - t1)
            self.target_steps += not drafted
        self.draft_s += t2 - t1
        self.verify_s += t3 - t2
        self.accept_s += t4 - t3

    @property
    def tokens_per_step(self) -> float:
        """Mean accepted drafts + 1 (the bonus) per verification forward."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)


def model_device(model: torch.nn.Module) -> torch.device:
    """Device of the model's input embeddings."""
    return cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight.device


def default_stop_ids(
    tokenizer: PreTrainedTokenizerBase | None, model: torch.nn.Module | None = None
) -> set[int]:
    """`data.chat.stop_token_ids` (EOS + known end-of-turn tokens) plus the generation config's EOS ids."""
    ids: set[int] = set(stop_token_ids(tokenizer)) if tokenizer is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(x) for x in eos)
    return ids


def sync_device(device: torch.device) -> None:
    """Wait for queued kernels (CUDA) so wall-clock timers are honest; no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_forward(
    model: torch.nn.Module,
    input_ids: Tensor,
    cache: Cache,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    logits_rows: slice | Tensor | None = None,
    layers: tuple[int, ...] = (),
    keep_last: bool = False,
) -> tuple[Tensor, Tensor]:
    """Decoder forward that appends to `cache`, then the LM head on the requested rows only.

    Args:
        model: HF causal LM (`<prefix>.model` decoder + output embeddings).
        input_ids: (1, L).
        cache: `DynamicCache`, extended by L positions.
        position_ids: (1, L) or None (consecutive after the cache).
        attention_mask: (1, 1, L, P+L) additive mask or None (causal).
        logits_rows: rows of the L positions to project (None: all).
        layers: `hidden_states` indices to return instead of the last layer (a proposer's `target_layers`).
        keep_last: return the last layer followed by `layers` (a proposer's `keep_last_hidden`, ReDrafter).

    Returns:
        logits: (L', V) for the selected rows; hidden: (L, H) last-layer (post-norm) states, or (L, m*H) the
        requested layers concatenated when `layers` is given ((L, (1+m)*H) with the last layer first when
        `keep_last`).
    """
    with varying_shape_sdpa(input_ids.device):  # no cuDNN graph per new length on CUDA (outside captures)
        out = forward_with_hidden(
            cast(PreTrainedModel, model),
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            layers=layers,
            use_cache=True,
            logits=False,
            fast=True,
        )
    hidden = out.hidden[0]  # (L, H)
    rows = hidden if logits_rows is None else hidden[logits_rows]
    logits = lm_logits(cast(PreTrainedModel, model), rows)  # (L', V)
    if layers:
        assert out.layers is not None
        extra = out.layers[0].flatten(-2)  # (L, m*H): the requested layers concatenated
        hidden = torch.cat([hidden, extra], dim=-1) if keep_last else extra  # (L, (1+m)*H) | (L, m*H)
    return logits, hidden


def _emit(out: list[int], new: Iterable[int], stop_ids: set[int], max_new_tokens: int) -> bool:
    """Append tokens until a stop token (kept) or the budget; True when generation is finished."""
    for t in new:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


def _setup(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt_ids: Tensor | list[int],
    stop_ids: set[int] | None,
) -> tuple[torch.device, set[int], Tensor, DecodeStats]:
    """Shared by both loops: (device, stop ids, prompt ids (1, L) on the device, fresh stats)."""
    device = model_device(model)
    stop_ids = default_stop_ids(tokenizer, model) if stop_ids is None else set(stop_ids)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)  # (1, L)
    if ids.shape[1] == 0:
        raise ValueError("prompt_ids is empty")
    return device, stop_ids, ids, DecodeStats(prompt_tokens=ids.shape[1])


def _finish(stats: DecodeStats, out: list[int], stop_ids: set[int], device: torch.device, t0: float) -> None:
    """Shared by both loops: stop the clock (after a device sync) and record length and finish reason."""
    sync_device(device)
    stats.time_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    stats.finish_reason = "stop" if out and out[-1] in stop_ids else "length"


@torch.inference_mode()
def ar_generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt_ids: Tensor | list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: set[int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], DecodeStats]:
    """Autoregressive baseline: same forward, cache, prefill, sampling and stop rule as the decoder.

    Returns:
        tokens: the new tokens (stop token included when hit); stats.
    """
    device, stop_ids, ids, stats = _setup(model, tokenizer, prompt_ids, stop_ids)
    sync_device(device)
    t0 = time.perf_counter()
    cache = new_cache(model, ids.shape[1] + max_new_tokens)
    logits, _ = target_forward(model, ids, cache, logits_rows=slice(-1, None))
    out: list[int] = []
    done = max_new_tokens <= 0
    while not done:
        tok = sample_token(logits[-1], temperature, top_k, top_p, generator)
        done = _emit(out, [tok], stop_ids, max_new_tokens)
        if not done:
            logits, _ = target_forward(model, torch.tensor([[tok]], device=device), cache)
            stats.steps += 1
    _finish(stats, out, stop_ids, device, t0)
    return out, stats


@torch.inference_mode()
def speculative_generate(
    model: torch.nn.Module,
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
    verify_fn: Callable[[DraftTree, Tensor], tuple[Tensor, int]] | None = None,
    fallback: FallbackController | None = None,
) -> tuple[list[int], DecodeStats]:
    """Tree-attention speculative decoding with `proposer`; lossless w.r.t. `ar_generate`.

    Args:
        model: HF causal LM (any dtype/device; batch size 1).
        tokenizer: used only for the default stop ids.
        prompt_ids: (L,) prompt token ids (chat template already applied).
        proposer: drafts a `DraftTree` rooted at the newest committed token.
        max_new_tokens: budget of emitted tokens.
        temperature: 0 = greedy acceptance, > 0 = recursive rejection sampling.
        stop_ids: tokens that end generation (default: EOS + end-of-turn).
        top_k, top_p: sampling filters (T > 0 only), same as the baseline.
        generator: RNG for sampling.
        profile: synchronise the device around each phase for an exact time breakdown.
        verify_fn: replaces the exact acceptance rules: (tree, logits (N, V)) -> (path, bonus), e.g. the
            LOSSY `medusa_tree.typical_verify` (None: greedy / recursive rejection, both lossless).
        fallback: a `FallbackController` that replaces drafting by plain target steps (a root-only tree) while
            drafting does not pay on this machine (None: always draft). Output is unchanged either way. Its
            running means carry over from call to call (same machine, same drafter).

    Returns:
        tokens: the new tokens; stats (accepted drafts per step, tree sizes, timings).
    """
    device, stop_ids, ids, stats = _setup(model, tokenizer, prompt_ids, stop_ids)
    dtype = cast(nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight.dtype

    def synced_clock() -> float:
        sync_device(device)
        return time.perf_counter()

    clock = synced_clock if profile else time.perf_counter
    sync_device(device)
    t0 = time.perf_counter()
    cache = new_cache(model, ids.shape[1] + max_new_tokens)
    proposer.reset()
    layers = proposer.spec.feature_layers  # EAGLE-3 reads intermediate layers
    keep_last = proposer.spec.keep_last_hidden  # ReDrafter: [h; layers]
    logits, hidden = target_forward(
        model, ids, cache, logits_rows=slice(-1, None), layers=layers, keep_last=keep_last
    )
    check_supported(cache)
    root = sample_token(logits[-1], temperature, top_k, top_p, generator)
    t1 = clock()
    stats.prefill_s = t1 - t0
    out: list[int] = []
    done = max_new_tokens <= 0 or _emit(out, [root], stop_ids, max_new_tokens)
    new_hidden = hidden  # (n, H) states of the newly committed positions
    new_tokens = torch.cat([ids[0, 1:], torch.tensor([root], device=device)])  # (n,) what each predicts
    while not done:
        drafted = fallback is None or fallback.should_draft()
        if drafted:
            tree = proposer.propose(new_hidden, new_tokens).to(device)
            if int(tree.tokens[0]) != root:
                raise RuntimeError(
                    f"proposer returned a tree rooted at {int(tree.tokens[0])}, expected {root}"
                )
        else:  # a plain target step; the proposer sees these positions with the next drafted step's
            tree = DraftTree(torch.tensor([root], device=device), torch.tensor([-1], device=device))
        t2 = clock()
        prefix_len = cache_len(cache)
        if drafted:  # (1, 1, N, P+N) ancestor mask, positions P + depth
            mask, positions = (
                tree_attention_mask(tree, prefix_len, dtype),
                tree_position_ids(tree, prefix_len),
            )
        else:  # one node: exactly AR's causal step
            mask, positions = None, None
        logits, hidden = target_forward(
            model, tree.tokens[None], cache, positions, mask, layers=layers, keep_last=keep_last
        )  # (N, V), (N, H) or (N, m*H)
        t3 = clock()
        if verify_fn is not None:  # a custom rule, e.g. Medusa's LOSSY typical acceptance
            path, bonus = verify_fn(tree, logits)
        elif temperature <= 0.0:
            path, bonus = greedy_verify(tree, logits)
        else:
            path, bonus = sample_verify(tree, logits, temperature, top_k, top_p, generator)
        keep_accepted(cache, prefix_len, path)
        drafts = tree.tokens[path[1:]]  # (a-1,)
        done = _emit(out, [*drafts.tolist(), bonus], stop_ids, max_new_tokens)  # the step's one host sync
        if drafted:  # (a, H) states and (a,) next tokens of the newly committed positions
            new_hidden, new_tokens = hidden[path], torch.cat([drafts, torch.tensor([bonus], device=device)])
        else:  # not drafted: keep them for the proposer's next call
            new_hidden = torch.cat([new_hidden, hidden[path]])
            new_tokens = torch.cat([new_tokens, torch.tensor([bonus], device=device)])
        root = bonus
        t4 = clock()
        ratio = proposer.last_compression if drafted else None
        stats.record_step(path.shape[0], tree.num_nodes, ratio, (t1, t2, t3, t4), drafted, fallback)
        t1 = t4
    _finish(stats, out, stop_ids, device, t0)
    return out, stats
