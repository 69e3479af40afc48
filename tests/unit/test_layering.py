"""Dependencies point down: every `specdraft.*` import in a package (module level or inside a function) names a
package that package may use. data/ imports none of ours, models/ only data/, distill/ and eval/ never train/,
and conf/ only the stages' `config` modules (plus the family registry it checks drafter settings with)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {  # package -> the packages of ours it may import (besides itself and the specdraft core)
    "data": set(),
    "models": {"data"},
    "distill": {"data", "models", "conf"},
    "eval": {"data", "models", "conf"},
    "train": {"data", "models", "distill", "eval", "conf"},
}
CONF_MAY_IMPORT = {"data", "models.registry", "distill.config", "eval.config", "train.config"}
PACKAGES = {"data", "models", "distill", "train", "eval", "conf"}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module after `specdraft.`) for every `specdraft.<package>...` import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from specdraft import models` names the package in the imported names; otherwise the module does
            names = (
                [f"specdraft.{a.name}" for a in node.names] if node.module == "specdraft" else [node.module]
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "specdraft" and len(parts) > 1 and parts[1] in PACKAGES:
                out.append((node.lineno, ".".join(parts[1:])))
    return out


def violations(package: str) -> list[str]:
    """Every import of `package`'s files that the rules above forbid, as 'file:line imports module'."""
    bad = []
    for path in sorted((ROOT / package).glob("*.py")):
        for line, mod in imported(path):
            top = mod.split(".")[0]
            if top == package:
                continue
            if package == "conf":
                ok = any(mod == m or mod.startswith(m + ".") for m in CONF_MAY_IMPORT)
            else:
                ok = top in ALLOWED[package]
            if not ok:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports specdraft.{mod}")
    return sorted(set(bad))


@pytest.mark.parametrize("package", sorted(ALLOWED) + ["conf"])
def test_imports_point_down(package: str) -> None:
    assert violations(package) == []


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    """A function-level import counts as much as a module-level one (lazy imports were how data/ reached up)."""
    src = tmp_path / "x.py"
    src.write_text(
        "from specdraft.data.ngrams import NgramIndex\n"
        "def f():\n"
        "    from specdraft.distill.shards import load_distilled\n"
        "    import specdraft.models.hub\n"
        "    from specdraft import train, utils\n"
    )
    assert imported(src) == [(1, "data.ngrams"), (3, "distill.shards"), (4, "models.hub"), (5, "train")]
