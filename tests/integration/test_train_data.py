"""data/collate.py: root/targets/pos_mask alignment (docs/design.md) and batching."""

from __future__ import annotations

import pytest
import torch

from specdraft.data.collate import Collator, EpochSampler, RowDataset, label_counts, make_targets


def test_make_targets_shift_follows_the_design_alignment():
    # x:    10 11 12 13 14 15 ; assistant tokens are 12..14 (positions 2-4)
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    mask = torch.tensor([0, 0, 1, 1, 1, 0])
    root, targets, pos = make_targets(ids, mask, draft_len=2)
    # position t trains iff x_{t+1} is an assistant token: t = 1, 2, 3
    assert pos.tolist() == [False, True, True, True, False, False]
    assert root.tolist()[:5] == [11, 12, 13, 14, 15]
    # slot k of position t is x_{t+2+k}, ignored when past the end or not an assistant token
    assert targets[1].tolist() == [13, 14]
    assert targets[2].tolist() == [14, -100]
    assert targets[3].tolist() == [-100, -100]


def test_make_targets_context_positions_follow_the_greedy_chain():
    # x:      10 11 12 13 14 15 16 ; assistant tokens 15, 16 (positions 5-6)
    # greedy: 12 20 13 21 15 16 17   (the target's argmax at each position: predicts x_{p+1} when it agrees)
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    mask = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    greedy = torch.tensor([12, 20, 13, 21, 15, 16, 17])
    root, targets, pos = make_targets(ids, mask, draft_len=3, greedy=greedy)
    assert pos.tolist() == [True] * 6 + [False]  # 0-3 context; 4, 5 assistant (x_{t+1} is an assistant token)
    assert targets[0].tolist() == [20, -100, -100]  # x_2 = 12 != greedy[1] = 20: the chain leaves the row
    assert targets[1].tolist() == [13, 21, -100]  # x_3 = 13 == greedy[2]; x_4 = 14 != greedy[3] = 21
    assert targets[2].tolist() == [21, -100, -100]
    assert targets[3].tolist() == [15, 16, 17]  # the chain follows the row into the answer
    assert targets[4].tolist() == [16, -100, -100]  # assistant positions unchanged
    assert root.tolist()[:6] == [11, 12, 13, 14, 15, 16]
    # a naive loop on a random row
    g = torch.Generator().manual_seed(0)
    n, d = 40, 4
    ids = torch.randint(0, 3, (n,), generator=g)
    greedy = torch.where(
        torch.rand(n, generator=g) < 0.7, torch.roll(ids, -1), torch.randint(0, 3, (n,), generator=g)
    )
    mask = (torch.arange(n) >= 25).long()
    _, targets, pos = make_targets(ids, mask, draft_len=d, greedy=greedy)
    base_root, base_targets, base_pos = make_targets(ids, mask, draft_len=d)
    for t in range(n):
        if base_pos[t]:
            assert targets[t].tolist() == base_targets[t].tolist()
            continue
        want = [-100] * d
        if t + 1 < n - 1:
            for k in range(d):
                if t + 1 + k >= n or any(int(ids[t + 2 + j]) != int(greedy[t + 1 + j]) for j in range(k)):
                    break
                want[k] = int(greedy[t + 1 + k])
        assert targets[t].tolist() == want, t
        assert bool(pos[t]) == (t + 1 < n - 1)


def test_collator_context_positions_need_cached_topk():
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}]
    item = RowDataset(rows)[0]
    with pytest.raises(ValueError, match="distill.topk"):
        Collator(pad_id=0, draft_len=2, context_positions=True)([item])
    item["topk_ids"] = torch.tensor([[9], [3], [4], [5]])  # argmax at each position
    batch = Collator(pad_id=0, draft_len=2, context_positions=True)([item])
    assert batch["pos_mask"].tolist() == [[True, True, True, False]]
    assert batch["targets"][0, 0].tolist() == [3, 4]  # greedy[1], then x_2 = 3 == greedy[1] -> greedy[2]


def test_make_targets_from_continuations():
    ids = torch.tensor([10, 11, 12, 13])
    mask = torch.tensor([0, 1, 1, 1])
    cont = torch.tensor([[11, 20, 21], [12, 22, 23], [13, 24, -100], [-100, -100, -100]])
    root, targets, pos = make_targets(ids, mask, draft_len=2, continuations=cont)
    assert pos.tolist() == [True, True, True, False]
    assert root.tolist() == [11, 12, 13, 0]
    assert targets.tolist() == [[20, 21], [22, 23], [24, -100], [-100, -100]]
    try:
        make_targets(ids, mask, draft_len=3, continuations=cont)
    except ValueError as e:
        assert "distill.T" in str(e)
    else:
        raise AssertionError("draft_len > T-1 must be refused")


def test_collator_pads_and_keeps_alignment():
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [5, 9], "loss_mask": [0, 1]},
    ]
    batch = Collator(pad_id=0, draft_len=2)([RowDataset(rows)[0], RowDataset(rows)[1]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["pos_mask"].tolist() == [[True, True, True, False], [True, False, False, False]]
    assert batch["targets"][1].tolist() == [[-100, -100]] * 4
    assert batch["targets"][0, 0].tolist() == [7, 8] and batch["index"].tolist() == [0, 1]
    assert int(batch["num_positions"]) == 4


def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    s = EpochSampler(10, seed=3)
    a = list(s)
    s.set_epoch(1)
    b = list(s)
    s.set_epoch(0)
    assert list(s) == a and b != a and sorted(b) == list(range(10))


def test_label_counts_only_assistant_tokens():
    rows = [{"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]}]
    assert label_counts(rows, 5).tolist() == [0, 0, 2, 0, 0]


def test_distilled_dataset_rows_features_and_guard(tmp_path):
    import pytest
    from omegaconf import OmegaConf

    from specdraft.data.collate import raw_rows
    from specdraft.distill.shards import FORMAT_VERSION, row_features, write_manifest, write_shard
    from specdraft.train.rows import distilled_rows

    spec = {"hidden": True, "layers": [], "topk": 0, "dtype": "bf16", "hidden_size": 4}
    rows = []
    for i in range(6):
        hidden = torch.full((5, 4), float(i), dtype=torch.bfloat16)
        rows.append({
            "id": str(i), "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1], "response_lengths": [3],
            "finish_reasons": ["eos"], "continuations": [[2, 3, 4], [3, 4, 5], [4, 5, 9], [5, 9, 9], [9, 9, -100]],
            "hidden": hidden.view(torch.int16).numpy().tobytes(),
        })  # fmt: skip
    write_shard(tmp_path, 0, rows, row_features(True, spec), {})
    target = {"name_or_path": "t", "hidden_size": 4, "vocab_size": 16, "tokenizer_hash": "abc"}
    write_manifest(tmp_path, {"format_version": FORMAT_VERSION, "target": target, "features": spec,
                              "shards": [{"name": "shard-00000", "rows": 6}], "num_rows": 6, "complete": True})  # fmt: skip
    cfg = OmegaConf.create({"train": {"data_dir": str(tmp_path)}, "data": {"seed": 0, "val_fraction": 0.34}})
    train, val, manifest = distilled_rows(cfg, target)
    assert train["id"] == ["0", "1", "2", "3", "5"] and val["id"] == ["4"]  # by id hash (split_indices)
    items = [RowDataset(train, manifest["features"])[i] for i in range(2)]
    batch = Collator(pad_id=0, draft_len=2)(items)
    assert batch["hidden"].shape == (2, 5, 4) and batch["hidden"].dtype == torch.bfloat16
    assert batch["root"][0].tolist() == [2, 3, 4, 5, 9]  # from continuations, not the shift
    assert batch["targets"][0, 2].tolist() == [5, 9] and batch["pos_mask"][0].tolist() == [
        False,
        True,
        True,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="hidden_size"):
        distilled_rows(cfg, {**target, "hidden_size": 8})

    # train.val_data_dir: held-out rows from another dataset's val split (the same ids are held out in both)
    other_dir = tmp_path / "other"
    other = [{**r, "id": str(i), "input_ids": [1, 2, 7, 7, 7]} for i, r in enumerate(rows)]
    for r in other:
        del r["continuations"]
    write_shard(other_dir, 0, other, row_features(False, spec), {})
    other_manifest = {"format_version": FORMAT_VERSION, "target": target, "features": spec,
                      "shards": [{"name": "shard-00000", "rows": 6}], "num_rows": 6, "complete": True}  # fmt: skip
    write_manifest(other_dir, other_manifest)
    cfg.train.val_data_dir = str(other_dir)
    train2, val2, _ = distilled_rows(cfg, target)
    assert train2["id"] == train["id"] and val2["id"] == ["4"] and val2["input_ids"] == [[1, 2, 7, 7, 7]]
    write_manifest(other_dir, {**other_manifest, "features": {**spec, "topk": 20}})
    with pytest.raises(ValueError, match="val_data_dir=.*caches features"):
        distilled_rows(cfg, target)
    with pytest.raises(ValueError, match="val_data_dir=.* needs train.data_dir"):  # not ignored on raw data
        raw_rows(OmegaConf.create({"train": {"data_dir": None, "val_data_dir": str(other_dir)}}), None)


def test_cached_intermediate_layers_replace_the_online_target():
    """EAGLE-3 reads distill/'s cached `hidden_layers` (any cached superset, any order) instead of running the
    target; what it gets equals the online forward up to the bf16 storage rounding."""
    from specdraft.data.collate import cached_layers_cover
    from specdraft.data.features import FeatureSpec
    from specdraft.distill.features import compute_features
    from specdraft.testing import tiny_llama
    from specdraft.train.evaluate import TargetFeatures

    target = tiny_llama(num_layers=4).eval()
    seqs = [[1, 5, 7, 9, 11, 3], [2, 4, 6, 8]]
    spec = FeatureSpec(hidden=True, layers=(3, 1, 2), hidden_size=int(target.config.hidden_size))
    rows = [
        {"input_ids": s, "loss_mask": [0] + [1] * (len(s) - 1), **f}
        for s, f in zip(seqs, compute_features(target, seqs, spec), strict=True)
    ]
    want = (1, 3)  # the drafter's layers: a subset of the cache, in another order
    assert cached_layers_cover(spec.to_dict(), want) and not cached_layers_cover(spec.to_dict(), (1, 4))
    assert not cached_layers_cover({**spec.to_dict(), "hidden": False}, want)
    ds = RowDataset(rows, spec.to_dict(), layers=want)
    batch = Collator(pad_id=0, draft_len=2)([ds[0], ds[1]])
    assert batch["hidden_layers"].shape == (2, 6, 2, target.config.hidden_size)

    def boom(*args, **kwargs):
        raise AssertionError("the target ran although the cache holds every layer")

    cached = TargetFeatures(boom, layers=want)(batch)
    online = TargetFeatures(target, layers=want)(
        {k: v for k, v in batch.items() if k not in ("hidden", "hidden_layers")}
    )
    assert cached.layers is not None and online.layers is not None
    valid = batch["attention_mask"].bool()  # (B, L): padding differs (zeros vs pad-token states)
    torch.testing.assert_close(
        cached.layers[valid].float(), online.layers[valid].float(), atol=2e-2, rtol=2e-2
    )
    torch.testing.assert_close(
        cached.hidden[valid].float(), online.hidden[valid].float(), atol=2e-2, rtol=2e-2
    )
    # Without the cache for a requested layer the batch has no `hidden_layers`, so the target runs online.
    assert "hidden_layers" not in Collator(pad_id=0, draft_len=2)([RowDataset(rows, spec.to_dict())[0]])
