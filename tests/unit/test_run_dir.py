"""train/checkpoint.py run-dir housekeeping: an earlier run's records are moved aside (never emptied) by a fresh
run, and `train.resume` compares the checkpoint's saved config with the current one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.train import checkpoint as ckpt


def _config(**changes: object) -> dict:
    cfg = {
        "name": "run",
        "base_model": {"name_or_path": "tiny", "gguf_file": None, "revision": None, "dtype": "fp32"},
        "drafter": {"family": "redrafter", "draft_len": 3, "num_layers": 2, "target_layers": []},
        "optim": {"lr": 0.01, "betas": [0.9, 0.95], "warmup_steps": 2},
        "train": {"batch_size": 4, "grad_accum": 1, "max_steps": 8, "resume": False, "crash_at_step": None},
        "data": {"max_length": 96},
    }
    for key, value in changes.items():
        group, field = key.split("__")
        cfg[group][field] = value
    return cfg


def _checkpoint(root: Path, config: dict | None, step: int = 4) -> Path:
    path = root / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    meta = {"step": step, "data": {"epoch": 0, "batch_in_epoch": step}}
    if config is not None:
        meta["config"] = config
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_same_config_resumes_silently(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, _config())
    assert ckpt.check_resume(path, _config(train__resume=True, train__crash_at_step=None)) == []


@pytest.mark.parametrize(
    ("change", "listed"),
    [
        ({"drafter__num_layers": 1}, "drafter.num_layers: 2 -> 1"),
        ({"drafter__target_layers": [1]}, "drafter.target_layers: [] -> [1]"),
        ({"base_model__name_or_path": "other"}, "base_model.name_or_path: 'tiny' -> 'other'"),
        ({"base_model__revision": "v2"}, "base_model.revision: None -> 'v2'"),
    ],
)
def test_another_drafter_or_base_model_is_refused(tmp_path: Path, change: dict, listed: str) -> None:
    path = _checkpoint(tmp_path, _config())
    with pytest.raises(ValueError) as err:
        ckpt.check_resume(path, _config(**change))
    message = str(err.value)
    assert listed in message and "train.resume=true" in message and str(path) in message
    assert "\n" not in message


def test_changed_optimiser_settings_are_listed_old_to_new(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, _config())
    changed = ckpt.check_resume(
        path, _config(optim__lr=0.005, train__max_steps=16, train__batch_size=8, data__max_length=64)
    )
    assert changed == [
        "optim.lr: 0.01 -> 0.005",
        "train.batch_size: 4 -> 8",
        "train.max_steps: 8 -> 16",
    ]


def test_base_model_dtype_and_new_fields_are_not_compared(tmp_path: Path) -> None:
    """Only the model's identity counts; a field added since the checkpoint (absent there) is not a change."""
    saved = _config()
    del saved["drafter"]["target_layers"]
    path = _checkpoint(tmp_path, saved)
    assert ckpt.check_resume(path, _config(base_model__dtype="bf16", drafter__target_layers=[1])) == []


def test_a_checkpoint_without_a_saved_config_is_reported(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, None)
    [note] = ckpt.check_resume(path, _config())
    assert "holds no config" in note


def test_archive_moves_an_earlier_runs_records_aside(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    _checkpoint(tmp_path, _config())
    (tmp_path / "distilled").mkdir()  # not a record of the training run: stays
    (tmp_path / "summary.json").write_text("{}")  # replaced only by a run that finishes
    moved = ckpt.archive_previous_run(tmp_path)
    assert moved == ["metrics.jsonl -> metrics.1.jsonl", "checkpoints -> checkpoints.1"]
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "checkpoints.1" / "step-00000004" / "meta.json").is_file()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "distilled").is_dir() and (tmp_path / "summary.json").is_file()
    assert ckpt.latest_checkpoint(ckpt.checkpoint_dir(tmp_path)) is None  # never resumed by mistake

    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')  # a second earlier run: the next free number
    assert ckpt.archive_previous_run(tmp_path) == ["metrics.jsonl -> metrics.2.jsonl"]
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1}\n'


def test_archive_leaves_empty_or_missing_records_alone(tmp_path: Path) -> None:
    assert ckpt.archive_previous_run(tmp_path / "new_run") == []
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    assert ckpt.archive_previous_run(tmp_path) == []
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints").is_dir()
