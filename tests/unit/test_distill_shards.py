"""Shard storage (distill/shards.py): atomic writes, refusals, the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from specdraft.distill.shards import (
    DistillMismatchError,
    build_manifest,
    check_compatible,
    completed_shards,
    ids_digest,
    load_distilled,
    row_features,
    settings_hash,
    write_manifest,
    write_shard,
)

HEADER = {"format_version": 1, "target": {"tokenizer_hash": "abc"}, "generation": {"max_new_tokens": 8}, "T": 5,
          "data": {}, "features": None, "shard_size": 2}  # fmt: skip
ROW = {
    "id": "a",
    "input_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "response_lengths": [2],
    "finish_reasons": ["eos"],
}


def stats(plan, i):
    return {
        "settings_hash": settings_hash(HEADER),
        "ids_digest": ids_digest(plan[i]),
        "skipped": {"x": 1},
        "counts": {"turns": 1},
    }


def test_shard_write_is_atomic_and_manifest_rebuilds_from_shards(tmp_path, monkeypatch):
    plan = [["a", "b"], ["c"]]
    feats = row_features(False, None)
    write_shard(tmp_path, 0, [ROW, {**ROW, "id": "b"}], feats, stats(plan, 0))

    def boom(self, path, *a, **k):
        (Path(path) / "half.arrow").write_bytes(b"x")
        raise OSError("disk full")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", boom)
    with pytest.raises(OSError):
        write_shard(tmp_path, 1, [{**ROW, "id": "c"}], feats, stats(plan, 1))
    assert not (tmp_path / "shard-00001").exists()
    assert list(completed_shards(tmp_path)) == [0]
    man = build_manifest(HEADER, completed_shards(tmp_path), 2, {"bad_json": 2}, {"timing": {}})
    assert man["num_rows"] == 2 and not man["complete"] and man["skipped"] == {"bad_json": 2, "x": 1}
    write_manifest(tmp_path, man)
    with pytest.raises(ValueError, match="incomplete"):
        load_distilled(tmp_path)
    ds, _ = load_distilled(tmp_path, allow_incomplete=True)
    assert ds["id"] == ["a", "b"] and ds.features["loss_mask"].feature.dtype == "int8"


def test_refusals_name_the_difference(tmp_path):
    plan = [["a", "b"]]
    write_shard(tmp_path, 0, [ROW], row_features(False, None), stats(plan, 0))
    write_manifest(tmp_path, build_manifest(HEADER, completed_shards(tmp_path), 1, {}, {}))
    assert list(check_compatible(tmp_path, HEADER, plan)) == [0]
    other = {**HEADER, "target": {"tokenizer_hash": "xyz"}}
    with pytest.raises(DistillMismatchError, match=r"target.tokenizer_hash: 'abc' on disk != 'xyz' now"):
        check_compatible(tmp_path, other, plan)
    with pytest.raises(DistillMismatchError, match="other conversations"):
        check_compatible(tmp_path, HEADER, [["a", "z"]])
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(DistillMismatchError, match="not valid JSON"):
        check_compatible(tmp_path, HEADER, plan)
    with pytest.raises(FileNotFoundError, match="run `python distill.py`"):
        load_distilled(tmp_path / "missing")
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99"):
        load_distilled(tmp_path)


def test_num_samples_is_not_part_of_the_settings_and_old_shards_resume(tmp_path):
    plan = [["a", "b"]]
    limited = {**HEADER, "data": {"source": "x", "num_samples": 2}}
    assert settings_hash(limited) == settings_hash({**limited, "data": {"source": "x", "num_samples": 9}})
    assert settings_hash(limited, with_limit=True) != settings_hash(limited)
    old_stats = {**stats(plan, 0), "settings_hash": settings_hash(limited, with_limit=True)}  # format-1 shard
    write_shard(tmp_path, 0, [ROW], row_features(False, None), old_stats)
    write_manifest(tmp_path, build_manifest(limited, completed_shards(tmp_path), 1, {}, {}))
    grown = {**limited, "data": {"source": "x", "num_samples": 4}}
    assert list(check_compatible(tmp_path, grown, plan + [["c", "d"]])) == [0]
    assert completed_shards(tmp_path)[0]["settings_hash"] == settings_hash(grown)  # migrated on disk
    write_manifest(tmp_path, build_manifest(grown, completed_shards(tmp_path), 2, {}, {}))  # the new limit
    assert list(check_compatible(tmp_path, {**grown, "data": {"source": "x", "num_samples": 6}}, plan)) == [0]
    with pytest.raises(DistillMismatchError, match="data.source: 'x' on disk != 'y' now"):
        check_compatible(tmp_path, {**grown, "data": {"source": "y", "num_samples": 4}}, plan)
