"""Small shared helpers: atomic writes, hashing, ranks, seeding."""

from __future__ import annotations

import hashlib
import json
import os
import random
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
