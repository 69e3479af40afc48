"""The real entry point (`python train.py ...`) on a tiny target: trains, beats the unigram baseline, exports,
and resumes exactly after `kill -9`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from specdraft.models.hub import load_drafter
from specdraft.testing import run_tiny_train, tiny_llama, write_train_assets
from specdraft.train.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "omega"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny target folder (random Llama + char tokenizer with ChatML) and 48 synthetic conversations."""
    return write_train_assets(tmp_path_factory.mktemp("train_assets"), num_convs=48, words=WORDS)


def run_train(assets: Path, name: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_tiny_train(
        REPO, assets, assets / "runs", name,
        "drafter.init_from_lm_head=false", "optim.lr=1e-2", "optim.warmup_steps=2",
        "train.max_steps=24", "train.eval_every=8", "train.eval_batches=2",
        "train.ckpt_every=8", "train.log_every=1", *extra,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def reference(assets) -> Path:
    run_train(assets, "ref")
    return assets / "runs" / "ref"


def assert_lossless(target: torch.nn.Module, proposer, prompt: torch.Tensor, new_tokens: int = 20) -> None:
    """Greedy speculative decoding with `proposer` gives the target's own greedy tokens."""
    from specdraft.eval.decode import ar_generate, speculative_generate

    ref, _ = ar_generate(target, None, prompt, new_tokens, stop_ids=set())
    out, _ = speculative_generate(target, None, prompt, proposer, new_tokens, stop_ids=set())
    assert out == ref


def test_entry_point_trains_beats_unigram_and_exports(reference, assets):
    evals = [r for r in read_metrics(reference) if "eval/acc1_mean" in r]
    assert [r["step"] for r in evals] == [8, 16, 24]
    last = evals[-1]
    assert last["eval/acc1_s0"] > last["eval/unigram_acc1_s0"] + 0.05
    assert last["eval/sim_accept_len"] > last["eval/unigram_sim_accept_len"]
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-00000016", "step-00000024"]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["final_eval"]["eval/acc1_s0"] == last["eval/acc1_s0"]
    drafter = load_drafter(str(reference / "export"), target=tiny_llama())
    assert drafter.config.draft_len == 3 and drafter.config.training_summary["steps"] == 24
    beams, _ = drafter.beam_search(torch.randn(32), 7, beam_width=4, draft_len=3)
    assert beams.shape == (4, 4)


def test_resume_after_kill_continues_the_same_curve(reference, assets):
    crashed = run_train(assets, "killed", "train.crash_at_step=13", check=False)
    assert crashed.returncode in (-9, 137), crashed.stderr[-2000:]
    run_dir = assets / "runs" / "killed"
    assert max(r["step"] for r in read_metrics(run_dir)) == 13  # steps 9..13 were done, then lost
    run_train(assets, "killed", "train.resume=true")
    ref = {
        (r["step"], k): v
        for r in read_metrics(reference)
        for k, v in r.items()
        if k.startswith(("train/loss", "eval/"))
    }
    got = {
        (r["step"], k): v
        for r in read_metrics(run_dir)
        for k, v in r.items()
        if k.startswith(("train/loss", "eval/"))
    }
    assert got.keys() == ref.keys()
    for key, v in ref.items():
        assert got[key] == pytest.approx(v, rel=1e-5, abs=1e-6), key


def test_max_minutes_stops_early_then_resume_finishes_the_same_run(reference, assets):
    """`train.max_minutes` (a time-limited GPU call): the run stops at the first step past the limit as it would
    at max_steps (held-out eval, checkpoint, export, summary `stopped_by`); `train.resume=true` then goes on to
    max_steps along the uninterrupted run's curve."""
    run_train(assets, "timed", "train.max_minutes=0.0001")  # 6 ms: past it after step 1
    run_dir = assets / "runs" / "timed"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["stopped_by"] == "max_minutes"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]
    assert [r["step"] for r in read_metrics(run_dir) if "eval/acc1_s0" in r] == [1]
    assert load_drafter(str(run_dir / "export"), target=tiny_llama()).config.training_summary["steps"] == 1
    run_train(assets, "timed", "train.resume=true")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["stopped_by"] == "max_steps"
    ref = {r["step"]: r for r in read_metrics(reference) if "eval/acc1_s0" in r}
    got = {r["step"]: r for r in read_metrics(run_dir) if "eval/acc1_s0" in r}
    assert sorted(got) == [1, 8, 16, 24]
    for step in (8, 16, 24):
        assert got[step]["eval/loss"] == pytest.approx(ref[step]["eval/loss"], rel=1e-5, abs=1e-6), step


def test_a_run_from_step_0_starts_a_fresh_metrics_file(assets):
    """Re-running a run name without `train.resume` does not mix the earlier run's records into its metrics: they
    (and its checkpoints) are moved aside to metrics.1.jsonl / checkpoints.1, and only once the new run has
    loaded everything; a run that fails before that leaves them where they are."""
    short = ("train.max_steps=4", "train.eval_every=2", "train.ckpt_every=4", "train.export=false")
    run_dir = assets / "runs" / "again"
    run_train(assets, "again", *short)
    first = (run_dir / "metrics.jsonl").read_bytes()
    failed = run_train(assets, "again", *short, f"train.data_dir={assets / 'no_such_dataset'}", check=False)
    assert failed.returncode == 2 and "no_such_dataset" in failed.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == first and not (run_dir / "metrics.1.jsonl").exists()
    run_train(assets, "again", *short)
    evals = [r["step"] for r in read_metrics(run_dir) if "eval/acc1_s0" in r]
    assert evals == [2, 4]
    assert (run_dir / "metrics.1.jsonl").read_bytes() == first
    assert [p.name for p in (run_dir / "checkpoints.1").iterdir()] == ["step-00000004"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000004"]


def test_resume_refuses_another_drafter_and_warns_about_new_optimiser_settings(assets):
    """train.resume=true compares the checkpoint's saved config: a different architecture is refused in one line
    before anything loads (metrics untouched); a new lr / max_steps is listed old -> new, and metrics are appended."""
    base = ("drafter.init_from_lm_head=false", "optim.warmup_steps=2", "train.eval_every=2", "train.eval_batches=1",
            "train.ckpt_every=2", "train.log_every=1", "train.export=false")  # fmt: skip
    run_dir = assets / "runs" / "cfg"
    first = run_tiny_train(REPO, assets, assets / "runs", "cfg", *base, "optim.lr=1e-2", "train.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run_dir / "metrics.jsonl").read_text()
    refused = run_tiny_train(
        REPO, assets, assets / "runs", "cfg", *base, "optim.lr=1e-2", "train.max_steps=4", "train.resume=true",
        "drafter.num_layers=1",
    )  # fmt: skip
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "drafter.num_layers: 2 -> 1" in lines[0] and "step-00000004" in lines[0]
    assert (run_dir / "metrics.jsonl").read_text() == before
    resumed = run_tiny_train(
        REPO, assets, assets / "runs", "cfg", *base, "optim.lr=5e-3", "train.max_steps=6", "train.resume=true"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "optim.lr: 0.01 -> 0.005" in log and "train.max_steps: 4 -> 6" in log
    after = (run_dir / "metrics.jsonl").read_text()
    assert after.startswith(before)  # appended
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


def test_warm_start_with_a_reduced_draft_vocabulary(reference, assets):
    """train.init_from + drafter.draft_vocab_size: the run starts from the reference export (its first eval is
    already as good as the reference's last one) and exports a drafter that only drafts its vocabulary."""
    run_train(
        assets, "warm", f"train.init_from={reference / 'export'}", "drafter.draft_vocab_size=24",
        "train.max_steps=4", "train.eval_every=2", "train.ckpt_every=4", "optim.lr=1e-3",
        "train.eval_at_start=true",
    )  # fmt: skip
    warm = [r for r in read_metrics(assets / "runs" / "warm") if "eval/acc1_s0" in r]
    ref = [r for r in read_metrics(reference) if "eval/acc1_s0" in r]
    assert [r["step"] for r in warm] == [0, 2, 4]  # the baseline before the first step, then every 2 steps
    assert warm[0]["eval/acc1_s0"] > ref[0]["eval/acc1_s0"]
    assert warm[0]["eval/acc1_s0"] > ref[-1]["eval/acc1_s0"] - 0.1
    drafter = load_drafter(str(assets / "runs" / "warm" / "export"), target=tiny_llama())
    assert drafter.config.draft_vocab_size == 24 and drafter.head.weight.shape[0] == 24
    beams, _ = drafter.beam_search(torch.randn(32), 7, beam_width=4, draft_len=3)
    assert set(beams[:, 1:].flatten().tolist()) <= set(drafter.draft_ids().tolist())
    card = (assets / "runs" / "warm" / "export" / "README.md").read_text()
    assert "draft vocabulary: the 24 most frequent" in card and f"warm-started from: {reference}" in card


def test_target_layers_train_online_export_and_decode_losslessly(assets):
    """drafter.target_layers: the loop asks the target for the extra layer (no distill cache here), the export
    records it, and the eval decoder feeds it back: greedy speculative output equals the target's own."""
    from specdraft.eval.proposers import ReDrafterProposer

    run_train(
        assets, "layers", "drafter.target_layers=[1]", "drafter.exit_dim=32", "train.max_steps=4",
        "train.eval_every=2", "train.ckpt_every=4",
    )  # fmt: skip
    evals = [r for r in read_metrics(assets / "runs" / "layers") if "eval/acc1_s0" in r]
    assert [r["step"] for r in evals] == [2, 4]
    target = tiny_llama()
    drafter = load_drafter(str(assets / "runs" / "layers" / "export"), target=target)
    assert drafter.config.target_layers == [1] and drafter.input_proj.weight.shape == (32, 32 + 2 * 32)
    proposer = ReDrafterProposer(drafter, beam_width=4, beam_length=4)
    assert_lossless(target, proposer, torch.arange(5, 17))


def test_prefix_attention_warm_starts_exactly_trains_and_decodes_losslessly(reference, assets):
    """drafter.context_heads on top of an export without it: the first eval is the export's own (the attention's
    output starts at zero), training moves it, and the export decodes with the grown memory losslessly."""
    from specdraft.eval.proposers import make_proposer

    run_train(
        assets, "ctx", f"train.init_from={reference / 'export'}", "drafter.context_heads=2",
        "drafter.context_dim=8", "train.max_steps=4", "train.eval_every=4", "train.ckpt_every=4",
        "optim.lr=1e-3", "train.eval_at_start=true",
    )  # fmt: skip
    warm = [r for r in read_metrics(assets / "runs" / "ctx") if "eval/loss" in r]
    ref = [r for r in read_metrics(reference) if "eval/loss" in r]
    assert [r["step"] for r in warm] == [0, 4]
    assert warm[0]["eval/loss"] == pytest.approx(ref[-1]["eval/loss"], rel=1e-4)
    assert warm[1]["eval/loss"] != warm[0]["eval/loss"]
    target = tiny_llama()
    drafter = load_drafter(str(assets / "runs" / "ctx" / "export"), target=target)
    assert drafter.config.context_heads == 2 and float(drafter.ctx.out.weight.detach().abs().sum()) > 0
    proposer = make_proposer(drafter)
    assert proposer.uses_context
    assert_lossless(target, proposer, torch.arange(5, 17))


def test_copy_gate_warm_starts_trains_and_decodes_losslessly(reference, assets):
    """drafter.copy_ngram on top of an export without it: the run starts, training moves the gate, and the export
    decodes with the grown n-gram index losslessly."""
    from specdraft.eval.proposers import make_proposer

    run_train(
        assets, "copy", f"train.init_from={reference / 'export'}", "drafter.copy_ngram=3",
        "drafter.copy_hidden=8", "train.max_steps=4", "train.eval_every=4", "train.ckpt_every=4",
        "optim.lr=1e-2", "train.eval_at_start=true",
    )  # fmt: skip
    warm = [r for r in read_metrics(assets / "runs" / "copy") if "eval/loss" in r]
    assert [r["step"] for r in warm] == [0, 4]
    assert warm[1]["eval/loss"] != warm[0]["eval/loss"]
    target = tiny_llama()
    drafter = load_drafter(str(assets / "runs" / "copy" / "export"), target=target)
    assert drafter.config.copy_ngram == 3 and float(drafter.copy_gate.length_bias.detach().abs().sum()) > 0
    proposer = make_proposer(drafter)
    assert proposer.copy_ngram == 3
    assert_lossless(target, proposer, torch.tensor([5, 6, 7, 5, 6, 7, 5, 6]))


def test_medusa_root_token_warm_starts_exactly_trains_and_decodes_losslessly(assets):
    """drafter.root_token on top of plain Medusa heads: the first eval is the plain export's (the root projection
    starts at zero), training moves the projection, and the export decodes losslessly with each step's root."""
    from specdraft.eval.proposers import make_proposer

    run_train(
        assets, "medusa", "drafter=medusa", "train.max_steps=4", "train.eval_every=4", "train.ckpt_every=4",
    )  # fmt: skip
    plain = assets / "runs" / "medusa"
    run_train(
        assets, "medusa_root", "drafter=medusa", "drafter.root_token=true", f"train.init_from={plain / 'export'}",
        "train.max_steps=4", "train.eval_every=4", "train.ckpt_every=4", "optim.lr=1e-2",
        "train.eval_at_start=true",
    )  # fmt: skip
    warm = [r for r in read_metrics(assets / "runs" / "medusa_root") if "eval/loss" in r]
    ref = [r for r in read_metrics(plain) if "eval/loss" in r]
    assert [r["step"] for r in warm] == [0, 4]
    assert warm[0]["eval/loss"] == pytest.approx(ref[-1]["eval/loss"], rel=1e-4)
    assert warm[1]["eval/loss"] != warm[0]["eval/loss"]
    target = tiny_llama()
    drafter = load_drafter(str(assets / "runs" / "medusa_root" / "export"), target=target)
    assert drafter.config.root_token and float(drafter.root_input.proj.weight.detach().abs().sum()) > 0
    assert_lossless(target, make_proposer(drafter, tree_nodes=12), torch.arange(5, 17))
