"""Training and held-out rows from a distilled dataset folder (`train.data_dir`), checked against the target.

Here rather than in data/: it reads distill's shards and checks them with the drafter export's target check, and
data/ imports neither distill/ nor models/.
"""

from __future__ import annotations

from typing import Any

from specdraft.data.conversations import split_indices
from specdraft.distill.shards import load_distilled
from specdraft.models.hub import check_target_match


def distilled_rows(cfg: Any, fingerprint: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(train, val, manifest) from a distilled dataset folder, refusing one made for another target.

    `train.val_data_dir`, when set, supplies the val rows instead: the val split of that distilled dataset
    (same target and cached features required).
    """

    def load(folder: str) -> tuple[Any, dict[str, Any]]:
        ds, manifest = load_distilled(folder, bool(cfg.train.get("allow_incomplete_data", False)))
        check_target_match(manifest.get("target", {}), fingerprint, f"dataset {folder}")
        return ds, manifest

    ds, manifest = load(cfg.train.data_dir)
    frac, seed = float(cfg.data.val_fraction), int(cfg.data.seed)
    train, val = split_indices(list(ds["id"]), frac, seed)
    val_dir = cfg.train.get("val_data_dir")
    if not val_dir:
        return ds.select(train), ds.select(val), manifest
    # Held-out rows from another distilled dataset (e.g. self-distilled rows while training on continuations
    # of original responses). The split hashes conversation ids, so a conversation held out there is held
    # out here too and never trains.
    other, other_manifest = load(val_dir)
    if other_manifest.get("features") != manifest.get("features"):
        raise ValueError(
            f"train.val_data_dir={val_dir} caches features {other_manifest.get('features')} but "
            f"train.data_dir={cfg.train.data_dir} caches {manifest.get('features')}: distill both with the same "
            "distill.save_hidden / hidden_layers / topk / feature_dtype"
        )
    _, other_val = split_indices(list(other["id"]), frac, seed)
    return ds.select(train), other.select(other_val), manifest
