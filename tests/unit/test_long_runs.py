"""scripts/long_runs.py: which stages run, with which resume flag, and what the record keeps (stages faked)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from specdraft.testing import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "long_runs.py"


def _script():
    return load_script(SCRIPT)


class FakeStages:
    """Stands in for distill.py / train.py / evaluate.py: writes what each would, records every command."""

    def __init__(self, root: Path, rows: int = 12, fail: str | None = None) -> None:
        self.root, self.rows, self.fail, self.calls = root, rows, fail, []
        self.interrupt: str | None = None  # this script's wait() is interrupted (SIGTERM from `timeout`)
        self.procs: list = []

    def __call__(self, cmd: list[str]) -> int:
        self.calls.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        if cmd[1] == self.fail:
            return 3
        if cmd[1] == self.interrupt:
            return 0  # killed before it wrote anything (FakeProc.wait raises)
        if cmd[1] == "distill.py":
            d = self.root / "redrafter_smollm2_long" / "distilled"
            d.mkdir(parents=True, exist_ok=True)
            shards = [{"name": "shard-00000", "rows": self.rows}]
            (d / "manifest.json").write_text(json.dumps({"complete": True, "shards": shards}))
        elif cmd[1] == "train.py":
            run = self.root / args["conf"]
            (run / "export").mkdir(parents=True, exist_ok=True)
            (run / "export" / "config.json").write_text("{}")
            steps = int(args.get("train.max_steps", 100))
            for step in (5, steps):  # the last kept checkpoint is the export's weights
                ckpt = run / "checkpoints" / f"step-{step:08d}"
                ckpt.mkdir(parents=True, exist_ok=True)
                (ckpt / "meta.json").write_text(json.dumps({"step": step}))  # a complete checkpoint
            summary = {"steps": steps, "wall_time_s": 60.0, "data": f"distilled x ({self.rows} rows)",
                       "final_eval": {"eval/sim_accept_len": 1.5, "eval/replay_accept_len": 1.875}}  # fmt: skip
            (run / "summary.json").write_text(json.dumps(summary))
        elif cmd[1] == "evaluate.py":
            out = Path(args["eval.out_dir"])
            out.mkdir(parents=True, exist_ok=True)
            fams = [Path(p).parent.name.split("_")[0] for p in args["eval.drafters"].strip("[]").split(",")]
            summary = [{"method": "ar", "kind": "ar", "tokens_per_step": 1.0, "speedup": 1.0}]
            summary += [
                {"method": f"{f}:export", "kind": "spec", "tokens_per_step": 2.0, "speedup": 1.3}
                for f in fams
            ]
            settings = {"eval": {"benches": ["mt_bench"], "limit": 10, "max_new_tokens": 128}}
            (out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary}))
        elif cmd[1] == "scripts/sim_vs_served.py":
            exports = cmd[cmd.index("--exports") + 1 : cmd.index("--val-fraction")]
            rows = [
                {"export": e, "family": "x", "simulated": 2.0, "served": 2.1, "ratio": 0.95} for e in exports
            ]
            sv = {"pearson_simulated_served": 0.97, "worst_abs_ratio_minus_1": 0.05, "rows": rows}
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(sv))
        return 0


class FakeProc:
    """`subprocess.Popen` stand-in: the stage already ran; `wait` gives its exit code, or is interrupted."""

    def __init__(self, code: int, interrupt: bool = False) -> None:
        self.code, self.interrupt, self.terminated = code, interrupt, False

    def wait(self, timeout: float | None = None) -> int:
        if self.interrupt and not self.terminated:
            raise KeyboardInterrupt  # what SIGTERM becomes in long_runs
        return self.code

    def terminate(self) -> None:
        self.terminated = True


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch):
    mod = _script()
    stages = FakeStages(tmp_path / "out")
    procs: list[FakeProc] = []

    def popen(cmd: list[str]) -> FakeProc:
        procs.append(FakeProc(stages(cmd), interrupt=cmd[1] == stages.interrupt))
        return procs[-1]

    monkeypatch.setattr(mod, "Popen", popen)  # the stages only: platform.* still runs real processes
    monkeypatch.chdir(SCRIPT.parents[1])  # the stage scripts are named relative to the checkout's root
    stages.procs = procs
    return mod, stages, tmp_path / "out"


def test_all_stages_then_nothing_left_to_do(fake, capsys) -> None:
    mod, stages, root = fake
    argv = ["--output-root", str(root), "--families", "redrafter", "eagle3"]
    assert mod.main(argv) == 0
    assert [c[1] for c in stages.calls] == [
        "distill.py", "train.py", "train.py", "evaluate.py", "scripts/sim_vs_served.py",
    ]  # fmt: skip
    assert "train.resume=true" in stages.calls[1]  # no summary yet: a killed run would go on
    record = json.loads((root / "long_runs" / "record.json").read_text())
    assert [s["stage"] for s in record["stages"]] == ["distill", "train", "train", "eval", "simvs"]
    assert record["simvs"]["pearson_simulated_served"] == 0.97 and len(record["simvs"]["rows"]) == 4
    served = [r["export"] for r in record["simvs"]["rows"]]  # 2 exports + step 5 of each, not step 100 again
    assert sum(e.endswith("step-00000005") for e in served) == 2 and not any(
        "step-00000100" in e for e in served
    )
    assert all(s["exit_code"] == 0 and "wall_s" in s for s in record["stages"])
    assert record["data"] == {
        "dir": str(root / "redrafter_smollm2_long" / "distilled"),
        "rows": 12,
        "complete": True,
    }
    assert record["train"]["eagle3"]["sim_accept_len"] == 1.5 and record["train"]["eagle3"]["rows"] == 12
    assert record["train"]["eagle3"]["replay_accept_len"] == 1.875
    assert [s["method"] for s in record["eval"]["summary"]] == ["ar", "redrafter:export", "eagle3:export"]
    assert "cpu_model" in record["machine"]
    out = capsys.readouterr().out
    assert "eagle3" in out and "2.00" in out and "1.30x" in out and "Pearson 0.970" in out  # the table
    assert "1.875" in out and "1.500" not in out  # the replay, where the run logged it, over the chain
    stages.calls.clear()
    assert mod.main(argv) == 0  # done stages are skipped: only eval and simvs run again
    assert [c[1] for c in stages.calls] == ["evaluate.py", "scripts/sim_vs_served.py"]


def test_finished_run_on_other_data_or_steps_is_retrained_afresh(fake) -> None:
    mod, stages, root = fake
    assert mod.main(["--output-root", str(root), "--families", "medusa", "--stages", "distill", "train"]) == 0
    stages.calls.clear()
    stages.rows = 20  # the distilled set grew: the medusa run is stale
    (root / "redrafter_smollm2_long" / "distilled" / "manifest.json").unlink()
    argv = ["--output-root", str(root), "--families", "medusa", "--stages", "distill", "train"]
    assert mod.main(argv) == 0
    assert [c[1] for c in stages.calls] == ["distill.py", "train.py"]
    assert "train.resume=false" in stages.calls[1]
    stages.calls.clear()
    assert mod.main([*argv, "--train-args", "train.max_steps=7"]) == 0  # other steps: stale again
    assert "train.max_steps=7" in stages.calls[0] and "train.resume=false" in stages.calls[0]
    stages.calls.clear()
    mixed = "train.max_steps=8 eagle3:train.max_steps=3 medusa:optim.lr=0.1"  # eagle3's is not medusa's
    assert mod.main([*argv, "--train-args", mixed]) == 0
    assert stages.calls[0][-3:] == ["train.max_steps=8", "optim.lr=0.1", "train.resume=false"]


def test_a_failed_stage_stops_and_is_recorded(fake, capsys) -> None:
    mod, stages, root = fake
    stages.fail = "train.py"
    assert mod.main(["--output-root", str(root), "--families", "eagle"]) == 1
    assert [c[1] for c in stages.calls] == ["distill.py", "train.py"]
    record = json.loads((root / "long_runs" / "record.json").read_text())
    assert record["stages"][-1]["exit_code"] == 3
    assert shlex.split(record["stages"][-1]["command"])[1:3] == ["train.py", "conf=eagle_smollm2_long"]


def test_train_and_eval_refuse_an_incomplete_set(fake, capsys) -> None:
    mod, stages, root = fake
    assert mod.main(["--output-root", str(root), "--stages", "train"]) == 1
    assert stages.calls == []
    assert "not complete (0 rows): run the distill stage first" in capsys.readouterr().err


def test_an_interrupted_stage_is_terminated_and_recorded(fake) -> None:
    mod, stages, root = fake
    stages.interrupt = "train.py"
    with pytest.raises(KeyboardInterrupt):
        mod.main(["--output-root", str(root), "--families", "medusa"])
    assert stages.procs[-1].terminated  # never left running beside the next call
    record = json.loads((root / "long_runs" / "record.json").read_text())
    assert record["stages"][-1]["exit_code"] == "interrupted" and record["stages"][-1]["family"] == "medusa"
    stages.interrupt, stages.calls = None, []
    assert mod.main(["--output-root", str(root), "--families", "medusa", "--stages", "train"]) == 0
    assert [c[1] for c in stages.calls] == ["train.py"] and "train.resume=true" in stages.calls[0]  # goes on
    record = json.loads((root / "long_runs" / "record.json").read_text())
    calls = [e["wall_s"] for e in record["stages"] if e.get("family") == "medusa"]
    assert len(calls) == 2 and record["train"]["medusa"]["train_s_all_calls"] == pytest.approx(sum(calls))


def test_refuses_to_run_outside_the_checkout_root(fake, tmp_path: Path, monkeypatch, capsys) -> None:
    mod, stages, root = fake
    monkeypatch.chdir(tmp_path)
    assert mod.main(["--output-root", str(root)]) == 2 and stages.calls == []
    assert "run it from the specdraft checkout's root" in capsys.readouterr().err
