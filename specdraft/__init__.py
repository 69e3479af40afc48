"""specdraft: train drafters for speculative decoding and measure what they buy.

The repository's top-level folders (``models/``, ``data/``, ``distill/``, ``train/``, ``eval/``,
``conf/``) are installed as subpackages of this one namespace, e.g. ``specdraft.models``.
"""

from pathlib import Path

__version__ = "0.1.0"

# Running from a source checkout with a non-editable install (or none): the subpackages live
# beside this folder, so let the import system find them there too.
_root = Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "models" / "__init__.py").is_file():
    __path__.append(str(_root))  # type: ignore[name-defined]  # noqa: F821
