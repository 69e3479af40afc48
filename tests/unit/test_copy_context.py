"""The committed tokens a copy gate looks up in (eval/copy_context.py): the host index and the device buffer hold
the same sequence (the previous root joins at the next call), the buffer doubles when full and says so, and
`reset` starts again."""

from __future__ import annotations

import torch

from specdraft.data.ngrams import ngram_candidates
from specdraft.eval.copy_context import CopyContext, commit_rows
from specdraft.models.copy_lookup import lookup_fixed_rows

CPU = torch.device("cpu")


def test_index_and_buffer_hold_the_committed_tokens_before_the_root():
    ctx = CopyContext(3, CPU, room=4)
    calls = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 5, 6])]
    committed: list[int] = []
    for i, tokens in enumerate(calls):
        index = ctx.update_index(tokens)
        moved = ctx.commit(tokens)
        committed += ([int(calls[i - 1][-1])] if i else []) + tokens[:-1].tolist()  # previous root, then new
        assert index.ids == committed and ctx.buf[: ctx.n].tolist() == committed
        assert int(ctx.length) == ctx.n == len(committed)
        assert moved == (i == 2)  # 2, 3, then 5 tokens: the third call outgrows room 4 (doubled to 8)
    assert ctx.buf.shape[0] == 8
    # both stores give the same candidate after committed + a chain (host: NgramIndex, device: fixed rows)
    chain = [6]
    host = index.lookup(chain)
    cand, length = lookup_fixed_rows(ctx.buf[None], ctx.length.reshape(1), torch.tensor([[chain]]), 3)
    assert (int(cand[0, 0]), int(length[0, 0])) == host
    want = ngram_candidates(committed + chain, 3)
    assert host == (want[0][-1], want[1][-1])


def test_reserve_exact_and_reset():
    ctx = CopyContext(2, CPU, room=4)
    ctx.commit(torch.tensor([1, 2, 3]))
    assert not ctx.reserve(4) and ctx.reserve(6, exact=True) and ctx.buf.shape[0] == 6
    assert ctx.buf[:2].tolist() == [1, 2]  # kept across the move
    ctx.update_index(torch.tensor([1, 2, 3]))
    ctx.reset()
    assert ctx.index is None and ctx.n == 0 and int(ctx.length) == 0 and ctx.buf.shape[0] == 6
    ctx.commit(torch.tensor([4, 5]))  # no previous root after a reset
    assert ctx.buf[: ctx.n].tolist() == [4]


def test_rows_share_one_capacity_and_say_which_buffers_moved():
    """`commit_rows`: the drafting rows commit, then every member is grown to the largest capacity (exactly);
    a member whose buffer was reallocated (by its commit or the growth) is reported, the others are not."""
    a, b, idle = CopyContext(2, CPU, room=4), CopyContext(2, CPU, room=4), CopyContext(2, CPU, room=8)
    moved = commit_rows([a, b, idle], [a, b], [torch.arange(6), torch.tensor([3, 4])])
    # a: 5 tokens outgrow room 4 (doubled to 8); b: its 1 token fits, then it grows to a's 8; idle has 8
    assert moved == [True, True, False]
    assert [c.buf.shape[0] for c in (a, b, idle)] == [8, 8, 8]
    assert a.buf[:5].tolist() == [0, 1, 2, 3, 4] and b.buf[:1].tolist() == [3] and idle.n == 0
