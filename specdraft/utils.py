"""Small shared helpers: atomic writes, hashing, ranks, seeding."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder + `os.replace` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Atomically write UTF-8 text to `path`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write `obj` as indented JSON to `path`."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def atomic_dir(path: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it is renamed to `path` in one step.

    On an exception (or a kill) the temp folder is left behind with a `.tmp-` prefix and `path` is
    untouched; `clean_stale_tmp(parent)` removes such leftovers.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the usual folder mode
    try:
        yield tmp
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"{path} already exists")
            old = path.with_name(f".old-{path.name}-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clean_stale_tmp(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove `.tmp-*` / `.old-*` leftovers of interrupted `atomic_dir`/`atomic_write_*` calls."""
    removed: list[Path] = []
    parent = Path(parent)
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        if p.name.startswith((".tmp-", ".old-")) or (p.name.startswith(".") and p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def cache_root() -> Path:
    """specdraft's cache folder: `$SPECDRAFT_CACHE`, else ~/.cache/specdraft (dequantised targets, cost curves,
    compiled kernels)."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def sha256_text(text: str) -> str:
    """Hex SHA-256 of a string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def env_rank() -> int:
    """Global rank from the launcher's environment (0 when not distributed)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_hydra_on_nonzero_rank() -> None:
    """Under `accelerate launch` every rank runs `@hydra.main`; keep Hydra's files and logs on rank 0.

    Call from an entry point before `main()`: on ranks > 0 it appends overrides that disable Hydra's
    output subdir and job logging, so ranks never race on `.hydra/` or the log file.
    """
    if env_rank() > 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


# Hub ids are `owner/name`: one slash, ASCII letters, digits, `_`, `-`, `.` (not first or last), at most 96
# characters each side (huggingface_hub's own rule, minus its unicode and owner-less forms).
_HUB_ID_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_HUB_ID_PART}/{_HUB_ID_PART}")
# Names ending like this are files, never Hub repos.
LOCAL_FILE_SUFFIXES = (".json", ".jsonl", ".gguf", ".safetensors", ".bin", ".parquet", ".arrow", ".csv")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def is_hub_id(value: str) -> bool:
    """True when `value` is a syntactically valid Hugging Face Hub repo id `owner/name` that does not look
    like a local path: exactly one `/`, Hub characters only, no leading `/`, `./`, `../` or `~`, no `--`/`..`,
    and no file extension such as `.json`, `.jsonl`, `.gguf` or `.safetensors`."""
    return (
        _HUB_ID.fullmatch(value) is not None
        and ".." not in value
        and "--" not in value
        and not value.lower().endswith((*LOCAL_FILE_SUFFIXES, ".git"))
    )


def local_or_hub(value: str, field: str, expect: str = "folder or file") -> str:
    """`value` unchanged when it exists on disk or is a Hub id (`is_hub_id`); a missing local path is refused.

    Args:
        value: what the user gave (a path or a Hub id).
        field: the config field it came from, for the message (e.g. `data.source`).
        expect: what a local `value` should be, for the message (e.g. `.jsonl file`).

    Raises:
        FileNotFoundError: `value` does not exist and cannot be a Hub id; the message names `field`.
    """
    if Path(value).exists() or is_hub_id(value):
        return value
    tilde = " (`~` is not expanded: give the full path)" if value.startswith("~") else ""
    raise FileNotFoundError(
        f"{field}={value!r} does not exist{tilde}; give an existing {expect} or a Hub id owner/name"
    )


@contextmanager
def hub_errors(field: str, value: str) -> Iterator[None]:
    """Around loading `value`: when it is a Hub id rather than a local path, a Hub client's error (repo or file
    not found, not in the local cache while offline, no connection; all `OSError`s) becomes one
    FileNotFoundError naming `field` and what to do. Errors while loading a local path pass unchanged."""
    try:
        yield
    except OSError as e:
        if Path(value).exists() or not is_hub_id(value):
            raise
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
        offline = [
            v for v in _OFFLINE_VARS if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        ]
        if offline:
            raise FileNotFoundError(
                f"{field}={value!r} is not a local path, and the Hub repo {value} is not in the local Hugging Face "
                f"cache while {offline[0]}=1: give a local path, or unset {offline[0]} to download it"
            ) from e
        raise FileNotFoundError(
            f"{field}={value!r} is not a local path, and the Hub repo {value} cannot be loaded ({why}); check the "
            "id, your connection and HF_TOKEN (gated repos), or give a local path"
        ) from e


def check_safetensors(folder: str | os.PathLike[str], what: str, fix: str) -> None:
    """Refuse a truncated or corrupt `*.safetensors` file in `folder` before a loader trips over it.

    Opening a file reads only its header, which must cover the file exactly, so a cut-off file fails here in
    milliseconds (a same-size corruption of the tensor bytes is not detected).

    Args:
        folder: the folder holding the weights.
        what: what the folder is, for the message (e.g. `drafter export`).
        fix: what the user should do (e.g. `re-export it`).

    Raises:
        ValueError: one line naming the bad file, the reason and `fix`.
    """
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{what}: {path} is truncated or corrupt ({reason}); {fix}") from e
