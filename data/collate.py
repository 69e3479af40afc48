"""Training rows and batches for drafters (alignment in docs/design.md, "Token/hidden alignment").

A row is one conversation: `input_ids` (L,), `loss_mask` (L,), optionally `continuations` (L, T) and cached
features. `make_targets` turns it into, for every position t,
    root[t]        = cont[t][0]      (else x_{t+1})
    targets[t, k]  = cont[t][1 + k]  (else x_{t+2+k}, -100 where that token is past the end or not assistant)
    pos_mask[t]    = loss_mask[t+1] == 1 (and a valid root)
and `Collator` pads rows into a batch dict of tensors.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from specdraft.data.ngrams import ngram_candidates, slot_candidates

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


def make_targets(
    input_ids: Tensor,
    loss_mask: Tensor,
    draft_len: int,
    continuations: Tensor | None = None,
    greedy: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Root, draft labels and trainable positions of one row.

    Args:
        input_ids: (L,) long.
        loss_mask: (L,) 1 on assistant tokens.
        draft_len: D, draft slots after the root.
        continuations: (L, T) long greedy continuations (-100 padded) or None (then shift `input_ids`).
        greedy: (L,) long, the target's own argmax at every position (cached `topk_ids[:, 0]`), or None. When
            given, the positions whose next token is *not* an assistant token (prompt, user turns) train too, on
            the target's greedy chain: slot k's label is greedy[t+1+k], kept while the row's own tokens
            x_{t+2..t+1+k} follow that chain (so the label is what greedy decoding from x_{<=t+1} produces).

    Returns:
        root (L,) long (0 where invalid), targets (L, D) long (-100 = ignored), pos_mask (L,) bool.
    """
    n = input_ids.shape[0]
    mask = loss_mask.bool()
    nxt = torch.zeros(n, dtype=torch.bool)
    nxt[:-1] = mask[1:]  # (L,) x_{t+1} is an assistant token
    if continuations is not None:
        if continuations.shape[1] < draft_len + 1:
            raise ValueError(
                f"the dataset's continuations have T={continuations.shape[1]} tokens but drafter.draft_len="
                f"{draft_len} needs T >= {draft_len + 1}; lower draft_len or re-distill with a larger distill.T"
            )
        root = continuations[:, 0].clone()
        targets = continuations[:, 1 : 1 + draft_len].clone()  # (L, D)
    else:
        root = torch.zeros(n, dtype=torch.long)
        root[:-1] = input_ids[1:]
        targets = torch.full((n, draft_len), IGNORE_INDEX, dtype=torch.long)
        for k in range(draft_len):
            src = torch.arange(n) + 2 + k  # (L,) position of the label of slot k
            ok = src < n
            lab = input_ids[src[ok]]
            targets[ok, k] = torch.where(mask[src[ok]], lab, IGNORE_INDEX)
    pos_mask = nxt & (root != IGNORE_INDEX)
    if greedy is not None and continuations is None and n > 2:
        ctx = ~nxt  # (L,) positions the assistant labels do not cover
        ctx[n - 2 :] = False  # slot 0 needs greedy[t+1] with t+1 < L
        targets[ctx] = IGNORE_INDEX  # the shift may have put assistant tokens there: the chain decides
        on_chain = torch.ones(n, dtype=torch.bool)  # x_{t+2..t+1+k} == greedy[t+1..t+k] so far
        for k in range(draft_len):
            src = torch.arange(n) + 1 + k  # (L,) position whose argmax is slot k's label
            inside = src < n
            if k > 0:  # slot k-1's label greedy[t+k] must be the row's own x_{t+1+k}
                agree = torch.zeros(n, dtype=torch.bool)
                agree[inside] = input_ids[src[inside]] == greedy[src[inside] - 1]
                on_chain &= agree
            ok = ctx & on_chain & inside
            targets[ok, k] = greedy[src[ok]]
        pos_mask = pos_mask | ctx
    root = root.clamp_min(0)
    return root, targets, pos_mask


FEATURE_KEYS = ("hidden", "hidden_layers", "topk_ids", "topk_logprobs")  # cached per-token features, padded


class RowDataset(Dataset):
    """Rows (list of dicts, or a `datasets.Dataset`) -> dicts of tensors, decoding cached features."""

    def __init__(
        self,
        rows: Any,
        features: dict[str, Any] | None = None,
        use_features: bool = True,
        layers: tuple[int, ...] = (),
    ) -> None:
        """`layers`: hidden_states indices to hand out as `hidden_layers` (L, m, H), in this order; each must be
        among the cached `features["layers"]` (`cached_layers_cover` says whether they are)."""
        self.rows = rows
        self.features = features if (features and use_features) else None
        cached = list(self.features["layers"]) if self.features else []
        self.layer_cols = [cached.index(i) for i in layers]  # columns of the cached stack, in `layers` order

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        row = self.rows[int(i)]
        item = {"index": torch.tensor(int(i)), "input_ids": torch.tensor(row["input_ids"], dtype=torch.long)}
        item["loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.long)
        if row.get("continuations") is not None:
            item["continuations"] = torch.tensor(row["continuations"], dtype=torch.long)
        if self.features is not None:
            from specdraft.data.features import decode_features

            item.update(decode_features(row, self.features, self.layer_cols))  # hidden_layers: (L, m, H)
        return item


def cached_layers_cover(features: dict[str, Any] | None, layers: tuple[int, ...]) -> bool:
    """True when distill/ cached the last hidden state and every one of `layers` (so the target need not run)."""
    if not layers or not features or not features.get("hidden"):
        return False
    return set(layers) <= set(features.get("layers") or ())


@dataclass
class Collator:
    """Pads rows to the longest one and builds root/targets/pos_mask (right padding)."""

    pad_id: int  # token id used for padding input_ids
    draft_len: int  # D
    context_positions: bool = (
        False  # also train prompt/user positions on the target's greedy chain (cached top-k)
    )
    copy_ngram: int = 0  # > 0: add the copy gate's lookup candidates (ReDrafter `copy_ngram`)

    def __call__(self, items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """items -> batch: input_ids/attention_mask/root (B, L), targets (B, L, D), pos_mask (B, L) bool,
        optional hidden (B, L, H), hidden_layers (B, L, m, H), topk_ids/topk_logprobs (B, L, k); `num_positions` ()
        trainable positions; with `copy_ngram`, copy_ids (B, L, D) (-1: none) and copy_len (B, L, D)."""
        bsz, seq = len(items), max(int(it["input_ids"].shape[0]) for it in items)
        batch = {
            "input_ids": torch.full((bsz, seq), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros(bsz, seq, dtype=torch.long),
            "root": torch.zeros(bsz, seq, dtype=torch.long),
            "targets": torch.full((bsz, seq, self.draft_len), IGNORE_INDEX, dtype=torch.long),
            "pos_mask": torch.zeros(bsz, seq, dtype=torch.bool),
        }
        if self.copy_ngram > 0:
            batch["copy_ids"] = torch.full((bsz, seq, self.draft_len), -1, dtype=torch.long)
            batch["copy_len"] = torch.zeros(bsz, seq, self.draft_len, dtype=torch.long)
        for key in FEATURE_KEYS:
            if key in items[0]:
                shape, dtype = items[0][key].shape[1:], items[0][key].dtype
                batch[key] = torch.zeros((bsz, seq, *shape), dtype=dtype)
        for b, it in enumerate(items):
            n = int(it["input_ids"].shape[0])
            greedy = None
            if self.context_positions:
                if "topk_ids" not in it:
                    raise ValueError(
                        "train.context_positions=true needs the teacher top-k cached by distill/ (distill.topk > 0)"
                    )
                greedy = it["topk_ids"][:, 0]  # (L,) the target's argmax at every position
            root, targets, pos = make_targets(
                it["input_ids"], it["loss_mask"], self.draft_len, it.get("continuations"), greedy
            )
            batch["input_ids"][b, :n] = it["input_ids"]
            batch["attention_mask"][b, :n] = 1
            batch["root"][b, :n], batch["targets"][b, :n], batch["pos_mask"][b, :n] = root, targets, pos
            if self.copy_ngram > 0:
                cand, length = ngram_candidates(it["input_ids"].tolist(), self.copy_ngram)  # (L,) each
                batch["copy_ids"][b, :n], batch["copy_len"][b, :n] = slot_candidates(
                    torch.tensor(cand), torch.tensor(length), it["input_ids"], root, targets
                )  # (L, D) each
            for key in FEATURE_KEYS:
                if key in batch:
                    batch[key][b, :n] = it[key]
        if "index" in items[0]:
            batch["index"] = torch.stack([it["index"] for it in items])  # (B,) row ids (feature cache keys)
        batch["num_positions"] = batch["pos_mask"].sum()
        return batch


class EpochSampler(Sampler[int]):
    """A permutation of range(n) fixed by (seed, epoch): the data order is a pure function of the position."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of `epoch` (called by accelerate's DataLoaderShard.set_epoch)."""
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n


def label_counts(rows: Any, vocab_size: int, limit: int = 5000) -> Tensor:
    """(V,) counts of assistant tokens in the first `limit` rows (the unigram baseline's statistics)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i in range(min(len(rows), limit)):
        row = rows[i]
        ids = torch.tensor(row["input_ids"], dtype=torch.long)
        m = torch.tensor(row["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[m], minlength=vocab_size)[:vocab_size].double()
    return counts


def raw_rows(cfg: Any, tokenizer: Any) -> tuple[list[dict], list[dict], str]:
    """Tokenised (train, val) rows from raw conversations (`cfg.data`), and a one-line report."""
    from specdraft.data.chat import tokenize_conversation
    from specdraft.data.conversations import load_conversations, split_conversations

    if cfg.get("train", {}).get("val_data_dir"):
        raise ValueError(
            f"train.val_data_dir={cfg.train.val_data_dir} needs train.data_dir (held-out rows from another "
            "distilled dataset are only read when training on a distilled dataset)"
        )
    convs, report = load_conversations(cfg.data.source, split=cfg.data.split, limit=cfg.data.num_samples)
    train, val = split_conversations(convs, cfg.data.val_fraction, cfg.data.seed)

    def tok(cs: list) -> list[dict]:
        rows = [{"id": c.id, **tokenize_conversation(tokenizer, c.messages, cfg.data.max_length)} for c in cs]
        return [r for r in rows if sum(r["loss_mask"][1:]) > 0]  # at least one trainable position

    return tok(train), tok(val), report.summary()
