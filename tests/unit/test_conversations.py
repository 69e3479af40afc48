"""Conversation loading: ShareGPT/OpenAI shapes, malformed rows counted by reason, bad files fail fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.data.conversations import load_conversations, normalise_row, split_conversations, split_indices

GOOD_SHAREGPT = {
    "id": "a",
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
}
GOOD_OPENAI = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
MALFORMED = [
    ({"conversations": [{"value": "no role"}, {"from": "gpt", "value": "x"}]}, "missing_role"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}, "non_string_content"),
    ({"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]}, "unknown_role"),
    ({"conversations": []}, "empty_conversation"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_user_assistant_exchange"),
]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_normalise_sharegpt_and_openai() -> None:
    conv, why = normalise_row(GOOD_SHAREGPT, 0)
    assert why is None and conv is not None
    assert conv.id == "a"
    assert conv.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    conv, _ = normalise_row(GOOD_OPENAI, 7)
    assert conv is not None and conv.id == "7"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]


def test_leading_assistant_turn_is_dropped() -> None:
    row = {"conversations": [{"from": "gpt", "value": "hi!"}, *GOOD_SHAREGPT["conversations"]]}
    conv, _ = normalise_row(row, 0)
    assert conv is not None and conv.messages[0]["role"] == "user"


@pytest.mark.parametrize(("row", "reason"), MALFORMED)
def test_each_malformed_row_reason(row: dict, reason: str) -> None:
    conv, why = normalise_row(row, 0)
    assert conv is None and why == reason


def test_five_malformed_rows_among_good_ones_are_skipped_and_counted(tmp_path: Path) -> None:
    rows = [
        GOOD_SHAREGPT,
        MALFORMED[0][0],
        GOOD_OPENAI,
        MALFORMED[1][0],
        MALFORMED[2][0],
        GOOD_SHAREGPT,
        MALFORMED[3][0],
        MALFORMED[4][0],
    ]
    convs, report = load_conversations(str(_write_jsonl(tmp_path / "mixed.jsonl", rows)))
    assert len(convs) == 3
    assert report.total == 5
    assert dict(report.reasons) == {r: 1 for _, r in MALFORMED}
    assert "kept 3" in report.summary() and "skipped 5" in report.summary()


def test_json_array_and_truncated_tail(tmp_path: Path) -> None:
    text = json.dumps([GOOD_SHAREGPT, GOOD_OPENAI])
    (tmp_path / "ok.json").write_text(text)
    convs, report = load_conversations(str(tmp_path / "ok.json"))
    assert len(convs) == 2 and report.total == 0
    (tmp_path / "cut.json").write_text(text[:-20])  # cut inside the second record, like the packaged ShareGPT
    convs, report = load_conversations(str(tmp_path / "cut.json"))
    assert len(convs) == 1 and report.reasons["truncated_tail"] == 1


def test_wrong_shape_file_fails_at_once_naming_the_file(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "x", "output": "y"}] * 60)
    with pytest.raises(ValueError, match=r"alpaca\.jsonl.*conversations"):
        load_conversations(str(path))
    (tmp_path / "obj.json").write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match=r"obj\.json: expected a JSON list"):
        load_conversations(str(tmp_path / "obj.json"))
    with pytest.raises(FileNotFoundError, match=r"data.source=.*does not exist"):
        load_conversations("no_such_file_or_dataset")


def test_limit_and_deterministic_split(tmp_path: Path) -> None:
    rows = [{**GOOD_SHAREGPT, "id": str(i)} for i in range(40)]
    convs, _ = load_conversations(str(_write_jsonl(tmp_path / "d.jsonl", rows)), limit=20)
    assert [c.id for c in convs] == [str(i) for i in range(20)]
    a = split_conversations(convs, 0.25, seed=1)
    b = split_conversations(convs, 0.25, seed=1)
    c = split_conversations(convs, 0.25, seed=2)
    assert [x.id for x in a[1]] == [x.id for x in b[1]] == ["7", "11"] and len(a[0]) == 18  # by id hash
    assert [x.id for x in a[1]] != [x.id for x in c[1]]
    assert not {x.id for x in a[0]} & {x.id for x in a[1]}


def test_split_is_stable_as_the_data_grows() -> None:
    ids = [f"conv-{i}" for i in range(4000)]
    train, val = split_indices(ids, 0.05, seed=0)
    assert 150 <= len(val) <= 250 and sorted(train + val) == list(range(4000))  # ~5 %
    small_train, small_val = split_indices(ids[:1000], 0.05, seed=0)
    assert small_val == [i for i in val if i < 1000] and small_train == [i for i in train if i < 1000]
    rep = ["a", "b", "a", "c", "a"] * 20
    for seed in range(20):  # rows sharing an id (turns of one conversation) always land in the same split
        val_rows = set(split_indices(rep, 0.3, seed)[1])
        held = {rep[i] for i in val_rows}
        assert all((x in held) == (i in val_rows) for i, x in enumerate(rep))
    assert split_indices(["x", "y"], 1e-9, seed=0)[1] != []  # at least one held-out row
    assert split_indices(["x", "y"], 0.0, seed=0) == ([0, 1], [])
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        split_indices(ids, 1.0, seed=0)
