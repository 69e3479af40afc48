"""Bad inputs give one clear error naming the field, the path and what to do (issue 22): missing local paths
that look like Hub ids, Hub ids not cached while offline, empty or nonsensical data, non-positive sample
limits, truncated safetensors and damaged distilled shards."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specdraft.conf.schema import BaseModelConfig
from specdraft.data.benchmarks import load_benchmark
from specdraft.data.conversations import load_conversations
from specdraft.distill.shards import (
    ShardDamagedError,
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
from specdraft.models import base_llm, redrafter
from specdraft.models.base_llm import dequantized_gguf_dir, load_target, target_fingerprint
from specdraft.models.hub import export_drafter, load_drafter
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.utils import hub_errors, is_hub_id

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
MISSING_LOCAL = [
    "/nonexistent/dir/convs.jsonl",
    "./missing/thing",
    "../missing/thing",
    "~/missing",
    "a/b/c",
    "data/convs.jsonl",
    "owner/model.gguf",
    "weights/model.safetensors",
    "bad name/x",
]


def one_line(e: pytest.ExceptionInfo) -> str:
    """The exception's message, checked to be one line."""
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "value, ok",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("anon8231489123/ShareGPT_Vicuna_unfiltered", True),
        ("smollm2-135m", False),  # no owner: never sent to the Hub
        *[(p, False) for p in MISSING_LOCAL],
        ("owner/-name", False),
        ("a--b/c", False),
        ("a/b..c", False),
    ],
)
def test_is_hub_id(value: str, ok: bool) -> None:
    assert is_hub_id(value) is ok


@pytest.mark.parametrize("source", MISSING_LOCAL)
def test_missing_local_data_source_is_file_not_found(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_conversations(source)
    assert f"data.source={source!r} does not exist" in one_line(e)


def test_hub_id_not_cached_offline_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_conversations("nobody-specdraft/no-such-dataset")
    msg = one_line(e)
    assert "data.source='nobody-specdraft/no-such-dataset'" in msg and "HF_HUB_OFFLINE" in msg
    assert "local path" in msg
    with pytest.raises(FileNotFoundError) as e:
        load_benchmark("nobody-specdraft/no-such-bench")
    assert "eval.benches='nobody-specdraft/no-such-bench'" in one_line(e)


def test_hub_errors_online_and_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FileNotFoundError) as e, hub_errors("x.y", "owner/name"):
        raise OSError("404 Repository Not Found\nlots of detail\nmore")
    assert "x.y='owner/name' is not a local path" in one_line(e) and "404 Repository Not Found" in str(
        e.value
    )
    (tmp_path / "here").mkdir()
    with pytest.raises(OSError, match="disk"), hub_errors("x.y", str(tmp_path / "here")):
        raise OSError("disk")  # a local path's own error passes unchanged


def test_missing_benchmark_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        load_benchmark(str(tmp_path / "bench" / "mine.jsonl"))
    assert "eval.benches=" in one_line(e) and "does not exist" in str(e.value)


def test_empty_and_all_invalid_sources_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError) as e:
        load_conversations(str(empty))
    msg = one_line(e)
    assert "empty.jsonl" in msg and "no usable conversation" in msg and "no records" in msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}) + "\n{not json\n"
        + json.dumps({"conversations": []}) + "\n"
    )  # fmt: skip
    with pytest.raises(ValueError) as e:
        load_conversations(str(bad))
    msg = one_line(e)
    assert "bad.jsonl" in msg and "read 3 records, skipped all" in msg
    assert "empty_conversation=1" in msg and "invalid_json_line=1" in msg and "unknown_role=1" in msg


@pytest.mark.parametrize("limit", [0, -1])
def test_non_positive_num_samples_is_refused(tmp_path: Path, limit: int) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=rf"data\.num_samples={limit} must be > 0"):
        load_conversations(str(src), limit=limit)
    with pytest.raises(ValueError, match=rf"distill\.num_samples={limit} must be > 0"):
        load_conversations(str(src), limit=limit, limit_field="distill.num_samples")


# ---- base model -------------------------------------------------------------------------------------------


def target_cfg(name: str) -> BaseModelConfig:
    return BaseModelConfig(name_or_path=name, dtype="fp32", device="cpu")


@pytest.mark.parametrize("name", ["./models/my-llama", "/nonexistent/models/llama", "ckpts/llama/final"])
def test_missing_target_path_is_file_not_found(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_target(target_cfg(name))
    assert f"base_model.name_or_path={name!r} does not exist" in one_line(e)


def test_target_hub_id_not_cached_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_target(target_cfg("nobody-specdraft/no-such-model"))
    msg = one_line(e)
    assert "base_model.name_or_path='nobody-specdraft/no-such-model'" in msg and "HF_HUB_OFFLINE" in msg


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


def test_truncated_target_weights_name_the_file(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    truncate(tmp_path / "t" / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_target(target_cfg(str(tmp_path / "t")))
    assert f"{tmp_path / 't' / 'model.safetensors'} is truncated or corrupt" in one_line(e)


def test_truncated_dequantised_cache_is_rebuilt(tmp_path: Path, monkeypatch, caplog) -> None:
    """A cut-off model.safetensors in the GGUF cache is rebuilt after a warning (the GGUF load is stubbed)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"stand-in for a GGUF file")
    built: list[int] = []

    def fake_model(*a, **k):
        built.append(1)
        return tiny_llama()

    monkeypatch.setattr(base_llm.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(base_llm.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    out, _ = dequantized_gguf_dir(gguf, str(tmp_path / "cache"))
    assert dequantized_gguf_dir(gguf, str(tmp_path / "cache"))[0] == out and len(built) == 1  # cached
    truncate(out / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert dequantized_gguf_dir(gguf, str(tmp_path / "cache"))[0] == out
    assert len(built) == 2 and "model.safetensors is truncated or corrupt" in caplog.text
    assert "rebuilding it" in caplog.text
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # whole again
        assert len(list(f.keys())) > 0


# ---- drafter exports ----------------------------------------------------------------------------------------


def test_missing_drafter_export_and_offline_hub_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_drafter("outputs/run/export", field="eval.drafters")
    assert "eval.drafters='outputs/run/export' does not exist" in one_line(e)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_drafter("nobody-specdraft/no-such-drafter")
    assert "drafter='nobody-specdraft/no-such-drafter'" in one_line(e) and "HF_HUB_OFFLINE" in str(e.value)


def test_truncated_drafter_export_names_the_file(tmp_path: Path) -> None:
    target, tok = tiny_llama(), tiny_tokenizer()
    schema = {"draft_len": 2, "num_layers": 1, "rnn": True, "share_embeddings": True, "beam_width": 2,
              "init_from_lm_head": True}  # fmt: skip
    model = redrafter.build(OmegaConf.create(schema), target, target_fingerprint(target, tok))
    out = export_drafter(model, tmp_path / "export")
    truncate(out / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_drafter(str(out), field="eval.drafters")
    msg = one_line(e)
    assert f"{out / 'model.safetensors'} is truncated or corrupt" in msg and "re-export" in msg


# ---- distilled shards ---------------------------------------------------------------------------------------

HEADER = {"format_version": 1, "target": {"tokenizer_hash": "abc"}, "generation": {"max_new_tokens": 8}, "T": 5,
          "data": {}, "features": None, "shard_size": 2}  # fmt: skip
ROW = {
    "id": "a",
    "input_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "response_lengths": [2],
    "finish_reasons": ["eos"],
}
PLAN = [["a", "b"], ["c", "d"]]


def write_dataset(root: Path) -> None:
    """Two complete shards of two rows and their manifest."""
    for i, ids in enumerate(PLAN):
        stats = {"settings_hash": settings_hash(HEADER), "ids_digest": ids_digest(ids)}
        write_shard(root, i, [{**ROW, "id": x} for x in ids], row_features(False, None), stats)
    write_manifest(root, build_manifest(HEADER, completed_shards(root), len(PLAN), {}, {}))


def arrow_file(root: Path, shard: str) -> Path:
    (path,) = (root / shard).glob("*.arrow")
    return path


def test_shards_record_rows_and_checksums(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    stats = json.loads((tmp_path / "shard-00001" / "stats.json").read_text())
    (name, rec), = stats["files"].items()  # fmt: skip
    assert stats["rows"] == 2 and rec["bytes"] == arrow_file(tmp_path, "shard-00001").stat().st_size
    assert name.endswith(".arrow") and len(rec["crc32"]) == 8


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_shard_refused_by_loader_and_redone_on_resume(tmp_path: Path, damage: str, caplog) -> None:
    write_dataset(tmp_path)
    arrow = arrow_file(tmp_path, "shard-00001")
    if damage == "truncate":
        truncate(arrow)
    elif damage == "flip":  # same size, one byte changed near the end (inside the data)
        data = bytearray(arrow.read_bytes())
        data[-20] ^= 0xFF
        arrow.write_bytes(bytes(data))
    else:
        arrow.unlink()
    with pytest.raises(ShardDamagedError) as e:
        load_distilled(tmp_path)
    msg = one_line(e)
    assert "shard-00001" in msg and "rerun `python distill.py conf=<preset>`" in msg
    assert {"truncate": "truncated", "flip": "checksum", "delete": "missing"}[damage] in msg
    with caplog.at_level(logging.WARNING):
        done = check_compatible(tmp_path, HEADER, PLAN)
    assert list(done) == [0] and not (tmp_path / "shard-00001").exists()  # deleted, to be redone
    assert "shard-00001" in caplog.text and (tmp_path / "shard-00000").is_dir()


def test_unreadable_stats_and_row_count(tmp_path: Path, caplog) -> None:
    write_dataset(tmp_path)
    (tmp_path / "shard-00000" / "stats.json").write_text('{"index": 0, "ro')
    with pytest.raises(ShardDamagedError, match=r"shard-00000: stats.json is not valid JSON"):
        load_distilled(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert list(check_compatible(tmp_path, HEADER, PLAN)) == [1]
    assert "shard-00000" in caplog.text and not (tmp_path / "shard-00000").exists()
    man = json.loads((tmp_path / "manifest.json").read_text())
    man["shards"] = [{"name": "shard-00001", "rows": 3}]  # more rows than the shard holds
    write_manifest(tmp_path, man)
    with pytest.raises(ShardDamagedError, match=r"shard-00001: holds 2 rows, 3 recorded"):
        load_distilled(tmp_path, allow_incomplete=True)


def test_dataset_without_checksums_still_loads(tmp_path: Path) -> None:
    """Shards written before checksums were recorded: verified on what they record (the row count)."""
    write_dataset(tmp_path)
    for shard in ("shard-00000", "shard-00001"):
        path = tmp_path / shard / "stats.json"
        stats = json.loads(path.read_text())
        del stats["files"]
        path.write_text(json.dumps(stats))
    ds, _ = load_distilled(tmp_path)
    assert ds["id"] == ["a", "b", "c", "d"]
    assert list(check_compatible(tmp_path, HEADER, PLAN)) == [0, 1]
    truncate(arrow_file(tmp_path, "shard-00001"))  # no checksum, but Arrow itself cannot read it
    with pytest.raises(ShardDamagedError, match="shard-00001: cannot be read"):
        load_distilled(tmp_path)


def test_loader_messages_name_real_config_keys(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train\.data_dir"):
        load_distilled(tmp_path / "missing")
    write_dataset(tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    write_manifest(tmp_path, {**man, "complete": False})
    with pytest.raises(ValueError, match=r"train\.allow_incomplete_data=true"):
        load_distilled(tmp_path)
