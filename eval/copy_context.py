"""The committed tokens a copy gate looks its candidates up in, as a proposer keeps them between calls.

A drafter with a copy gate (`models/copy_lookup.py`: the ReDrafter; `models/eagle_copy.py`: the EAGLE heads)
looks each draft node's candidate up on the committed tokens + the node's path. A proposer is told the newly
committed positions at every call, `tokens` (n,) with the new root last; the root is committed only once the next
call shows it was (it is always: the verify keeps the root), so each call appends the previous root and
tokens[:-1]. Two stores of the same sequence:

- `index`, on the host (`NgramIndex`): for the dynamic expansions and searches, which look up on the host;
- `buf[:n]`, on the device with its length `length` also on the device (no host sync to read it): for the
  fixed-shape steps (`lookup_fixed_rows`), which CUDA graphs capture. The buffer is preallocated and doubled
  when full; a captured step read the old buffer, so `commit` and `reserve` say when it moved and the caller
  drops its graphs.

    ctx = CopyContext(ngram=4, device=dev, room=256)
    copy = ctx.update_index(tokens)        # dynamic: the host index, for the search's lookups
    if ctx.commit(tokens):                 # fixed shape: the device buffer (True: reallocated)
        graphs = {}                        # captured against the old buffer
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdraft.data.ngrams import NgramIndex


class CopyContext:
    """Committed tokens before the current root, on the host (`index`) and in a device buffer (`buf`).

    Args:
        ngram: the gate's longest matched m-gram (the family's declared `copy_ngram`).
        device: where the buffer lives (the drafter's device).
        room: the buffer's initial capacity in tokens (1 where nothing reads it: no gate, or no fixed shape).
    """

    def __init__(self, ngram: int, device: torch.device, room: int) -> None:
        self.ngram = int(ngram)
        self.index: NgramIndex | None = None  # host index, built at the first `update_index`
        self._root: int | None = None  # the previous call's root (host): committed on the next call
        self.buf = torch.zeros(room, dtype=torch.long, device=device)  # (C,) committed tokens in [: n]
        self.n = 0  # tokens in `buf` (host)
        self.length = torch.zeros((), dtype=torch.long, device=device)  # () the same count, on the device
        self._root_t: Tensor | None = None  # (1,) the previous call's root (device), committed on the next

    def reset(self) -> None:
        """Forget the previous prompt (the buffer keeps its capacity: captured steps still read it)."""
        self.index, self._root = None, None
        self.n, self._root_t = 0, None
        self.length.fill_(0)

    def update_index(self, tokens: Tensor) -> NgramIndex:
        """Host store: index the committed tokens before the new root (the previous root, then tokens[:-1]).

        Args:
            tokens: (n,) the newly committed positions' next tokens; tokens[-1] is the new root.

        Returns:
            The index (`NgramIndex.lookup(chain)`: the candidate after committed + chain).
        """
        if self.index is None:
            self.index = NgramIndex(self.ngram)
        self.index.extend(([] if self._root is None else [self._root]) + tokens[:-1].tolist())
        self._root = int(tokens[-1])
        return self.index

    def commit(self, tokens: Tensor) -> bool:
        """Device store: append the previous root, then tokens[:-1], to `buf` (no host sync; tokens (n,) on any
        device) and set `length`.

        Returns:
            True when the buffer was reallocated to make room (steps captured against it must be captured again).
        """
        new = tokens[:-1].to(self.buf.device)
        if self._root_t is not None:
            new = torch.cat([self._root_t, new])  # (n',)
        end = self.n + new.shape[0]
        moved = self.reserve(end)
        self.buf[self.n : end] = new
        self.n = end
        self.length.fill_(end)
        self._root_t = tokens[-1:].to(self.buf.device).clone()
        return moved

    def reserve(self, needed: int, exact: bool = False) -> bool:
        """Room for `needed` tokens in `buf`: doubled when full (`exact`: grown to `needed` itself, e.g. rows
        drafted together sharing one capacity).

        Returns:
            True when the buffer was reallocated.
        """
        if needed <= self.buf.shape[0]:
            return False
        grown = self.buf.new_zeros(needed if exact else max(needed, 2 * self.buf.shape[0]))
        grown[: self.n] = self.buf[: self.n]
        self.buf = grown
        return True


def commit_rows(
    members: Sequence[CopyContext], drafting: Sequence[CopyContext], tokens: Sequence[Tensor]
) -> list[bool]:
    """Rows drafted in one fixed-shape step: each drafting row's `commit` of its `tokens`, then every member's
    buffer grown (exactly) to the largest capacity among them, so the buffers stack into one (R, C) input.

    Args:
        members: every row the step reads (the drafting ones among them); drafting: the rows that commit;
        tokens: per drafting row, its newly committed positions' next tokens (n_i,).

    Returns:
        per member, whether its buffer moved (steps captured against the old one must be captured again).
    """
    moved: set[int] = set()
    for ctx, t in zip(drafting, tokens, strict=True):
        if ctx.commit(t):
            moved.add(id(ctx))
    cap = max(ctx.buf.shape[0] for ctx in members)
    for ctx in members:
        if ctx.reserve(cap, exact=True):
            moved.add(id(ctx))
    return [id(ctx) in moved for ctx in members]
