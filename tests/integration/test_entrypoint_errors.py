"""Bad input at the real entry points: one line `error: ...` naming the key and the fix, exit code 2, no
traceback, and nothing created or overwritten (the config is checked before Hydra makes the run dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft import entry
from specdraft.testing import write_train_assets

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env or ENV, capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2 and exactly one stderr line, `error: ...` holding every needle."""
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith(("Loading weights", "\r"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("script", "override", "needles"),
    [
        ("train.py", "train.batch_size=0", ("train.batch_size=0", ">= 1", "pass e.g. train.batch_size=")),
        ("train.py", "drafter.draft_len=0", ("drafter.draft_len=0", ">= 1")),
        ("train.py", "optim.scheduler=linear", ("optim.scheduler=linear", "cosine, constant")),
        ("distill.py", "distill.T=0", ("distill.T=0", ">= 1")),
        ("evaluate.py", "eval.max_new_tokens=0", ("eval.max_new_tokens=0", ">= 1")),
        ("evaluate.py", "eval.limit=0", ("eval.limit=0",)),
    ],
)
def test_out_of_range_values_exit_2_with_one_line_before_any_write(tmp_path, script, override, needles):
    proc = run(script, "conf=redrafter_smollm2", f"output_root={tmp_path / 'runs'}", override)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "runs").exists()  # not even Hydra's .hydra/ folder


@pytest.mark.parametrize("name", ["../escaped", "/tmp/abs_run", "a/b", ".."])
def test_a_run_name_must_be_a_plain_folder_name(tmp_path, name):
    runs = tmp_path / "inner" / "runs"
    proc = run("train.py", "conf=redrafter_smollm2", f"output_root={runs}", f"name={name}")
    assert_one_line_error(proc, f"name={name}", "plain folder name", "output_root=")
    assert list(tmp_path.iterdir()) == []  # nothing written inside or outside output_root


def test_debug_shows_the_traceback(tmp_path):
    for var in ("SPECDRAFT_DEBUG", "HYDRA_FULL_ERROR"):
        proc = run(
            "train.py",
            "conf=redrafter_smollm2",
            f"output_root={tmp_path}",
            "train.batch_size=0",
            env={**ENV, var: "1"},
        )
        assert proc.returncode != 0 and "Traceback" in proc.stderr and "train.batch_size=0" in proc.stderr


def test_console_script_reports_the_same_way(tmp_path):
    code = "import sys; from specdraft.cli import eval_main; sys.argv[0] = 'specdraft-eval'; eval_main()"
    proc = run("-c", code, f"output_root={tmp_path}", "eval.acceptance=lossy")
    assert_one_line_error(proc, "eval.acceptance=lossy", "exact, typical")


def test_cli_still_composes_and_prints_with_options_anywhere():
    """The validation callback is added next to the user's overrides, so `--cfg` works before or after them."""
    for args in (["conf=redrafter_smollm2", "--cfg", "job"], ["--cfg", "job", "conf=redrafter_smollm2"]):
        proc = run("train.py", *args)
        assert proc.returncode == 0, proc.stderr
        assert "name: redrafter_smollm2" in proc.stdout


def test_an_error_inside_the_stage_is_one_line(tmp_path):
    """A project error raised after the target loads (here: no distilled dataset) is still one line."""
    assets = write_train_assets(tmp_path, num_convs=8)
    proc = run(
        "train.py", f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
        f"output_root={tmp_path / 'runs'}", "name=nodata", f"train.data_dir={tmp_path / 'missing'}",
        "train.progress=false", "logger.tensorboard=false",
    )  # fmt: skip
    assert_one_line_error(proc, str(tmp_path / "missing"))


def test_report_names_where_a_library_error_came_from(capsys):
    """A ValueError from outside specdraft (a bug, or an unchecked input) says where it was raised."""
    with pytest.raises(SystemExit) as code, entry.reported_errors():
        json.loads("{")
    assert code.value.code == 2
    line = capsys.readouterr().err.strip()
    assert (
        line.startswith("error: JSONDecodeError: ")
        and "raised in json." in line
        and "SPECDRAFT_DEBUG=1" in line
    )


def test_report_keeps_specdrafts_own_messages_plain(capsys):
    from specdraft.conf.validate import check_section
    from specdraft.train.config import TrainConfig

    problems = check_section({"batch_size": 0}, TrainConfig, "train.")
    with pytest.raises(SystemExit), entry.reported_errors():
        raise entry.SpecdraftError(problems[0])
    assert capsys.readouterr().err == f"error: {problems[0]}\n"


def test_benchmark_scripts_report_bad_input_in_one_line(eval_assets: Path, tmp_path: Path) -> None:
    """A benchmark script given a layout its dtype cannot use says so in one line (exit 2), writes no JSON, and
    shows the traceback under SPECDRAFT_DEBUG=1."""
    out = tmp_path / "layouts.json"
    args = (
        "scripts/bench_layouts.py", "--target", str(eval_assets / "target"), "--dtype", "fp64", "--device", "cpu",
        "--threads", "1", "--layouts", "panel", "--sizes", "1", "--reps", "1", "--json", str(out),
    )  # fmt: skip
    assert_one_line_error(run(*args), "linear layout 'panel'", "use linear_layout=transposed or auto")
    assert not out.exists()
    proc = run(*args, env={**ENV, "SPECDRAFT_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr
