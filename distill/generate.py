"""Batched generation with a KV cache for prompts of mixed lengths, with length-aware packing and refill.

One decode batch holds up to `max_batch_size` rows. Prompts are taken longest first; a prompt joins the
batch while `rows * max(prompt_len + max_new)` stays within `batch_tokens`. When rows finish (stop token or
their token budget), they leave the batch and waiting prompts are prefilled on their own and spliced in:

    cache columns ->   0 1 2 3 4 5 6 7 8 9
    row 0 (running)    a a a a a a g g g .     a = prompt, g = generated, . = the next token
    row 1 (new)        0 0 0 0 0 b b b b .     0 = left padding (mask 0, K/V zeros)

Each row keeps its own position ids (real tokens before it), so padding never changes the arithmetic a row
sees; greedy output equals unbatched greedy output (tested in fp64). Left columns that are padding for
every row are trimmed after rows leave, so the cache width stays <= max(prompt_len + generated).

With `capture` (a `FeatureSpec`) the same forwards also record the target features of every position they
feed (prefill: the prompt; decode steps: the generated tokens), moved to the CPU in the feature dtype per
forward. A finished row's last token and the `tail` ids after it (e.g. the chat template's end of turn) are
fed in one extra forward of the rows that finished at that step (right-padded to the longest tail), on a
copy of their cache, so the batch and the emitted tokens are the same as without capture:

    fed ids    prompt (prefill) | g_1 .. g_{n-1} (decode steps) | tail(g, reason) (own forward at finish)
    Captured   features at every one of these positions, in order
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from specdraft.data.features import FeatureSpec
from specdraft.distill.features import feature_tensors
from specdraft.distill.slack_cache import SlackLayer, slack_cache
from specdraft.models.base_llm import TargetOutput, fast_supported, forward_with_hidden, lm_logits
from specdraft.models.hf_compat import cache_kwargs, returned_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TailFn = Callable[[list[int], str], list[int]]  # (generated ids, finish reason) -> ids fed after g_{n-1}
Features = dict[str, torch.Tensor]  # `feature_tensors` output: (n, ...) per key, CPU, feature dtype
CHUNK = 256  # positions per LM-head call when a forward's features are taken for many rows at once


@dataclass
class GenerationSettings:
    """How to generate; `stop_ids` are EOS / end-of-turn ids (a row stops after emitting one)."""

    max_new_tokens: int = 128  # per prompt (a per-prompt list may lower it)
    stop_ids: tuple[int, ...] = ()  # EOS / end-of-turn token ids
    pad_id: int = 0  # id fed at padded positions (masked out, value irrelevant)
    do_sample: bool = False  # sample instead of greedy
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus threshold
    batch_tokens: int = 4096  # rows * max(prompt_len + max_new) per batch at most
    max_batch_size: int = 32  # rows per batch at most
    refill: bool = True  # splice waiting prompts in as rows finish (False: static batches)


@dataclass
class Captured:
    """Target features recorded while generating one prompt, for the ids the forwards fed.

    `ids` = prompt + generated[:-1] + tail(generated, finish_reason); `tensors` hold `feature_tensors`'
    keys, each with len(ids) rows: hidden (L, H), hidden_layers (L, m, H), topk_ids / topk_logprobs (L, k).
    """

    ids: list[int]
    tensors: Features


@dataclass
class Generation:
    """One prompt's output: `tokens` include the stop token when `finish_reason == "eos"`."""

    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    captured: Captured | None = None  # features of the generation pass (`capture` set, >= 1 token)

    @property
    def length(self) -> int:
        """Number of generated tokens."""
        return len(self.tokens)


def feed_last(tokens: list[int], reason: str) -> list[int]:
    """Default tail: feed the last generated token, so the captured ids are prompt + generated."""
    return tokens[-1:]


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None
) -> tuple[int, ...]:
    """EOS + end-of-turn ids of the tokenizer (`data.chat.stop_token_ids`) and of the model's generation config."""
    from specdraft.data.chat import stop_token_ids as chat_stop_ids

    ids = set(chat_stop_ids(tokenizer))
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
    return tuple(sorted(ids))


def pick_tokens(
    logits: torch.Tensor, s: GenerationSettings, generator: torch.Generator | None
) -> torch.Tensor:
    """Next tokens from last-position logits (B, V): argmax, or temperature + top-p sampling. Returns (B,)."""
    if not s.do_sample or s.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # (B, V)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < s.top_p  # the top token is always kept
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = cache.layers
    if not all(type(layer) in (DynamicLayer, SlackLayer) for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise NotImplementedError(f"batched refill needs plain DynamicLayer caches, got {kinds}")
    return cast("list[DynamicLayer]", layers)


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _merge(cache: DynamicCache, mask: torch.Tensor, new_cache: DynamicCache, new_mask: torch.Tensor):
    """Left-pad two (cache, mask) batches to a common width and stack them along the batch dim."""
    width = max(mask.shape[1], new_mask.shape[1])
    for old, new in zip(_layers(cache), _layers(new_cache)):
        for name in ("keys", "values"):  # (B, heads, W, d)
            a, b = getattr(old, name), getattr(new, name)
            a, b = _left_pad(a, width - a.shape[2], 2), _left_pad(b, width - b.shape[2], 2)
            setattr(old, name, torch.cat([a, b], dim=0))
    a, b = _left_pad(mask, width - mask.shape[1], 1), _left_pad(new_mask, width - new_mask.shape[1], 1)
    return cache, torch.cat([a, b], dim=0)  # (B + B', W)


def _select(cache: DynamicCache, mask: torch.Tensor, keep: torch.Tensor):
    """Keep batch rows `keep` (K,) and drop leading columns that are padding in every kept row."""
    mask = mask[keep]  # (K, W)
    start = int(mask.any(0).long().argmax()) if mask.numel() else 0
    for layer in _layers(cache):
        assert layer.keys is not None and layer.values is not None  # filled by the prefill
        layer.keys = layer.keys[keep, :, start:]
        layer.values = layer.values[keep, :, start:]
    return cache, mask[:, start:]


def _forward(
    model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache, capture: FeatureSpec | None
) -> tuple[torch.Tensor, DynamicCache, list[Features] | None]:
    """One cached forward over ids (B, n) with mask (B, W + n) and positions (B, n).

    A decode step (n = 1) of a model `fast_forward` reproduces runs that lean forward (the decoders' own,
    `models/fast_target.py`: the same layers to rounding, without transformers' per-module plumbing and mask
    preprocessing), with the padding mask as a (B, 1, 1, W + 1) boolean; a prefill runs transformers' forward.

    Returns:
        (last-position logits (B, V), cache, per row the features of its positions whose mask is 1 among
        the n fed (None without `capture`)).
    """
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    lean = (  # the (B, 1, 1, W + 1) mask says nothing of a window the keys would exceed
        ids.shape[1] == 1 and fast_supported(model) and (window is None or mask.shape[1] <= int(window))
    )
    if capture is None and not lean:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(model, cache),
        )
        return out.logits[:, -1], returned_cache(out), None
    layers = capture.layers if capture is not None else ()
    res = forward_with_hidden(
        model,
        ids,
        mask[:, None, None, :].bool() if lean else mask,  # (B, 1, 1, W + 1): True = attend
        pos,
        cache,
        layers,
        use_cache=True,
        logits=False,
        fast=lean,
    )
    logits = lm_logits(model, res.hidden[:, -1])  # (B, V)
    if capture is None:
        return logits, res.past_key_values, None
    B, n = ids.shape
    if n == 1:  # a decode step: all rows at once, the top-k from the logits just computed
        rl = res.layers[:, 0] if res.layers is not None else None  # (B, m, H)
        f = feature_tensors(model, res.hidden[:, 0], rl, capture, logits)  # (B, ...) per key
        return logits, res.past_key_values, [{k: v[b : b + 1] for k, v in f.items()} for b in range(B)]
    fed = mask[:, -n:].bool()  # (B, n) the positions fed after each row's left padding
    return logits, res.past_key_values, _row_features(model, res, fed, capture)


def _row_features(model, res: TargetOutput, fed: torch.Tensor, capture: FeatureSpec) -> list[Features]:
    """Per row the features of its `fed` (B, n) positions of one forward `res`, in order; (k_b, ...) each.

    A few LM-head calls (`CHUNK` positions each) and copies to the CPU for the whole batch: a row at a time
    cost B of each, on a GPU every one a launch and a host sync.
    """
    hidden = res.hidden[fed]  # (sum k_b, H), row-major: row b's positions together, in order
    layers = res.layers[fed] if res.layers is not None else None  # (sum k_b, m, H)
    chunks = [  # the (n, V) logits of the top-k a chunk at a time: bounded memory on a CPU
        feature_tensors(
            model, hidden[i : i + CHUNK], None if layers is None else layers[i : i + CHUNK], capture
        )
        for i in range(0, hidden.shape[0], CHUNK)
    ]
    flat = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]} if chunks else {}
    counts = fed.sum(-1).tolist()  # k_b per row
    parts = {k: v.split(counts) for k, v in flat.items()}  # CPU views
    return [{k: parts[k][b] for k in flat} for b in range(len(counts))]


@torch.no_grad()
def _prefill(
    model, prompts: list[list[int]], pad_id: int, device, capture: FeatureSpec | None = None
) -> tuple:
    """Left-padded prefill of `prompts`.

    Returns:
        (last logits (B, V), cache, mask (B, P), next positions (B,), prompt features per row or None).
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P) real tokens before each position
    logits, cache, feats = _forward(model, ids, mask, pos, slack_cache(), capture)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    return logits, cache, mask, lengths, feats


@torch.no_grad()
def _tail_features(
    model,
    cache: DynamicCache,
    mask: torch.Tensor,
    pos: torch.Tensor,
    rows: list[int],
    tails: list[list[int]],
    capture: FeatureSpec,
) -> list[Features]:
    """Features of `tails[j]` fed after batch row `rows[j]`, all in one forward; (len(tails[j]), ...) each.

    Args:
        cache, mask: the batch's cache and mask (B, W) as of now (not modified: the rows are copied).
        pos: (B,) each row's next position.
        rows: batch indices of finished rows; tails: their ids to feed (>= 1 each).
    """
    idx = torch.tensor(rows, device=mask.device)  # (E,)
    sub_mask = mask[idx]  # (E, W)
    start = int(sub_mask.any(0).long().argmax())  # columns that are padding in every chosen row dropped
    sub = DynamicCache()
    for i, layer in enumerate(_layers(cache)):
        assert layer.keys is not None and layer.values is not None  # filled by the prefill
        sub.update(layer.keys[idx, :, start:], layer.values[idx, :, start:], i)  # (E, heads, W', d) copies
    n = max(len(t) for t in tails)
    # right-padded with each row's last id: causal attention keeps real positions blind to the padding after them
    x = torch.tensor([t + t[-1:] * (n - len(t)) for t in tails], device=mask.device)  # (E, n)
    sub_mask = torch.cat([sub_mask[:, start:], sub_mask.new_ones((len(rows), n))], dim=1)  # (E, W' + n)
    sub_pos = pos[idx][:, None] + torch.arange(n, device=mask.device)[None]  # (E, n)
    res = forward_with_hidden(model, x, sub_mask, sub_pos, sub, capture.layers, use_cache=True, logits=False)
    lengths = torch.tensor([len(t) for t in tails], device=mask.device)
    fed = torch.arange(n, device=mask.device)[None] < lengths[:, None]  # (E, n)
    return _row_features(model, res, fed, capture)


@torch.no_grad()
def generate_batched(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    settings: GenerationSettings,
    max_new_tokens: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[int], None] | None = None,
    capture: FeatureSpec | None = None,
    tail: TailFn = feed_last,
) -> list[Generation]:
    """Generate a continuation for every prompt, batched with a KV cache.

    Args:
        model: a HF causal LM (Llama-style; its cache a `slack_cache`), in eval mode.
        prompts: token ids per prompt (any lengths, >= 1 token each).
        settings: sampling, stop ids and batch budget.
        max_new_tokens: optional per-prompt budget (default `settings.max_new_tokens` for all).
        generator: RNG for sampling.
        on_tokens: called with the number of tokens emitted after every forward (progress bars).
        capture: record these target features of the fed positions (`Generation.captured`); None: off.
        tail: with `capture`, the ids fed after g_{n-1} once a row finishes (module docstring).

    Returns:
        One `Generation` per prompt, in input order.
    """
    n = len(prompts)
    budgets = list(max_new_tokens) if max_new_tokens is not None else [settings.max_new_tokens] * n
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {n} prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    stop = torch.tensor(sorted(set(settings.stop_ids)) or [-1], device=device)
    results: list[Generation | None] = [None] * n
    out_tokens: dict[int, list[int]] = {}
    chunks: dict[int, list[Features]] = {}  # captured features per prompt, one entry per forward
    for i in range(n):  # zero budgets finish without a forward
        if budgets[i] <= 0:
            results[i] = Generation([], "length")
    pending = sorted((i for i in range(n) if results[i] is None), key=lambda i: -len(prompts[i]))
    rows: list[int] = []  # prompt index per batch row
    cache: DynamicCache | None
    mask: torch.Tensor | None
    next_pos: torch.Tensor | None
    cache, mask, next_pos = None, None, None

    def footprint(i: int) -> int:
        return len(prompts[i]) + budgets[i]

    def admit() -> list[int]:
        if rows and not settings.refill:
            return []
        chosen: list[int] = []
        widest = max((footprint(i) for i in rows), default=0)
        while pending and len(rows) + len(chosen) < settings.max_batch_size:
            w = max(widest, footprint(pending[0]))
            if (rows or chosen) and (len(rows) + len(chosen) + 1) * w > settings.batch_tokens:
                break  # the first prompt always fits, however long
            chosen.append(pending.pop(0))
            widest = w
        return chosen

    def emit(logits: torch.Tensor, new_rows: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Pick a token from `logits` (B, V) for each of `new_rows`, record it and any finish.

        Returns:
            (tokens (B,), batch indices of the rows that finished).
        """
        tok = pick_tokens(logits, settings, generator)  # (B,)
        done = torch.isin(tok, stop)
        ended = []
        for b, (i, t, d) in enumerate(zip(new_rows, tok.tolist(), done.tolist())):  # one host sync each
            out_tokens[i].append(t)
            if d:
                results[i] = Generation(out_tokens.pop(i), "eos")
            elif len(out_tokens[i]) >= budgets[i]:
                results[i] = Generation(out_tokens.pop(i), "length")
            ended += [b] if results[i] is not None else []
        if on_tokens is not None:
            on_tokens(len(new_rows))
        return tok, ended

    def record(batch: list[int], feats: list[Features] | None) -> None:
        for i, f in zip(batch, feats or []):
            chunks.setdefault(i, []).append(f)

    def finish(
        ended: list[int], batch: list[int], c: DynamicCache, m: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """With `capture`: feed the tail of every ended row (batch index) and attach its features."""
        if capture is None:
            return
        fed = {}  # batch index -> tail ids
        for b in ended:
            g = results[batch[b]]
            assert g is not None  # `ended` rows have their result
            fed[b] = tail(g.tokens, g.finish_reason)
        with_tail = [b for b in ended if fed[b]]
        tails = (
            _tail_features(model, c, m, pos, with_tail, [fed[b] for b in with_tail], capture)
            if with_tail
            else []
        )
        extra = dict(zip(with_tail, tails))
        for b in ended:
            g, prompt = results[batch[b]], list(prompts[batch[b]])
            assert g is not None  # as above
            parts = chunks.pop(batch[b]) + ([extra[b]] if b in extra else [])
            tensors = {k: torch.cat([f[k] for f in parts]) for k in parts[0]}  # (L, ...)
            g.captured = Captured(prompt + g.tokens[:-1] + fed[b], tensors)

    last = torch.empty(0, dtype=torch.long, device=device)
    while pending or rows:
        chosen = admit()
        if chosen:
            for i in chosen:
                out_tokens[i] = []
            logits, new_cache, new_mask, new_pos, feats = _prefill(
                model, [list(prompts[i]) for i in chosen], settings.pad_id, device, capture
            )
            record(chosen, feats)
            tok, ended = emit(logits, chosen)
            finish(ended, chosen, new_cache, new_mask, new_pos)
            if cache is None:
                cache, mask, next_pos = new_cache, new_mask, new_pos
            else:
                assert mask is not None and next_pos is not None  # set together with `cache`
                cache, mask = _merge(cache, mask, new_cache, new_mask)
                next_pos = torch.cat([next_pos, new_pos])
            rows, last = rows + chosen, torch.cat([last, tok])
        keep = torch.tensor([results[i] is None for i in rows], device=device)
        if not bool(keep.all()):
            idx = keep.nonzero().squeeze(-1)
            rows = [rows[b] for b in idx.tolist()]
            if not rows:
                cache, mask, next_pos, last = None, None, None, last[:0]
                continue
            assert cache is not None and mask is not None and next_pos is not None  # rows are in flight
            cache, mask = _select(cache, mask, idx)
            next_pos, last = next_pos[idx], last[idx]
            if pending and settings.refill:
                continue  # refill the freed rows before the next decode step
        assert mask is not None and next_pos is not None  # rows are in flight
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)  # (B, W + 1)
        logits, cache, feats = _forward(model, last[:, None], mask, next_pos[:, None], cache, capture)
        next_pos = next_pos + 1
        record(rows, feats)
        last, ended = emit(logits, rows)
        finish(ended, rows, cache, mask, next_pos)
    return results  # type: ignore[return-value]  # every entry is set once the loop ends
