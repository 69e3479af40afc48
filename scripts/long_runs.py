"""Issue 23's long recipes in one command: one self-distilled set, the four families trained on it, one eval run.

    # everything not done yet, from the checkout root (hours on a 2-core CPU; the GPU command: README "Results")
    python scripts/long_runs.py
    # a subset, or fewer steps (the same overrides go to every family's train.py)
    python scripts/long_runs.py --families redrafter eagle3 --train-args train.max_steps=400
    # per family: an override prefixed with `<family>:` goes to that family's train.py only
    python scripts/long_runs.py --train-args "train.max_steps=600 eagle3:train.max_steps=300"
    # only the side-by-side eval of the exports there are, on 20 MT-Bench questions
    python scripts/long_runs.py --stages eval --eval-args eval.limit=20
    # a lent GPU (README "Results" has the full command): each call does what is left, one cut short by the
    # call's time limit (SIGTERM stops the running stage too) resumes on the next
    timeout 560 python scripts/long_runs.py --distill-args ... ; cp outputs/long_runs/record.json $OUT/

Stages, each skipped when its output is already complete (so a killed run picks up where it stopped):

    distill  python distill.py conf=redrafter_smollm2_long              resumes its shards
    train    python train.py conf=<family>_smollm2_long per family     done: summary.json of this data and steps;
                                                                        else train.resume=true (a killed run goes on)
    eval     python evaluate.py conf=redrafter_smollm2_long eval.drafters=[the exports] (+ prompt lookup, same run)
    simvs    python scripts/sim_vs_served.py --data <the set> --exports <every export + its kept checkpoints>
             (simulated vs served tokens/step on the held-out conversations, their ratio and correlation)

The record (`--record`, JSON, rewritten atomically after every stage) holds the machine and, per stage, the
exact command, exit code and wall time; per family the data rows, steps, training time and held-out simulated
acceptance (summary.json); from the eval run the tokens/step and speedup of every method; from simvs the
correlation and the worst ratio. The script ends with the side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from subprocess import Popen, TimeoutExpired
from typing import Any

FAMILIES = {  # family -> its long preset (conf/conf/<preset>.yaml)
    "redrafter": "redrafter_smollm2_long",
    "medusa": "medusa_smollm2_long",
    "eagle": "eagle_smollm2_long",
    "eagle3": "eagle3_smollm2_long",
}
DATA_PRESET = "redrafter_smollm2_long"  # owns the distilled set every long preset trains on
STAGES = ("distill", "train", "eval", "simvs")


def distill_complete(data_dir: Path) -> tuple[bool, int]:
    """(every planned shard written, rows so far) from the distilled set's manifest.json."""
    path = data_dir / "manifest.json"
    if not path.is_file():
        return False, 0
    m = json.loads(path.read_text())
    rows = sum(int(s["rows"]) for s in m.get("shards", []))
    return bool(m.get("complete")), rows


def train_state(run_dir: Path, rows: int, steps: int | None) -> str:
    """'done' (summary.json of a finished run on `rows` rows and, when given, `steps` steps), 'stale' (a
    finished run on other data or steps: start afresh, its records are moved aside) or 'resume'."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return "resume"
    s = json.loads(path.read_text())
    same = f"({rows} rows)" in str(s.get("data", "")) and (steps is None or int(s.get("steps", -1)) == steps)
    return "done" if same and (run_dir / "export" / "config.json").is_file() else "stale"


def family_args(train_args: list[str], family: str) -> list[str]:
    """The overrides for `family`'s train.py: the unprefixed ones, then those prefixed `family:` (unprefixed)."""
    mine = []
    for arg in train_args:
        head, sep, rest = arg.partition(":")
        if sep and head in FAMILIES:
            mine += [rest] if head == family else []
        else:
            mine.append(arg)
    return mine


def requested_steps(train_args: list[str]) -> int | None:
    """The train.max_steps override among `train_args`, if any (else the preset's, read from summary.json)."""
    found = [a.split("=", 1)[1] for a in train_args if a.startswith("train.max_steps=")]
    return int(found[-1]) if found else None


def train_seconds(entries: list[dict[str, Any]], family: str) -> float:
    """Wall seconds of `family`'s train.py calls since its last fresh start (`train.resume=false`): the
    whole training time of a run that was interrupted and resumed."""
    total = 0.0
    for e in entries:
        if e.get("family") == family:
            total = (0.0 if "train.resume=false" in e["command"] else total) + float(e["wall_s"])
    return total


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from `timeout`) -> KeyboardInterrupt, so `run` stops its stage before this process ends."""
    raise KeyboardInterrupt(f"signal {signum}")


def run(cmd: list[str], entry: dict[str, Any], record: dict[str, Any], save) -> bool:
    """Run `cmd` (output streamed), fill `entry` with command, exit code and wall time, save the record.

    Interrupted (Ctrl-C, or SIGTERM from `timeout`), the stage is terminated too, never left running beside
    the next call, and recorded with `exit_code: "interrupted"` before the interrupt goes on."""
    print(f"\n[long_runs] $ {shlex.join(cmd)}", flush=True)
    entry.update(command=shlex.join(cmd), started_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    t0 = time.time()
    proc = Popen(cmd)
    code: int | str = "interrupted"
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        entry.update(exit_code=code, wall_s=round(time.time() - t0, 1))
        record["stages"].append(entry)
        save()
    return code == 0


def summary_line(s: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one eval summary row the side-by-side table shows."""
    keep = (
        "method",
        "kind",
        "reference",
        "tokens_per_step",
        "speedup",
        "spec_tokens_per_s",
        "ar_tokens_per_s",
    )
    return {k: s.get(k) for k in keep} | {"bench": s.get("bench")}


def _cell(x: Any, spec: str) -> str:
    """A table cell: `x` formatted by `spec` (e.g. '>6', '>9.1f'), or '-' at the same width when missing."""
    width = "".join(c for c in spec.split(".")[0] if c.isdigit()) or "0"
    return f"{'-':>{width}}" if x is None else format(x, spec)


def _speedup(x: float | None) -> str:
    """The speedup cell (8 wide): `1.23x`, or '-' when the family has not been evaluated."""
    return f"{'-':>8}" if x is None else f"{x:>7.2f}x"


def print_table(record: dict[str, Any]) -> None:
    """Per family: rows, steps, training minutes, held-out simulated acceptance (the replay with the family's own
    proposer where the run logged it, else the served tree's walk where the family declares one, else the chain
    estimate), served tokens/step, speedup; then the baselines of the same eval run (prompt lookup)."""
    served = record.get("eval", {}).get("summary", [])
    print(
        f"\n{'method':<14} {'rows':>6} {'steps':>6} {'train min':>9} {'sim accept':>10} {'tokens/step':>11} {'speedup':>8}"
    )
    for fam, t in record.get("train", {}).items():
        s = next((r for r in served if r["method"].split(":")[0] == fam), {})
        spent = t.get("train_s_all_calls") or t.get("train_s")
        minutes = spent / 60 if spent else None
        print(
            f"{fam:<14} {_cell(t.get('rows'), '>6')} {_cell(t.get('steps'), '>6')} {_cell(minutes, '>9.1f')} "
            f"{_cell(t.get('replay_accept_len') or t.get('tree_walk_len') or t.get('sim_accept_len'), '>10.3f')} "
            f"{_cell(s.get('tokens_per_step'), '>11.2f')} "
            f"{_speedup(s.get('speedup'))}"
        )
    sv = record.get("simvs")
    if sv:
        print(f"simulated vs served tokens/step over {len(sv['rows'])} exports and checkpoints: Pearson "
              f"{sv['pearson_simulated_served']:.3f}, worst |ratio - 1| {sv['worst_abs_ratio_minus_1']:.3f}")  # fmt: skip
    for s in served:
        if s.get("kind") == "hf":  # transformers' baselines, against their own AR
            print(f"{s['method']:<14} {'':>6} {'':>6} {'':>9} {'':>10} {_cell(s.get('tokens_per_step'), '>11.2f')} "
                  f"{_speedup(s.get('speedup'))}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the requested stages (module docstring); 0 when all ran, 1 when a stage failed or lacks its input."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--output-root", default="outputs", help="Hydra output_root (run dirs live under it)")
    p.add_argument("--distill-args", default="", help="extra Hydra overrides for distill.py (one string)")
    p.add_argument(
        "--train-args",
        default="",
        help="extra Hydra overrides for train.py (one string; `<family>:key=value` for one family)",
    )
    p.add_argument("--eval-args", default="", help="extra Hydra overrides for evaluate.py (one string)")
    p.add_argument(
        "--simvs-args", default="", help="extra arguments for scripts/sim_vs_served.py (one string)"
    )
    p.add_argument("--force", action="store_true", help="retrain families whose run is already done")
    p.add_argument("--record", default=None, help="record JSON (default <output-root>/long_runs/record.json)")
    a = p.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return run_stages(a)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_stages(a: argparse.Namespace) -> int:
    """The stages `a` asks for, in order (module docstring); 0 when all ran, 1 when one failed or lacks input."""

    from specdraft.hardware import host_info
    from specdraft.train.checkpoint import PREFIX, checkpoint_dir, list_checkpoints
    from specdraft.utils import atomic_write_json

    if not Path("distill.py").is_file():
        print(
            f"[long_runs] run it from the specdraft checkout's root (no distill.py in {os.getcwd()})",
            file=sys.stderr,
        )
        return 2
    root = Path(a.output_root)
    data_dir = root / DATA_PRESET / "distilled"
    record_path = Path(a.record or root / "long_runs" / "record.json")
    record: dict[str, Any] = (
        json.loads(record_path.read_text()) if record_path.is_file() else {"stages": [], "train": {}}
    )
    record["machine"] = {**host_info(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    common = [sys.executable]
    base = [f"output_root={a.output_root}"]

    def save() -> None:
        record_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(record_path, record)

    if "distill" in a.stages:
        done, rows = distill_complete(data_dir)
        if done:
            print(f"[long_runs] distill: {data_dir} complete ({rows} rows)")
        else:
            cmd = [*common, "distill.py", f"conf={DATA_PRESET}", *base, *shlex.split(a.distill_args)]
            if not run(cmd, {"stage": "distill"}, record, save):
                return 1
    done, rows = distill_complete(data_dir)
    record["data"] = {"dir": str(data_dir), "rows": rows, "complete": done}
    save()
    if {"train", "eval"} & set(a.stages) and not done:
        print(
            f"[long_runs] {data_dir} is not complete ({rows} rows): run the distill stage first",
            file=sys.stderr,
        )
        return 1

    train_args = shlex.split(a.train_args)
    exports: list[str] = []
    checkpoints: list[str] = []  # kept checkpoints (train.keep_last) but the final one, for simvs
    for fam in a.families:
        run_dir = root / FAMILIES[fam]
        args = family_args(train_args, fam)
        state = train_state(run_dir, rows, requested_steps(args))
        if "train" in a.stages and (state != "done" or a.force):
            resume = "true" if state == "resume" and not a.force else "false"
            cmd = [*common, "train.py", f"conf={FAMILIES[fam]}", *base, *args, f"train.resume={resume}"]
            if not run(cmd, {"stage": "train", "family": fam}, record, save):
                return 1
        summary = run_dir / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            ev = s.get("final_eval", {})
            record["train"][fam] = {
                "preset": FAMILIES[fam],
                "data": s.get("data"),
                "rows": rows,
                "steps": s.get("steps"),
                "train_s": s.get("wall_time_s"),  # the last train.py process (a resumed run: its part only)
                "train_s_all_calls": train_seconds(record["stages"], fam),
                "processes": s.get("processes"),
                "sim_accept_len": ev.get("eval/sim_accept_len"),
                "tree_walk_len": ev.get("eval/tree_walk_len"),  # Medusa: its served tree, walked along rows
                # train.eval_replay_rows: the decoder replayed with the family's own proposer
                "replay_accept_len": ev.get("eval/replay_accept_len"),
                "acc1_s0": ev.get("eval/acc1_s0"),
                "export": str(run_dir / "export"),
            }
            exports.append(str(run_dir / "export"))
            final = (
                f"{PREFIX}{int(s.get('steps') or 0):08d}"  # the export's weights: served once, as the export
            )
            checkpoints += [str(c) for c in list_checkpoints(checkpoint_dir(run_dir)) if c.name != final]
        save()

    if {"eval", "simvs"} & set(a.stages) and not exports:
        print("[long_runs] eval/simvs: no trained export yet (run the train stage)", file=sys.stderr)
        return 1
    if "eval" in a.stages:
        out = root / "long_runs" / "eval"
        cmd = [*common, "evaluate.py", f"conf={DATA_PRESET}", *base, f"eval.drafters=[{','.join(exports)}]",
               f"eval.out_dir={out}", *shlex.split(a.eval_args)]  # fmt: skip
        if not run(cmd, {"stage": "eval"}, record, save):
            return 1
        results = json.loads((out / "results.json").read_text())
        record["eval"] = {
            "results": str(out / "results.json"),
            "settings": {
                k: results["settings"]["eval"].get(k) for k in ("benches", "limit", "max_new_tokens")
            },
            "summary": [summary_line(s) for s in results["summary"]],
        }
        save()
    if "simvs" in a.stages:
        out_json = root / "long_runs" / "sim_vs_served.json"
        val = "0.04"  # the long presets' data.val_fraction: the held-out conversations
        cmd = [*common, "scripts/sim_vs_served.py", "--data", str(data_dir), "--exports", *exports, *checkpoints,
               "--val-fraction", val, "--json", str(out_json), *shlex.split(a.simvs_args)]  # fmt: skip
        if not run(cmd, {"stage": "simvs"}, record, save):
            return 1
        sv = json.loads(out_json.read_text())
        keep = ("export", "family", "simulated", "served", "ratio")
        record["simvs"] = {
            "results": str(out_json),
            "pearson_simulated_served": sv["pearson_simulated_served"],
            "worst_abs_ratio_minus_1": sv["worst_abs_ratio_minus_1"],
            "rows": [{k: r.get(k) for k in keep} for r in sv["rows"]],
        }
        save()
    print_table(record)
    print(f"\n[long_runs] record: {record_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
