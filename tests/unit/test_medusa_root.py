"""Root-conditioned Medusa heads (models/medusa_root.py): the formula, the plain heads at init, the warm start
from plain heads, the export round trip, the proposer reading each row's root, and the tree builder's input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from specdraft.data.collate import Collator
from specdraft.eval.medusa_tree import MedusaProposer, measure_rank_accuracies
from specdraft.eval.proposers import make_proposer
from specdraft.models import medusa
from specdraft.models.base_llm import forward_with_hidden, target_fingerprint
from specdraft.models.hub import export_drafter, load_drafter, warm_start
from specdraft.testing import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _schema(root: bool, **extra):
    return OmegaConf.create(
        {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
         "tree_choices": None, "draft_vocab_size": None, "root_token": root, **extra}
    )  # fmt: skip


@pytest.fixture
def target():
    torch.manual_seed(0)
    return tiny_llama().double().eval()


def _build(target, root: bool, jitter: float = 0.3) -> medusa.Medusa:
    fp = target_fingerprint(target, tiny_tokenizer())
    model = medusa.build(_schema(root), target, fp).double()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(jitter * torch.randn_like(p))
    return model.eval()


def test_heads_read_the_root_embedding_as_written(target):
    """x_k = h + W_k rms(E[root]), then head k; fp64 against the formula written out."""
    model = _build(target, root=True)
    torch.manual_seed(2)
    h, root = torch.randn(5, model.config.base_hidden_size, dtype=torch.float64), torch.randint(0, 128, (5,))
    logits = model.head_logits(h, root=root)  # (5, K, V)
    e = target.get_input_embeddings().weight[root]  # (5, H)
    e = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    hd = model.config.base_hidden_size
    w = model.root_input.proj.weight  # (K*H, H)
    for k in range(3):
        x = h + e @ w[k * hd : (k + 1) * hd].T
        block = model.heads[k][0].linear
        ref = model.heads[k][1](x + F.silu(block(x)))
        torch.testing.assert_close(logits[:, k], ref)
    with pytest.raises(ValueError, match=r"\(root_token=true\): pass `root`"):
        model.head_logits(h)
    assert not torch.equal(model.head_logits(h, root=root), model.head_logits(h, root=(root + 1) % 128))


def test_a_fresh_root_input_is_the_plain_heads_and_warm_starts_from_them(target, tmp_path):
    fp = target_fingerprint(target, tiny_tokenizer())
    plain = _build(target, root=False)
    export_drafter(plain, tmp_path / "plain")
    fresh = medusa.build(_schema(True), target, fp).double()
    assert not fresh.root_input.proj.weight.any()  # zero at init
    assert warm_start(fresh, str(tmp_path / "plain"), fp) == len(plain.state_dict())
    h, root = torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 128, (4,))
    torch.testing.assert_close(fresh.eval().head_logits(h, root=root), plain.head_logits(h), rtol=0, atol=0)


def test_a_root_export_refuses_a_warm_start_into_plain_heads(target, tmp_path):
    """Plain heads cannot compute what heads trained with the root computed: the tensor is named, not dropped."""
    fp = target_fingerprint(target, tiny_tokenizer())
    export_drafter(_build(target, root=True), tmp_path / "root")
    plain = medusa.build(_schema(False), target, fp).double()
    with pytest.raises(ValueError, match=r"has tensor 'root_input\.proj\.weight' that this drafter lacks"):
        warm_start(plain, str(tmp_path / "root"), fp)


def test_export_round_trip_reattaches_the_embeddings(target, tmp_path):
    model = _build(target, root=True)
    export_drafter(model, tmp_path / "root")
    loaded = load_drafter(str(tmp_path / "root"), target=target).double().eval()
    assert loaded.config.root_token and "root_input.proj.weight" in loaded.state_dict()
    h, root = torch.randn(4, 32, dtype=torch.float64), torch.randint(0, 128, (4,))
    torch.testing.assert_close(
        loaded.head_logits(h, root=root), model.head_logits(h, root=root), rtol=0, atol=0
    )
    bare = load_drafter(str(tmp_path / "root")).double()  # no target: nothing borrowed
    with pytest.raises(RuntimeError, match="call `attach"):
        bare.head_logits(h, root=root)


def test_the_training_loss_reaches_the_root_projection(target):
    model = _build(target, root=True).train()
    torch.manual_seed(3)
    rows = [
        {"input_ids": torch.randint(0, 128, (n,)), "loss_mask": torch.ones(n, dtype=torch.long)}
        for n in (9, 7)
    ]
    batch = Collator(pad_id=0, draft_len=3)(rows)

    class Out:
        hidden = torch.randn(2, 9, 32, dtype=torch.float64)
        logits = None

    loss, _ = medusa.compute_loss(model, batch, Out(), {"draft_len": 3})
    loss.backward()
    assert model.root_input.proj.weight.grad is not None and model.root_input.proj.weight.grad.abs().sum() > 0


def test_the_proposer_reads_each_rows_root(target):
    """`propose` fills the tree from the heads at (h, root); `propose_rows` equals it row by row."""
    model = _build(target, root=True)
    prop = make_proposer(model, tree_nodes=12)
    assert isinstance(prop, MedusaProposer)
    torch.manual_seed(4)
    h = torch.randn(3, 32, dtype=torch.float64)
    a, b = prop.propose(h, torch.tensor([5, 6, 7])), prop.propose(h, torch.tensor([5, 6, 8]))
    assert int(a.tokens[0]) == 7 and int(b.tokens[0]) == 8
    top = model.topk_tokens(h[-1], prop.topk, prop.depth_used, root=torch.tensor(7))  # (depth, k)
    assert torch.equal(a.tokens[1:], top[prop.head[1:], prop.rank[1:]])
    assert not torch.equal(a.tokens[1:], b.tokens[1:])  # another root, other drafts from the same state
    rows = [prop, make_proposer(model, tree_nodes=12)]
    hidden, tokens = [h[:2], h[1:]], [torch.tensor([1, 9]), torch.tensor([2, 3])]
    together = prop.propose_rows(rows, hidden, tokens)
    assert together is not None
    for r, tree in enumerate(together):
        alone = rows[r].propose(hidden[r], tokens[r])
        assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)


def test_tree_accuracies_are_measured_with_the_root(target):
    """build_medusa_tree's accuracies: head logits at (h_t, x_{t+1}) against the labels, as counted by hand."""
    model = _build(target, root=True)
    torch.manual_seed(5)
    rows = [
        {"input_ids": torch.randint(0, 128, (n,)), "loss_mask": torch.ones(n, dtype=torch.long)}
        for n in (10, 8)
    ]
    batch = Collator(pad_id=0, draft_len=3)(rows)
    acc, n = measure_rank_accuracies(model, target, [batch], topk=4)
    hidden = forward_with_hidden(target, batch["input_ids"], attention_mask=batch["attention_mask"]).hidden
    sel = batch["pos_mask"]
    logits = model.head_logits(hidden[sel], root=batch["root"][sel])  # (N, K, V)
    labels = batch["targets"][sel]  # (N, K)
    top = logits.topk(4, -1).indices  # (N, K, 4)
    ok = labels != -100
    want = ((top == labels[..., None]) & ok[..., None]).sum(0).double() / ok.sum(0).clamp_min(1)[:, None]
    assert n == int(sel.sum())
    torch.testing.assert_close(acc, want)
