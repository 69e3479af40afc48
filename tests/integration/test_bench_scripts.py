"""The benchmark scripts (scripts/bench_decode.py, bench_batch.py, bench_batch_packing.py, bench_adaptive.py, bench_ttt.py,
bench_commit.py) end to
end on a tiny target, a random ReDrafter and prompt lookup: their tables, their JSON (command, machine, rows),
every method's output equal to AR's, and both EAGLE unrolls agreeing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.models.panel_linear import SOURCE, panel_available
from specdraft.testing import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _main(name: str):
    return load_script(SCRIPTS / f"{name}.py").main


def _common(assets: Path, out: Path) -> list[str]:
    return [
        "--target", str(assets / "target"), "--dtype", "fp32", "--device", "cpu", "--threads", "1",
        "--drafter", str(assets / "drafter"), "--lookup", "3", "--bench", str(assets / "mini_mt.jsonl"),
        "--json", str(out),
    ]  # fmt: skip


def _load(out: Path) -> dict:
    res = json.loads(out.read_text())
    assert res["command"] and res["machine"]["device"] == "cpu" and res["machine"]["dtype"] == "float32"
    return res


def test_bench_decode(eval_assets: Path, tmp_path: Path, capsys) -> None:
    from specdraft.models.linear_layout import mkl_packing_available

    out = tmp_path / "decode.json"
    layout = "all" if mkl_packing_available() else "both"  # native, transposed (and MKL-packed) weights
    argv = [
        *_common(eval_assets, out),
        "--prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--budget",
        "--budget-refit",
        "0",
        "128",
        "--layout",
        layout,
        "--lookup-branch",
        "3",
    ]
    _main("bench_decode")(argv)
    res = _load(out)
    methods = {(r["method"], r["path"]) for r in res["rows"]}
    paths = ["static", "static-T", "static-P"][: 3 if layout == "all" else 2]
    assert {("ar", "dynamic"), ("lookup:3", "dynamic"), ("redrafter:drafter+lookup", "dynamic")} <= methods
    for path in paths:
        budgeted = {(f"redrafter:drafter+budget(refit {k})", path) for k in (0, 128)}
        assert {("ar", path), ("redrafter:drafter", path), *budgeted} <= methods
    assert all("budget_caps" in r for r in res["rows"] if "+budget" in r["method"])  # the caps it settled on
    assert all(r["same"] == "2/2" for r in res["rows"])  # every path, layout and method equals AR
    assert set(res["cost_ms"]) >= {"1", "2", "4"} and set(res["cost_ms_transposed"]) >= {"1", "2", "4"}
    assert layout == "both" or set(res["cost_ms_packed"]) >= {"1", "2", "4"}
    assert "decode paths on cpu" in capsys.readouterr().out
    assert res["layouts"] == ["native", "transposed", *(["packed", "panel"] if layout == "all" else [])]


def test_bench_decode_lays_the_target_out_as_evaluate_does_by_default(
    eval_assets: Path, tmp_path: Path
) -> None:
    """Without --layout the script measures the layout `eval.linear_layout=auto` gives (what evaluate.py runs),
    not the native weights, and records the one it resolved."""
    from types import SimpleNamespace

    from specdraft.models.base_llm import load_target
    from specdraft.models.linear_layout import apply_layout

    out = tmp_path / "decode.json"
    _main("bench_decode")([*_common(eval_assets, out), "--prompts", "1", "--max-new-tokens", "4"])
    res = _load(out)
    target, _ = load_target(
        SimpleNamespace(name_or_path=str(eval_assets / "target"), dtype="fp32", device="cpu")
    )
    assert res["layout"] == "auto" and res["layouts"] == [apply_layout(target, "auto")]


def test_bench_batch(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """Every method at batch 1 and 2, outputs equal to batch-1 AR; `--budget --bandit`: a bandit node budget per
    (batch size, drafter)."""
    out = tmp_path / "batch.json"
    _main("bench_batch")(
        [*_common(eval_assets, out), "--requests", "3", "--batch", "1", "2", "--max-new-tokens", "6",
         "--lookup-branch", "3", "--budget", "--bandit"]
    )  # fmt: skip
    rows = _load(out)["rows"]
    methods = ("ar", "redrafter:drafter", "redrafter:drafter+lookup", "lookup:3")
    assert {(r["method"], r["batch"]) for r in rows} == {(m, b) for m in methods for b in (1, 2)}
    assert all(r["identical"] == r["requests"] == 3 for r in rows)  # batched outputs equal batch-1 AR
    printed = capsys.readouterr().out
    assert "mini_mt" in printed and "redrafter:drafter at batch 2: bandit over caps [1" in printed


def test_bench_batch_phases_and_refill_rows(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """`--phases`: every method's FIFO record carries ms per step for each phase and the phase table is
    printed; `--refill-rows 2` (rows admitted two at a time) keeps every output equal to batch-1 AR."""
    out = tmp_path / "phases.json"
    _main("bench_batch")(
        [*_common(eval_assets, out), "--requests", "3", "--batch", "1", "2", "--max-new-tokens", "6",
         "--phases", "--refill-rows", "2"]
    )  # fmt: skip
    rows = _load(out)["rows"]
    assert all(r["identical"] == r["requests"] == 3 for r in rows)
    assert all(
        set(r["phase_ms_per_step"]) == {"prefill", "draft", "verify", "accept", "commit"} for r in rows
    )
    assert all(r["phase_ms_per_step"]["verify"] > 0 and r["profiled_tokens_per_s"] > 0 for r in rows)
    assert "ms per batched step and phase" in capsys.readouterr().out


def test_bench_commit(capsys) -> None:
    """scripts/bench_commit.py times both commits and prints their ratio."""
    _main("bench_commit")(["--rows", "2", "--nodes", "8", "--prefix", "16", "--reps", "2", "--threads", "1"])
    out = capsys.readouterr().out
    assert (
        "per-layer, every slot" in out and "one buffer, accepted slots" in out and "x" in out.splitlines()[-1]
    )


def test_bench_batch_draft_rows_ab_with_repeats(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """`--draft-rows both --repeats 2`: every drafter also drafted one row at a time, two passes, and a table
    of medians per (batch, method) over them."""
    out = tmp_path / "batch.json"
    _main("bench_batch")(
        [*_common(eval_assets, out), "--requests", "3", "--batch", "2", "--max-new-tokens", "6",
         "--draft-rows", "both", "--repeats", "2", "--budget"]
    )  # fmt: skip
    res = _load(out)
    methods = {"ar", "redrafter:drafter", "redrafter:drafter (rows each)", "lookup:3"}  # _common adds lookup
    assert {(r["method"], r["repeat"]) for r in res["rows"]} == {(m, k) for m in methods for k in (0, 1)}
    assert all(r["identical"] == 3 for r in res["rows"])
    assert {m["method"] for m in res["medians"]} == methods and all(m["passes"] == 2 for m in res["medians"])
    assert "medians over the passes" in capsys.readouterr().out


def test_bench_batch_fixed_cap(eval_assets: Path, tmp_path: Path) -> None:
    """`--cap 2`: every drafter's trees cut to 2 nodes at every batch size from the first step (no fitting);
    outputs still equal batch-1 AR, and `--cap` with `--budget` is refused."""
    out = tmp_path / "cap.json"
    argv = [*_common(eval_assets, out), "--requests", "3", "--batch", "2", "--max-new-tokens", "6"]
    _main("bench_batch")([*argv, "--cap", "2"])
    rows = _load(out)["rows"]
    spec = [r for r in rows if r["method"] != "ar"]
    assert spec and all(r["node_cap"] == 2 and r["identical"] == 3 for r in spec)
    with pytest.raises(SystemExit):
        _main("bench_batch")([*argv, "--cap", "2", "--budget"])


def test_bench_batch_min_prob(eval_assets: Path, tmp_path: Path) -> None:
    """`--min-prob 0.5 auto`: the ReDrafter again with confidence-pruned trees, at 0.5 and at each batch size's
    break-even probability (from that batch's cost curve); outputs equal batch-1 AR's, and a tiny random
    drafter (probabilities ~1/vocab) is pruned to its root, so those rows verify one node a step."""
    out = tmp_path / "min_prob.json"
    argv = [*_common(eval_assets, out), "--requests", "3", "--batch", "1", "2", "--max-new-tokens", "6"]
    _main("bench_batch")([*argv, "--min-prob", "0.5", "auto"])
    rows = {(r["method"], r["batch"]): r for r in _load(out)["rows"]}
    assert all(r["identical"] == 3 for r in rows.values())
    for b in (1, 2):
        auto = rows[("redrafter:drafter@p=auto", b)]
        assert 0.0 <= auto["setting"] < 1.0
        assert rows[("redrafter:drafter@p=0.5", b)]["nodes_per_step"] == 1.0
        assert rows[("redrafter:drafter@p=0.5", b)]["setting"] is None
        assert rows[("redrafter:drafter", b)]["nodes_per_step"] > 1.0
        assert rows[("ar", b)]["nodes_per_step"] == 1.0
    with pytest.raises(SystemExit):
        _main("bench_batch")([*argv, "--min-prob", "1.5"])


def test_bench_batch_width(eval_assets: Path, tmp_path: Path) -> None:
    """`--width`: the drafter and prompt lookup again with one verify width per step from their calibrated
    confidence, within `--cap`; outputs equal batch-1 AR's, the record counts the policy's fallbacks, and the
    widths verified never pass the cap."""
    out = tmp_path / "width.json"
    argv = [*_common(eval_assets, out), "--requests", "3", "--batch", "1", "2", "--max-new-tokens", "6"]
    _main("bench_batch")([*argv, "--cap", "4", "--width"])
    rows = {(r["method"], r["batch"]): r for r in _load(out)["rows"]}
    assert all(r["identical"] == 3 for r in rows.values())
    lookup = next(m for m, _ in rows if m.startswith("lookup:") and not m.endswith("@width"))
    for b in (1, 2):
        for name in ("redrafter:drafter", lookup):
            width = rows[(f"{name}@width", b)]
            assert width["width_fallbacks"] is not None and width["node_cap"] == 4
            assert 1.0 <= width["nodes_per_step"] <= 4.0
            assert rows[(name, b)]["width_fallbacks"] is None


def test_bench_batch_packing(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """Padded against packed eager verifies, paired: a row per batch size and method, the same tokens both
    ways."""
    out = tmp_path / "packing.json"
    argv = [
        *_common(eval_assets, out),
        "--batch",
        "3",
        "--requests",
        "4",
        "--max-new-tokens",
        "8",
        "--rounds",
        "1",
    ]
    _main("bench_batch_packing")(argv)
    res = _load(out)
    assert [(r["batch"], r["method"]) for r in res["rows"]] == [
        (3, "ar"),
        (3, "lookup:3"),
        (3, "redrafter:drafter"),
    ]
    # the mini MT-Bench file holds 3 prompts
    assert all(r["same"] == "3/3" and r["packed_tok_s"] > 0 for r in res["rows"])
    assert "packed vs padded" in capsys.readouterr().out


def test_bench_adaptive(eval_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "adaptive.json"
    argv = [*_common(eval_assets, out), "--prompts", "2", "--max-new-tokens", "8", "--thresholds", "0.2"]
    _main("bench_adaptive")([*argv, "--warmup-tokens", "4", "--no-fallback", "0.2"])
    rows = _load(out)["rows"]
    assert {(r["method"], r["tree"]) for r in rows} >= {
        ("ar", "-"), ("redrafter:drafter", "fixed"), ("redrafter:drafter", "adaptive@0.2"),
        ("lookup:3", "adaptive@0.2 no fallback"),
    }  # fmt: skip
    assert all(r["same"] == "2/2" for r in rows)


def test_bench_ttt_unrolls_agree(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ttt.json"
    tiny = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--batch", "2", "--length", "12",
            "--steps", "3", "--positions", "6", "--repeats", "1", "--threads", "1"]  # fmt: skip
    for family in ("eagle3", "eagle"):
        res = _main("bench_ttt")([*tiny, "--family", family, "--draft-vocab", "64", "--json", str(out)])
        assert res["max_abs_diff"] < 1e-4 and res["whole_s"] > 0 and res["selected_s"] > 0
        saved = json.loads(out.read_text())
        assert saved["settings"]["family"] == family and saved["results"]["ratio"] == res["ratio"]
    assert "selected-positions unroll" in capsys.readouterr().out


def test_bench_layouts(eval_assets: Path, tmp_path: Path, capsys) -> None:
    from specdraft.models.linear_layout import mkl_packing_available

    out = tmp_path / "layouts.json"
    layouts = ["native", "transposed"] + (["packed"] if mkl_packing_available() else [])
    argv = ["--target", str(eval_assets / "target"), "--dtype", "fp32", "--device", "cpu", "--threads", "1"]
    _main("bench_layouts")(
        [*argv, "--layouts", *layouts, "--sizes", "1", "2", "5", "--reps", "1", "--json", str(out)]
    )
    res = _load(out)
    assert res["layouts"] == layouts and all(set(res["ms"][la]) == {"1", "2", "5"} for la in layouts)
    assert all(ms > 0 for la in layouts for ms in res["ms"][la].values())
    assert res["added_bytes"]["native"] == 0 and res["added_bytes"]["transposed"] >= 0
    assert "packed" not in layouts or res["added_bytes"]["packed"] > res["added_bytes"]["transposed"]
    assert "memory added" in capsys.readouterr().out
    _main("bench_layouts")(
        [
            *argv,
            "--layouts",
            "native",
            "--attention",
            "both",
            "--sizes",
            "1",
            "3",
            "--reps",
            "1",
            "--json",
            str(out),
        ]
    )
    assert _load(out)["layouts"] == ["native", "native+sdpa"]  # grouped-query SDPA and transformers' own


def test_bench_layouts_exact_panels_ab(eval_assets: Path, tmp_path: Path) -> None:
    """`--layouts panel-fp32 panel` (the exact-panel A/B): a target whose Linear weights are all bf16 values is
    stored as 2-byte exact panels under `panel` only (less memory added than fp32 panels)."""
    if not panel_available():
        pytest.skip("no panel kernel on this machine")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "bf16_values"
    model = AutoModelForCausalLM.from_pretrained(eval_assets / "target", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                p.bfloat16().float()
            )  # fp32 weights holding bf16 values (a 16-bit checkpoint run in fp32)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(eval_assets / "target").save_pretrained(target)
    out = tmp_path / "exact.json"
    argv = ["--target", str(target), "--dtype", "fp32", "--device", "cpu", "--threads", "1"]
    _main("bench_layouts")(
        [*argv, "--layouts", "panel-fp32", "panel", "--sizes", "1", "3", "--reps", "1", "--json", str(out)]
    )
    res = _load(out)
    assert res["layouts"] == ["panel-fp32", "panel"]
    assert 0 < res["added_bytes"]["panel"] < res["added_bytes"]["panel-fp32"]


def test_bench_draft_layout(eval_assets: Path, tmp_path: Path, capsys) -> None:
    import pytest

    from specdraft.models.linear_layout import mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("torch without MKL's packed GEMM")
    out = tmp_path / "draft.json"
    argv = [*_common(eval_assets, out), "--prompts", "2", "--max-new-tokens", "8", "--reps", "1"]
    _main("bench_draft_layout")(argv)  # (--lookup is read and not used)
    res = _load(out)
    (row,) = res["rows"]
    assert row["packed_layers"] > 0 and row["same"] == "4/4"  # both copies, both prompts: AR's output
    assert len(row["draft_ms"]["as_loaded"]) == len(row["draft_ms"]["packed"]) == 1
    assert "draft ms per step" in capsys.readouterr().out


def test_median_of_an_even_number_of_passes_is_the_mean_of_the_middle_two() -> None:
    """Two passes at 0.8x and 1.0x: median 0.9x (the upper value, 1.0x, overstated every two-pass A/B)."""
    mod = load_script(SCRIPTS / "bench_batch.py")
    row = dict(batch=4, method="m", scheduler="fifo", node_cap=2)
    passes = [[{**row, "speedup_vs_ar_same_batch": s, "tokens_per_s": 100 * s}] for s in (1.0, 0.8)]
    (m,) = mod.median_speedups(passes)
    assert m["speedup_median"] == pytest.approx(0.9) and m["tokens_per_s_median"] == pytest.approx(90.0)
    assert (m["speedup_min"], m["speedup_max"], m["passes"]) == (0.8, 1.0, 2)


def test_bench_target_forward(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """transformers' forward against the lean one: a ratio per node count, AR in both with equal outputs."""
    out = tmp_path / "target_forward.json"
    argv = [
        "--target", str(eval_assets / "target"), "--dtype", "fp32", "--device", "cpu", "--threads", "1",
        "--bench", str(eval_assets / "mini_mt.jsonl"), "--json", str(out), "--sizes", "1", "4",
        "--rounds", "1", "--reps", "1", "--prompts", "2", "--max-new-tokens", "6",
    ]  # fmt: skip
    _main("bench_target_forward")(argv)
    res = _load(out)
    assert [r["nodes"] for r in res["verify"]] == [1, 4] and all(r["ratio"] > 0 for r in res["verify"])
    assert res["ar_same"] == 2 and set(res["ar_tok_s"]) == {"hf", "fast"}
    assert "AR outputs equal: 2/2" in capsys.readouterr().out
    _main("bench_target_forward")([*argv, "--layout", "native", "--compare", "stacked"])  # plain Linears
    res = _load(out)
    assert res["compare"] == "stacked" and set(res["ar_tok_s"]) == {"separate", "stacked"}
    assert "stacked ms" in capsys.readouterr().out
    if panel_available():  # the row kernels against torch's ops, on a panel target
        _main("bench_target_forward")([*argv, "--layout", "panel", "--compare", "rows"])
        res = _load(out)
        assert res["compare"] == "rows" and set(res["ar_tok_s"]) == {"torch_ops", "row_kernels"}
        assert res["ar_same"] == 2 and "row kernels ms" in capsys.readouterr().out
        _main("bench_target_forward")([*argv, "--layout", "panel", "--compare", "layers"])
        res = _load(out)
        assert set(res["ar_tok_s"]) == {"layer_loop", "one_call"} and res["ar_same"] == 2
        base = tmp_path / "base.c"  # the kernel as built, as the baseline of a kernel A/B
        base.write_text(SOURCE.read_text())
        _main("bench_target_forward")(
            [*argv, "--layout", "panel", "--compare", "kernel", "--baseline-source", str(base)]
        )
        res = _load(out)
        assert set(res["ar_tok_s"]) == {"baseline", "built"} and res["ar_same"] == 2
        assert res["baseline_source"] == str(base)
        base.write_text("this is not C\n")
        with pytest.raises(SystemExit, match=r"--baseline-source .*base.c: .*failed to build"):
            _main("bench_target_forward")([*argv, "--compare", "kernel", "--baseline-source", str(base)])
        with pytest.raises(SystemExit, match="goes with --compare kernel"):
            _main("bench_target_forward")([*argv, "--baseline-source", str(base)])


def test_bench_dtype(eval_assets: Path, tmp_path: Path, capsys) -> None:
    """The target in fp32 and bf16 in one run: a verify ratio per node count, AR tok/s of each, what auto picks;
    the same dtype twice is refused."""
    out = tmp_path / "dtype.json"
    argv = [
        "--target", str(eval_assets / "target"), "--device", "cpu", "--threads", "1",
        "--bench", str(eval_assets / "mini_mt.jsonl"), "--json", str(out), "--sizes", "1", "4",
        "--reps", "1", "--prompts", "2", "--max-new-tokens", "6",
    ]  # fmt: skip
    _main("bench_dtype")(argv)
    res = _load(out)
    assert res["dtypes"] == ["fp32", "bf16"] and [r["nodes"] for r in res["verify"]] == [1, 4]
    assert all(r["ratio"] > 0 for r in res["verify"]) and set(res["ar_tok_s"]) == {"fp32", "bf16"}
    assert 0 <= res["ar_same"] <= 2 and res["auto"] in ("torch.float32", "torch.bfloat16")
    printed = capsys.readouterr().out
    assert "AR outputs equal in both dtypes" in printed and "base_model.dtype=auto picks" in printed
    with pytest.raises(SystemExit, match="two different dtypes"):
        _main("bench_dtype")([*argv, "--dtypes", "fp32", "fp32"])
