"""`distill(cfg)` on bad input (issue 22): it refuses before writing anything, never leaves an empty dataset
behind silently, and a damaged shard is named by the training loader and redone by a rerun."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdraft.conf.schema import register_configs
from specdraft.distill.run import distill
from specdraft.distill.shards import ShardDamagedError, load_distilled
from specdraft.testing import write_train_assets

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny target folder and 6 one-exchange conversations (`specdraft.testing.write_train_assets`)."""
    return write_train_assets(tmp_path_factory.mktemp("distill_errors"), num_convs=6)


def make_cfg(assets: Path, out: Path, source: Path | None = None, *extra: str):
    """The real config pointed at the tiny target, shrunk to seconds (3 shards of 2 conversations)."""
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[
            f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
            f"data.source={source or assets / 'convs.jsonl'}", "data.num_samples=null", "data.max_length=96",
            f"distill.out_dir={out}", "distill.num_samples=null", "distill.max_new_tokens=4",
            "distill.shard_size=2", *extra,
        ])  # fmt: skip


@pytest.mark.parametrize(
    "content", ["", "\n\n", '{"conversations": [{"from": "alien", "value": "x"}]}\n{oops\n']
)
def test_empty_or_invalid_source_is_refused_before_writing(assets, tmp_path, content) -> None:
    src = tmp_path / "src.jsonl"
    src.write_text(content)
    with pytest.raises(ValueError, match=r"data\.source=.*src\.jsonl.*no usable conversation") as e:
        distill(make_cfg(assets, tmp_path / "d", src))
    assert ("read 2 records, skipped all" if content.strip("\n") else "no records") in str(e.value)
    assert not (tmp_path / "d").exists()


def test_missing_source_and_non_positive_num_samples(assets, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.source=.*nope/convs\.jsonl' does not exist"):
        distill(make_cfg(assets, tmp_path / "d", tmp_path / "nope" / "convs.jsonl"))
    cfg = make_cfg(assets, tmp_path / "d")
    cfg.distill.num_samples = -1
    with pytest.raises(ValueError, match=r"distill\.num_samples=-1\b"):
        distill(cfg)
    cfg.distill.num_samples, cfg.data.num_samples = None, 0
    with pytest.raises(ValueError, match=r"data\.num_samples=0\b"):
        distill(cfg)
    assert not (tmp_path / "d").exists()


def test_zero_rows_is_an_error(assets, tmp_path) -> None:
    """Every conversation skipped (the prompt alone exceeds data.max_length): not a silent empty dataset."""
    with pytest.raises(ValueError, match=r"distill made 0 rows from the 6 conversations.*prompt_too_long=6"):
        distill(make_cfg(assets, tmp_path / "d", None, "data.max_length=8"))


def test_truncated_shard_named_by_loader_and_redone_by_rerun(assets, tmp_path, caplog) -> None:
    out = distill(make_cfg(assets, tmp_path / "d"))
    rows = load_distilled(out)[0].to_list()
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert len(stamps) == 3 and all(
        "files" in json.loads((p / "stats.json").read_text()) for p in out.glob("shard-*")
    )
    (arrow,) = (out / "shard-00001").glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:-100])  # e.g. a copy cut short by a full disk

    with pytest.raises(ShardDamagedError) as e:
        load_distilled(out)
    msg = str(e.value)
    assert "\n" not in msg and "shard-00001" in msg and "truncated" in msg
    assert "rerun `python distill.py conf=<preset>`" in msg

    with caplog.at_level(logging.WARNING):
        distill(make_cfg(assets, tmp_path / "d"))  # the rerun redoes the damaged shard only
    assert "shard-00001" in caplog.text and "truncated" in caplog.text
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert after["shard-00000"] == stamps["shard-00000"] and after["shard-00002"] == stamps["shard-00002"]
    assert after["shard-00001"] != stamps["shard-00001"]
    ds, man = load_distilled(out)
    assert man["complete"] and ds.to_list() == rows  # greedy: the redone shard is the same data
