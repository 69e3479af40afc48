"""The distilled dataset on disk: atomic shards, a manifest, resume, and the loader the training stage uses.

    <out_dir>/manifest.json     # rewritten (atomically) after every shard; `complete` once all are done
    <out_dir>/shard-00000/      # `Dataset.save_to_disk` + stats.json, renamed into place in one step

Shard i always holds conversations [i*shard_size, (i+1)*shard_size) of the planned list, whichever rank
wrote it, so a shard folder that exists is complete and final: resuming skips it (no duplicates), and a
half-written shard is only ever a `.tmp-*` folder that is cleaned up. Each shard's stats.json carries the
settings hash and the digest of its conversation ids, so the manifest can always be rebuilt from the shards.

Each stats.json also records the shard's row count and the size and CRC-32 of each of its Arrow data files.
`verify_shard` checks them when a run resumes (a damaged shard, e.g. truncated by a full disk or an
interrupted copy, is reported, deleted and redone) and when training loads the dataset (it refuses, naming
the shard). Sizes are compared first, so a truncated file fails without being read; the checksum then reads
every data file once (zlib's CRC-32, about 2 GB/s: seconds for a multi-GB dataset, next to minutes of
training). Shards written before checksums were recorded are checked on their row count only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from specdraft.utils import atomic_dir, atomic_write_json, sha256_text

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATS = "stats.json"
# Parts of the manifest that decide the content: a re-run must match them exactly to resume. The one
# exception is `data.num_samples`: growing it appends shards (each shard's conversation ids are checked).
COMPAT_KEYS = ("format_version", "target", "generation", "T", "data", "features", "shard_size")


class DistillMismatchError(ValueError):
    """An existing dataset folder was made with a different target, tokenizer or settings."""


class ShardDamagedError(ValueError):
    """A shard folder whose data does not match what its stats.json records (truncated, damaged, missing)."""


def shard_name(index: int) -> str:
    """Folder name of shard `index`."""
    return f"shard-{index:05d}"


def ids_digest(ids: list[str]) -> str:
    """Short hash of an ordered list of conversation ids."""
    return sha256_text("\n".join(ids))[:16]


def compat_view(header: dict[str, Any], with_limit: bool = False) -> dict[str, Any]:
    """The content-deciding part of a manifest header; `data.num_samples` only when `with_limit`."""
    view = {k: header.get(k) for k in COMPAT_KEYS}
    data = view.get("data")
    if not with_limit and isinstance(data, dict):
        view["data"] = {k: v for k, v in data.items() if k != "num_samples"}
    return view


def settings_hash(header: dict[str, Any], with_limit: bool = False) -> str:
    """Hash of `compat_view(header)`; `with_limit=True` gives the format-1 hash that included num_samples."""
    return sha256_text(json.dumps(compat_view(header, with_limit), sort_keys=True, default=str))[:16]


def row_features(continuations: bool, feature_spec: dict[str, Any] | None) -> datasets.Features:
    """The Arrow schema of a shard (every shard of a run has the same one, even when empty)."""
    ints = datasets.List(datasets.Value("int32"))
    cols: dict[str, Any] = {
        "id": datasets.Value("string"),
        "input_ids": ints,
        "loss_mask": datasets.List(datasets.Value("int8")),
        "response_lengths": ints,
        "finish_reasons": datasets.List(datasets.Value("string")),
    }
    if continuations:
        cols["continuations"] = datasets.List(ints)
    spec = feature_spec or {}
    if spec.get("hidden"):
        cols["hidden"] = datasets.Value("binary")
    if spec.get("layers"):
        cols["hidden_layers"] = datasets.List(datasets.Value("binary"))
    if spec.get("topk"):
        cols["topk_ids"] = datasets.List(ints)
        cols["topk_logprobs"] = datasets.Value("binary")
    return datasets.Features(cols)


def write_shard(
    out_dir: Path, index: int, rows: list[dict[str, Any]], features: datasets.Features, stats: dict[str, Any]
) -> Path:
    """Write shard `index` atomically: a temp folder with the Arrow data + stats.json, then one rename."""
    path = Path(out_dir) / shard_name(index)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per shard would drown the run's own progress bar
    try:
        with atomic_dir(path) as tmp:
            ds = datasets.Dataset.from_list(rows, features=features) if rows else features_empty(features)
            ds.save_to_disk(str(tmp))
            record = {**stats, "index": index, "rows": len(rows), "files": data_checksums(tmp)}
            atomic_write_json(tmp / STATS, record)
    finally:
        if bars:
            datasets.enable_progress_bars()
    return path


def features_empty(features: datasets.Features) -> datasets.Dataset:
    """A zero-row dataset with the given schema."""
    return datasets.Dataset.from_dict({k: [] for k in features}, features=features)


def _crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def data_checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """{file name: {"bytes": size, "crc32": hex}} of the Arrow data files of a shard folder."""
    return {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in sorted(Path(folder).glob("*.arrow"))
    }


def verify_shard(folder: Path, stats: dict[str, Any]) -> datasets.Dataset:
    """Open a shard, checking it against what its stats record (see the module docstring for the cost).

    Args:
        folder: the shard folder.
        stats: its stats.json (`files`: size and CRC-32 per data file; `rows`); what is not recorded is not
            checked, so shards written before checksums existed still load.

    Returns:
        the shard's rows as a (memory-mapped) Dataset.

    Raises:
        ShardDamagedError: naming the folder and what differs.
    """
    folder = Path(folder)
    files: dict[str, dict[str, Any]] = stats.get("files") or {}
    for name, want in files.items():  # sizes first: a truncated file fails without being read
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size is None:
            raise ShardDamagedError(f"{folder}: data file {name} is missing")
        if size != want["bytes"]:
            raise ShardDamagedError(
                f"{folder}: {name} has {size} bytes, {want['bytes']} recorded (truncated?)"
            )
    for name, want in files.items():
        if (crc := _crc32(folder / name)) != want["crc32"]:
            raise ShardDamagedError(
                f"{folder}: {name} has checksum {crc}, {want['crc32']} recorded (damaged)"
            )
    try:
        ds = datasets.load_from_disk(str(folder))
    except (OSError, ValueError, pa.ArrowException) as e:
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise ShardDamagedError(f"{folder}: cannot be read ({type(e).__name__}: {why})") from e
    if "rows" in stats and len(ds) != int(stats["rows"]):
        raise ShardDamagedError(f"{folder}: holds {len(ds)} rows, {stats['rows']} recorded")
    return ds


def _read_stats(folder: Path) -> dict[str, Any]:
    """A shard's stats.json ({} when it has none); ShardDamagedError when it is not valid JSON."""
    path = folder / STATS
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardDamagedError(f"{folder}: {STATS} is not valid JSON ({e})") from e


def _discard(folder: Path) -> None:
    """Delete a damaged shard: moved aside in one step first, so other ranks see all of it or none."""
    aside = folder.with_name(f".old-{folder.name}-{os.getpid()}")
    try:
        os.replace(folder, aside)
    except FileNotFoundError:  # another rank got there first
        return
    shutil.rmtree(aside, ignore_errors=True)


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of `out_dir`, or None when there is none yet."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DistillMismatchError(f"{path} is not valid JSON ({e}); delete {out_dir} to start over") from e


def completed_shards(out_dir: Path) -> dict[int, dict[str, Any]]:
    """index -> stats of every complete shard folder (read-only; in-progress `.tmp-*` folders are not shards).

    The stats are trusted as they are (`check_compatible` verifies the data); a stats.json that is not valid
    JSON gives `{"index": i, "damaged": why}`.
    """
    out_dir = Path(out_dir)
    done: dict[int, dict[str, Any]] = {}
    for p in sorted(out_dir.glob("shard-*")):
        if not (p.is_dir() and (p / STATS).is_file()):
            continue
        try:
            s = _read_stats(p)
        except ShardDamagedError as e:
            s = {"index": int(p.name.removeprefix("shard-")), "damaged": str(e)}
        done[int(s["index"])] = s
    return done


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"  {prefix.rstrip('.')}: {old!r} on disk != {new!r} now"]


def check_compatible(
    out_dir: Path, header: dict[str, Any], plan: list[list[str]]
) -> dict[int, dict[str, Any]]:
    """Refuse to mix data: compare the existing manifest and shards with this run; return the done shards.

    Every done shard is then verified (`verify_shard`); a damaged one is reported by name, deleted (it is
    distill's own output) and left out of the result, so this run redoes it.

    Raises:
        DistillMismatchError: a different target/tokenizer/settings, or shards holding other conversations.
    """
    out_dir = Path(out_dir)
    old = read_manifest(out_dir)
    fix = f"Use a new distill.out_dir, or delete {out_dir} to start over."
    if old is not None:
        lines = _diff(compat_view(old), compat_view(header))
        if lines:
            raise DistillMismatchError(
                f"{out_dir / MANIFEST} was made with a different target/tokenizer/settings:\n"
                + "\n".join(lines)
                + f"\n{fix}"
            )
    done = completed_shards(out_dir)
    current = settings_hash(header)
    want = {current}
    if old is not None:  # shards written before num_samples left the hash: hashed with the old limit
        legacy = {**header, "data": {**(header.get("data") or {}), **(old.get("data") or {})}}
        want.add(settings_hash(legacy, with_limit=True))
    for i, s in sorted(done.items()):
        if "damaged" in s:
            continue  # unreadable stats: nothing to compare, deleted below
        if s.get("settings_hash") not in want:
            raise DistillMismatchError(
                f"{out_dir / shard_name(i)} was made with different settings ({s.get('settings_hash')} not in "
                f"{sorted(want)}). {fix}"
            )
        if s["settings_hash"] != current:  # migrate it before the manifest (the old limit) is rewritten
            s["settings_hash"] = current
            atomic_write_json(out_dir / shard_name(i) / STATS, s)
        if i >= len(plan) or s.get("ids_digest") != ids_digest(plan[i]):
            raise DistillMismatchError(
                f"{out_dir / shard_name(i)} holds other conversations than this run plans for it (data changed?). {fix}"
            )
    good: dict[int, dict[str, Any]] = {}
    for i, s in sorted(done.items()):
        try:
            if "damaged" in s:
                raise ShardDamagedError(s["damaged"])
            verify_shard(out_dir / shard_name(i), s)
            good[i] = s
        except ShardDamagedError as e:
            log.warning("damaged shard %s; deleting it to redo it", e)
            _discard(out_dir / shard_name(i))
    return good


def build_manifest(
    header: dict[str, Any],
    done: dict[int, dict[str, Any]],
    num_shards: int,
    load_skipped: dict[str, int],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The manifest from the static header and the stats of the shards on disk."""
    skipped: dict[str, int] = dict(load_skipped)
    counts: dict[str, int] = {}
    seconds = 0.0
    for s in done.values():
        for k, v in s.get("skipped", {}).items():
            skipped[k] = skipped.get(k, 0) + int(v)
        for k, v in s.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + int(v)
        seconds += float(s.get("seconds", 0.0))
    gen = counts.get("generated_tokens", 0)
    timing = {
        "shard_seconds": round(seconds, 3),
        "generated_tokens_per_s": round(gen / seconds, 2) if seconds else 0.0,
        **extra.get("timing", {}),
    }
    return {
        **header,
        "settings_hash": settings_hash(header),
        "shards": [{"name": shard_name(i), "rows": done[i]["rows"]} for i in sorted(done)],
        "num_shards_planned": num_shards,
        "num_rows": sum(s["rows"] for s in done.values()),
        "skipped": dict(sorted(skipped.items())),
        "counts": dict(sorted(counts.items())),
        "timing": timing,
        "complete": len(done) == num_shards,
        **{k: v for k, v in extra.items() if k != "timing"},
    }


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Atomically (re)write `<out_dir>/manifest.json`."""
    atomic_write_json(Path(out_dir) / MANIFEST, manifest)


def load_distilled(
    path: str | Path, allow_incomplete: bool = False
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Load a distilled dataset folder for training, verifying every shard (`verify_shard`).

    Args:
        path: the folder `distill` wrote (holds manifest.json and shard-* folders).
        allow_incomplete: accept a run that has not finished (its complete shards only).

    Returns:
        (dataset with one row per conversation, in shard order; the manifest dict).

    Raises:
        FileNotFoundError: no manifest.json in `path`.
        ShardDamagedError: a shard is missing, truncated or damaged (the message names it and how to redo it).
        ValueError: another format version, or an incomplete dataset without `allow_incomplete`.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise FileNotFoundError(
            f"{path / MANIFEST} not found: run `python distill.py` first (or fix train.data_dir)"
        )
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path / MANIFEST}: format_version={manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if not manifest.get("complete") and not allow_incomplete:
        raise ValueError(
            f"{path} is incomplete ({len(manifest['shards'])}/{manifest.get('num_shards_planned')} shards); re-run distill "
            "to finish it, or set train.allow_incomplete_data=true"
        )
    parts = []
    for s in manifest["shards"]:
        if s["rows"] > 0:
            folder = path / s["name"]
            try:
                if not folder.is_dir():
                    raise ShardDamagedError(f"{folder}: shard folder is missing")
                parts.append(verify_shard(folder, {**_read_stats(folder), "rows": s["rows"]}))
            except ShardDamagedError as e:
                raise ShardDamagedError(
                    f"damaged distilled shard {e}; rerun `python distill.py conf=<preset>` with the settings that "
                    f"made {path} to redo it"
                ) from e
    if not parts:
        return features_empty(
            row_features("continuations" in manifest.get("columns", []), manifest.get("features"))
        ), manifest
    return datasets.concatenate_datasets(parts), manifest
