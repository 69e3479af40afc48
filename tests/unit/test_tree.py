"""DraftTree structure, masks, positions and ReDrafter beam packing (tensor-only prefix dedup)."""

import pytest
import torch

from specdraft.eval.tree import (
    PAD,
    DraftTree,
    ancestor_matrix,
    dedup_prefix,
    pack_beams,
    path_to,
    tree_attention_mask,
    tree_position_ids,
)


def _random_parents(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


def test_pack_beams_docstring_example():
    beams = torch.tensor([[9, 1, 2], [9, 1, 3], [9, 4, 2]])
    tree, ratio = pack_beams(beams)
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4]
    assert tree.depth.tolist() == [0, 1, 2, 2, 1, 2]
    assert tree.beam_nodes.tolist() == [[0, 1, 2], [0, 1, 3], [0, 4, 5]]
    assert ratio == pytest.approx(9 / 6)
    assert path_to(tree, 3).tolist() == [0, 1, 3]


@pytest.mark.parametrize("tail", [0, 2])
def test_one_beam_packs_as_the_general_path_does(tail):
    """W = 1 takes a chain fast path: the same tree as two identical beams packed the general way (the copy
    shares every node), PAD tails included."""
    beam = torch.tensor([7, 3, 3, 5, 1])
    if tail:
        beam[-tail:] = PAD
    one, ratio = pack_beams(beam[None])
    ref, _ = pack_beams(beam.repeat(2, 1))
    for name in ("tokens", "parents", "depth", "ancestors"):
        assert torch.equal(getattr(one, name), getattr(ref, name)), name
    assert torch.equal(one.beam_nodes, ref.beam_nodes[:1]) and ratio == 1.0


def test_dedup_prefix_first_owner():
    beams = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 2, 3], [5, 7, 2, 3]])
    first, unique = dedup_prefix(beams)
    assert first.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 3, 3, 3]]
    assert unique.sum().item() == 4 + 1 + 0 + 3


@pytest.mark.parametrize("seed", range(5))
def test_pack_beams_matches_parent_derivation_and_reconstructs_beams(seed):
    g = torch.Generator().manual_seed(seed)
    W, L = 8, 5
    beams = torch.randint(0, 3, (W, L), generator=g)  # small vocab: lots of sharing
    beams[:, 0] = 1
    tree, ratio = pack_beams(beams)
    ref_anc, ref_depth = ancestor_matrix(tree.parents)
    assert torch.equal(tree.ancestors, ref_anc) and torch.equal(tree.depth, ref_depth)
    assert torch.equal(tree.tokens[tree.beam_nodes], beams)  # every beam is a root path of the tree
    for w in range(W):
        assert path_to(tree, int(tree.beam_nodes[w, -1])).tolist() == tree.beam_nodes[w].tolist()
    # no two siblings carry the same token (the tree is a trie of the beams)
    key = tree.parents * 10 + tree.tokens
    assert key.unique().numel() == tree.num_nodes
    assert ratio == pytest.approx(W * L / tree.num_nodes)
    assert ratio > 1.0


def test_ancestor_matrix_random_trees():
    g = torch.Generator().manual_seed(0)
    for n in [1, 2, 7, 30]:
        parents = _random_parents(n, g)
        anc, depth = ancestor_matrix(parents)
        for i in range(n):  # reference: walk up by hand
            chain, j = {i}, i
            while parents[j] >= 0:
                j = int(parents[j])
                chain.add(j)
            assert set(anc[i].nonzero().squeeze(1).tolist()) == chain
            assert depth[i] == len(chain) - 1


def test_mask_and_positions():
    tree = DraftTree(torch.tensor([4, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]))
    mask = tree_attention_mask(tree, prefix_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    visible = mask[0, 0] == 0
    assert visible[:, :3].all()  # prefix fully visible
    assert visible[:, 3:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert (mask[0, 0][~visible] == torch.finfo(torch.float32).min).all()
    assert tree_position_ids(tree, 3).tolist() == [[3, 4, 4, 5]]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]])
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def test_pack_beams_rejects_mixed_roots():
    with pytest.raises(ValueError, match="root"):
        pack_beams(torch.tensor([[1, 2], [3, 2]]))


def test_pack_beams_with_padded_beams():
    beams = torch.tensor(
        [[9, 1, 2, PAD, PAD], [9, 4, 2, PAD, PAD], [9, 1, 2, 7, 8], [9, PAD, PAD, PAD, PAD]]
    )  # beams of different lengths, right-padded (e.g. `min_prob`-pruned tails)
    tree, ratio = pack_beams(beams)
    assert tree.tokens.tolist() == [9, 1, 2, 4, 2, 7, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, 2, 5]
    assert tree.beam_nodes[3].tolist() == [0, PAD, PAD, PAD, PAD]
    ref_anc, ref_depth = ancestor_matrix(tree.parents)
    assert torch.equal(tree.ancestors, ref_anc) and torch.equal(tree.depth, ref_depth)
    assert ratio == pytest.approx(12 / 7)
