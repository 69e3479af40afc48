"""`evaluate(cfg)` / `python evaluate.py` end to end on a tiny target with a random ReDrafter export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specdraft.conf.schema import register_configs
from specdraft.eval.cli import evaluate

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {
    "bench",
    "method",
    "tokens_per_step",
    "acceptance_rate",
    "ar_tokens_per_s",
    "spec_tokens_per_s",
    "speedup",
}


@pytest.fixture(scope="module")
def assets(eval_assets: Path) -> Path:
    """Tiny target folder + a random ReDrafter export + mini benchmarks (tests/conftest.py)."""
    return eval_assets


def _overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
        f"output_root={assets / 'runs'}", f"eval.drafters=[{assets / 'drafter'}]", f"eval.out_dir={out}",
        "eval.max_new_tokens=12", "eval.warmup_tokens=4", "eval.num_threads=1", *extra,
    ]  # fmt: skip


def test_evaluate_writes_tables_json_and_plots(assets, tmp_path, capsys):
    GlobalHydra.instance().clear()
    register_configs()
    extra = [
        f"eval.benches=[{assets / 'mini_mt.jsonl'},{assets / 'mini_alpaca.jsonl'}]", "eval.limit=2",
        "eval.check_lossless=true",
        "eval.baselines=[prompt_lookup,assisted,hf_static]", f"eval.assistant_model={assets / 'target'}",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path, *extra))
    path = evaluate(cfg)
    printed = capsys.readouterr().out
    assert "mini_mt: speedup over autoregressive decoding" in printed and f"results: {path}" in printed
    assert "mini_mt: per category and turn" in printed and "mini_alpaca: per category (" in printed

    res = json.loads(path.read_text())
    methods = ["ar", "redrafter:drafter", "hf_ar", "hf_static", "prompt_lookup", "assisted"]
    assert [m["name"] for m in res["settings"]["methods"]] == methods
    assert {(s["bench"], s["method"]) for s in res["summary"]} == {
        (b, m) for b in ("mini_mt", "mini_alpaca") for m in methods
    }
    for s in res["summary"]:
        assert set(s) >= SUMMARY_KEYS
        if s["method"] != "ar":
            assert {"identical", "total", "near_tie_divergences"} <= set(s)
    spec = next(s for s in res["summary"] if s["bench"] == "mini_mt" and s["method"] == "redrafter:drafter")
    assert spec["total"] == 4  # 2 questions x 2 turns
    assert spec["identical"] + spec["near_tie_divergences"] == spec["total"]  # lossless up to numeric ties
    assert (
        spec["tokens_per_step"] >= 1.0
        and 0.0 <= spec["acceptance_rate"] <= 1.0
        and spec["compression"] >= 1.0
    )
    assert {r["category"] for r in res["records"] if r["bench"] == "mini_mt"} == {"writing", "math"}
    turns = {(r["id"], r["turn"]) for r in res["records"] if r["bench"] == "mini_mt"}
    assert len(turns) == 4  # MT-Bench: both turns asked
    by_turn = {(s["bench"], s["turn"], s["method"]): s for s in res["turns"]}
    assert set(by_turn) == {("mini_mt", t, m) for t in (1, 2) for m in methods} | {
        ("mini_alpaca", 1, m) for m in methods
    }
    for t in (1, 2):  # each turn's records summed: its speedup is over AR on that turn only
        recs = [r for r in res["records"] if r["bench"] == "mini_mt" and r["turn"] == t]
        rate = {
            m: sum(r["new_tokens"] for r in recs if r["method"] == m)
            / sum(r["time_s"] for r in recs if r["method"] == m)
            for m in ("ar", "redrafter:drafter")
        }
        turn = by_turn[("mini_mt", t, "redrafter:drafter")]
        assert turn["prompts"] == 2 and turn["speedup"] == pytest.approx(
            rate["redrafter:drafter"] / rate["ar"]
        )
    t2 = next(r for r in res["records"] if r["turn"] == 2 and r["method"] == "ar")
    t1 = next(r for r in res["records"] if r["turn"] == 1 and r["method"] == "ar" and r["id"] == t2["id"])
    assert t2["prompt_tokens"] > t1["prompt_tokens"] + t1["new_tokens"] - 1  # turn 2 sees the first answer
    assert res["machine"]["torch_threads"] >= 1 and res["settings"]["eval"]["limit"] == 2
    assert {p.name for p in tmp_path.glob("*.png")} == {
        f"{kind}_{b}.png" for kind in ("accept_hist", "category_speedup") for b in ("mini_mt", "mini_alpaca")
    }


def test_entry_point_with_sampling(assets, tmp_path):
    args = [sys.executable, "evaluate.py", *_overrides(assets, tmp_path, "eval.limit=1", "eval.benches=[mt_bench]", "eval.temperature=0.8",
            "eval.top_p=0.9", "eval.baselines=[]", "eval.plots=false", "eval.warmup=0")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert [s["method"] for s in res["summary"]] == ["ar", "redrafter:drafter"]
    assert all(r["new_tokens"] >= 1 for r in res["records"])


def test_unknown_baseline_is_a_clear_error(assets, tmp_path):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=_overrides(assets, tmp_path, "eval.baselines=[medusa_magic]")
        )
    with pytest.raises(ValueError, match="eval.baselines"):
        evaluate(cfg)


def test_draft_dtype_casts_the_drafter_and_stays_lossless(assets, tmp_path, monkeypatch):
    """`eval.draft_dtype=bf16` drafts with a bf16 copy next to an fp32 target: the drafts change, the output
    does not; an unknown dtype is a clear error naming the field."""
    GlobalHydra.instance().clear()
    register_configs()
    extra = ["eval.limit=1", "eval.benches=[mt_bench]", "eval.baselines=[]", "eval.plots=false",
             "eval.warmup=0", "eval.check_lossless=true", "eval.near_tie_gap=0"]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=_overrides(assets, tmp_path, *extra, "eval.draft_dtype=bf16")
        )
        bad = compose(
            config_name="config", overrides=_overrides(assets, tmp_path, *extra, "eval.draft_dtype=fp8")
        )
    from specdraft.eval import proposers

    seen: list[torch.dtype] = []
    make = proposers.make_proposer
    monkeypatch.setattr(
        proposers, "make_proposer", lambda d, *a, **k: seen.append(d.head.weight.dtype) or make(d, *a, **k)
    )
    res = json.loads(evaluate(cfg).read_text())
    assert seen == [torch.bfloat16]  # the drafter the proposer drafts with
    spec = next(s for s in res["summary"] if s["method"] == "redrafter:drafter")
    assert spec["identical"] == spec["total"] == 2  # both turns token for token
    with pytest.raises(ValueError, match="eval.draft_dtype=fp8: expected null or one of auto, fp32"):
        evaluate(bad)
    # unset: the drafter follows the target's dtype (a bf16 target drafts in bf16, not in the export's fp32)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        follow = compose(
            config_name="config", overrides=_overrides(assets, tmp_path, *extra[:4], "eval.dtype=bf16")
        )
    seen.clear()
    evaluate(follow)
    assert seen == [torch.bfloat16]


def _previous_results(out: Path) -> dict[str, bytes]:
    """A results folder as an earlier run left it (results.json + a plot)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text('{"previous": true}\n')
    (out / "accept_hist_mini_mt.png").write_bytes(b"old plot")
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("bad", ["eval.limit=0", "eval.max_new_tokens=0", "eval.max_new_tokens=-3", "empty"])
def test_bad_input_exits_2_and_keeps_the_previous_results(assets, tmp_path, bad):
    """eval.limit=0, eval.max_new_tokens<=0 and an empty benchmark file are refused before the target loads,
    in one line, and the earlier results.json and plots stay as they were."""
    before = _previous_results(tmp_path / "out")
    if bad == "empty":
        (tmp_path / "empty.jsonl").write_text("\n")
        bad = f"eval.benches=[{assets / 'mini_mt.jsonl'},{tmp_path / 'empty.jsonl'}]"
    args = [sys.executable, "evaluate.py", *_overrides(assets, tmp_path / "out", bad)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert ("empty.jsonl holds no prompts" if "empty" in bad else bad) in lines[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_a_missing_drafter_is_refused_before_the_target_loads(assets, tmp_path, monkeypatch):
    """An eval.drafters entry that is no export (a typo'd folder, an uncached Hub id offline) fails in one line
    naming the field before the target is loaded, not after."""
    from specdraft.models import base_llm

    def no_target(*_args, **_kwargs):
        raise AssertionError("the target loaded before the drafters were checked")

    GlobalHydra.instance().clear()
    register_configs()
    missing = tmp_path / "no_such_export"
    overrides = [o for o in _overrides(assets, tmp_path / "out") if not o.startswith("eval.drafters=")]
    overrides += [f"eval.drafters=[{missing}]", f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=1"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    monkeypatch.setattr(base_llm, "load_target", no_target)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="eval.drafters="):
        evaluate(cfg)


def test_a_failure_while_writing_keeps_the_previous_results(assets, tmp_path, monkeypatch):
    """results.json and the plots are staged and moved in only once all of them are written."""
    from specdraft.eval import speedup

    GlobalHydra.instance().clear()
    register_configs()
    extra = [
        "eval.limit=1",
        f"eval.benches=[{assets / 'mini_mt.jsonl'}]",
        "eval.baselines=[]",
        "eval.warmup=0",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path / "out", *extra))
    before = _previous_results(tmp_path / "out")
    write_plots = speedup.write_plots

    def fail_after_the_first_plot(records, categories, out_dir):
        write_plots(records, categories, out_dir)
        raise RuntimeError("disk full")

    monkeypatch.setattr(speedup, "write_plots", fail_after_the_first_plot)
    with pytest.raises(RuntimeError, match="disk full"):
        evaluate(cfg)
    assert {
        p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()
    } == before  # no temp folder left either
    monkeypatch.setattr(speedup, "write_plots", write_plots)
    path = evaluate(cfg)
    assert (
        json.loads(path.read_text())["summary"]
        and (tmp_path / "out" / "accept_hist_mini_mt.png").read_bytes() != b"old plot"
    )
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "extra, name",
    [
        (["eval.decode_path=dynamic"], "redrafter:drafter"),  # no budget on the reference path
        (["eval.node_budget=off"], "redrafter:drafter"),
        (["eval.fallback=true"], "redrafter:drafter+fallback"),
        # prompt lookup in our decoder runs as the drafters do: the fitted budget and the fallback
        (["eval.fallback=true", "eval.baselines=[tree_lookup]"], "tree_lookup+fallback"),
    ],
)
def test_decode_path_and_fitted_budget(assets, tmp_path, monkeypatch, extra, name):
    """The pre-static path stays selectable; the fitted budget measures (and caches) the cost curve once and
    fits every speculative row's cap (`tree_lookup`'s too)."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cache"))
    GlobalHydra.instance().clear()
    register_configs()
    args = [f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=1", "eval.check_lossless=true", *extra]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path / "out", *args))
    res = json.loads(evaluate(cfg).read_text())
    spec = next(s for s in res["summary"] if s["method"] == name)
    assert spec["identical"] + spec["near_tie_divergences"] == spec["total"] == 2
    budget = "eval.node_budget=off" not in extra and "eval.decode_path=dynamic" not in extra
    assert len(list(tmp_path.glob("cache/*.json"))) == budget  # the cost curve: measured once, cached
    assert all((r["budget_fit_steps"] is not None) == budget for r in res["records"] if r["kind"] == "spec")


def test_a_fixed_node_cap(assets, tmp_path, monkeypatch):
    """`eval.node_budget=2`: every tree cut to 2 nodes from the first step, no cost curve measured, no fitting
    (on a 2-core Zen 4 the fitted budget served 5-15% below a fixed 2-node cap, session 64); the output is AR's.
    A count below 1 or a word other than auto / off fails in one line naming the field."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cache"))
    GlobalHydra.instance().clear()
    register_configs()
    args = [f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=1", "eval.check_lossless=true"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=_overrides(assets, tmp_path / "out", *args, "eval.node_budget=2")
        )
    res = json.loads(evaluate(cfg).read_text())
    spec = next(s for s in res["summary"] if s["method"] == "redrafter:drafter")
    assert spec["identical"] + spec["near_tie_divergences"] == spec["total"] == 2
    assert not list(tmp_path.glob("cache/*.json"))  # nothing measured
    recs = [r for r in res["records"] if r["kind"] == "spec"]
    assert recs and all(
        r["node_cap"] == 2 and r["budget_refits"] == 0 and r["mean_tree_size"] <= 2 for r in recs
    )
    for wrong in ("eval.node_budget=0", "eval.node_budget=fixed"):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            bad = compose(config_name="config", overrides=_overrides(assets, tmp_path / "out", *args, wrong))
        with pytest.raises(ValueError, match="eval.node_budget"):
            evaluate(bad)


def test_a_bandit_node_budget(assets, tmp_path, monkeypatch, capsys):
    """`eval.node_budget=bandit`: a cap per step chosen from the loop's measured tokens per second
    (`BanditBudget`), its arms bounded by the measured cost curve; the output is AR's and no probe steps are
    recorded."""
    monkeypatch.setenv("SPECDRAFT_COST_CURVES", str(tmp_path / "cache"))
    GlobalHydra.instance().clear()
    register_configs()
    args = [f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=1", "eval.check_lossless=true",
            "eval.node_budget=bandit"]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path / "out", *args))
    res = json.loads(evaluate(cfg).read_text())
    spec = next(s for s in res["summary"] if s["method"] == "redrafter:drafter")
    assert spec["identical"] + spec["near_tie_divergences"] == spec["total"] == 2
    assert len(list(tmp_path.glob("cache/*.json"))) == 1  # the curve bounds the arms
    assert "bandit over caps [1, " in capsys.readouterr().out
    recs = [r for r in res["records"] if r["kind"] == "spec"]
    assert recs and all(r["budget_fit_steps"] == 0 and r["node_cap"] >= 1 for r in recs)


def test_throughput_table_against_batch_size(assets, tmp_path, capsys):
    """`eval.batch_sizes`: batched AR and the drafter at B = 1 and 2, outputs equal to batch-1 AR, a plot;
    `eval.batch_min_prob=auto` adds the ReDrafter with its trees pruned at each batch size's break-even
    probability (`budget.marginal_min_prob` of that batch's cost curve), and `eval.batch_width=auto` every
    drafter again with one verify width per step (`batch_width.WidthPolicy`)."""
    GlobalHydra.instance().clear()
    register_configs()
    args = [f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=3", "eval.batch_sizes=[1,2]",
            "eval.baselines=[tree_lookup]", "eval.fallback=true", "eval.batch_min_prob=auto",
            "eval.batch_width=auto"]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path, *args))
    res = json.loads(evaluate(cfg).read_text())
    rows = res["throughput"]
    methods = ("ar", "redrafter:drafter", "tree_lookup", "redrafter:drafter@p=auto", "redrafter:drafter@width",
               "tree_lookup@width")  # fmt: skip
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in (1, 2) for m in methods]
    assert all(r["identical"] == r["requests"] == 3 and r["tokens_per_s"] > 0 for r in rows)
    n = len(methods)
    assert rows[n]["speedup_vs_batch1_ar"] == pytest.approx(rows[n]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert [r["width_fallbacks"] is not None for r in rows] == [
        m.endswith("@width") for _ in (1, 2) for m in methods
    ]
    assert [r["setting"] is not None for r in rows] == [m.endswith("auto") for _ in (1, 2) for m in methods]
    assert all(0.0 <= r["setting"] < 1.0 for r in rows if r["setting"] is not None)
    assert (tmp_path / "throughput_mini_mt.png").is_file()
    assert "throughput vs batch size" in capsys.readouterr().out
    for wrong in ("eval.batch_sizes=[0]", "eval.batch_min_prob=1.5", "eval.batch_width=on"):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            bad = compose(config_name="config", overrides=_overrides(assets, tmp_path, *args[:2], wrong))
        with pytest.raises(ValueError, match=wrong.split("=")[0]):
            evaluate(bad)


def test_throughput_table_sampled_and_grouped(assets, tmp_path, capsys):
    """`eval.temperature > 0` samples every row (no AR comparison); `eval.scheduler=groups` without a
    predictor keeps FIFO and the oracle groups (the FIFO run's lengths) under FIFO's memory."""
    GlobalHydra.instance().clear()
    register_configs()
    args = [f"eval.benches=[{assets / 'mini_mt.jsonl'}]", "eval.limit=3", "eval.batch_sizes=[2]",
            "eval.scheduler=groups", "eval.temperature=0.7", "eval.node_budget=off"]  # fmt: skip
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=_overrides(assets, tmp_path, *args))
    rows = json.loads(evaluate(cfg).read_text())["throughput"]
    assert [(r["method"], r["scheduler"]) for r in rows] == [
        (m, s) for m in ("ar", "redrafter:drafter") for s in ("fifo", "oracle_groups")
    ]
    assert all(r["identical"] is None and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["kv_budget"] > 0 for r in rows)  # (sampled lengths differ between runs: oracle may overflow)
    assert "predicted-length rows skipped" in capsys.readouterr().out
