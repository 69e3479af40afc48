"""`train.eval_replay_rows` through the real entry points: distill a tiny target greedily, train on it, and the
logged `eval/replay_accept_len` is the export's replay on the same held-out rows; raw conversations are refused
before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from specdraft.conf.schema import register_configs
from specdraft.data.conversations import split_indices
from specdraft.distill.run import distill
from specdraft.distill.shards import load_distilled
from specdraft.eval.decode import default_stop_ids
from specdraft.models.hub import load_drafter
from specdraft.testing import run_tiny_train, tiny_llama, write_train_assets
from specdraft.train.evaluate import replay_estimate
from specdraft.train.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny train assets and their greedy self-distilled set (`assets/distilled`)."""
    root = write_train_assets(tmp_path_factory.mktemp("replay_assets"), num_convs=40)
    register_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"base_model.name_or_path={root / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
                f"data.source={root / 'convs.jsonl'}", "data.num_samples=null", "data.max_length=96",
                f"distill.out_dir={root / 'distilled'}", "distill.num_samples=null", "distill.max_new_tokens=24",
                "distill.max_turns=1", "distill.shard_size=20",
            ],
        )  # fmt: skip
    distill(cfg)
    return root


def test_the_logged_replay_is_the_exports_replay(assets: Path) -> None:
    proc = run_tiny_train(
        REPO, assets, assets / "runs", "replay", f"train.data_dir={assets / 'distilled'}",
        "train.max_steps=6", "train.eval_every=3", "train.eval_batches=1", "train.ckpt_every=6",
        "train.eval_replay_rows=3", "train.eval_replay_tokens=16", "optim.lr=1e-2", "optim.warmup_steps=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(assets / "runs" / "replay") if "eval/replay_accept_len" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert "replay_accept_len=" in (assets / "runs" / "replay" / "train.log").read_text()  # with the others

    target = tiny_llama()
    tok = AutoTokenizer.from_pretrained(assets / "target")
    ds, _ = load_distilled(assets / "distilled")
    _, val = split_indices(list(ds["id"]), 0.125, 0)  # run_tiny_train's data.val_fraction, data.seed 0
    rows = [ds[i] for i in val[:3]]
    drafter = load_drafter(str(assets / "runs" / "replay" / "export"), target=target)
    torch.set_num_threads(1)  # as the training process (OMP_NUM_THREADS=1)
    est = replay_estimate(drafter, target, rows, 16, default_stop_ids(tok, target))
    assert est["eval/replay_steps"] == evals[-1]["eval/replay_steps"] > 0
    assert est["eval/replay_accept_len"] == pytest.approx(evals[-1]["eval/replay_accept_len"], abs=1e-9)


def test_raw_conversations_are_refused_before_training(assets: Path) -> None:
    proc = run_tiny_train(
        REPO, assets, assets / "runs", "raw", "train.eval_replay_rows=2", "train.max_steps=2"
    )
    assert proc.returncode != 0
    assert (
        "train.eval_replay_rows=2 replays greedy self-distilled rows but train.data_dir is not set"
        in proc.stderr
    )
    assert not (assets / "runs" / "raw" / "checkpoints").exists()


def test_the_benchmark_probe_is_logged_and_cached(assets: Path) -> None:
    """`train.eval_bench_rows`: MT-Bench first turns answered by the target, replayed at each evaluation; the
    answers are cached in the run dir with their key, and the logged value is the export's replay on them."""
    from specdraft.train.bench_probe import bench_rows

    proc = run_tiny_train(
        REPO, assets, assets / "runs", "probe", f"train.data_dir={assets / 'distilled'}",
        "train.max_steps=4", "train.eval_every=4", "train.eval_batches=1", "train.ckpt_every=4",
        "train.eval_bench_rows=3", "train.eval_replay_tokens=12", "optim.lr=1e-2", "optim.warmup_steps=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = assets / "runs" / "probe"
    evals = [r for r in read_metrics(run) if "eval/bench_replay_accept_len" in r]
    assert [r["step"] for r in evals] == [4]
    assert not any("eval/replay_accept_len" in r for r in read_metrics(run))  # the held-out replay stays off
    assert "bench_replay_accept_len=" in (run / "train.log").read_text()

    target = tiny_llama()
    tok = AutoTokenizer.from_pretrained(assets / "target")
    stop = default_stop_ids(tok, target)
    torch.set_num_threads(1)
    cache = run / "bench_rows.json"
    held = json.loads(cache.read_text())
    fresh = bench_rows(target, tok, "mt_bench", 3, 12, stop)  # generated again, no cache
    assert held["rows"] == fresh and len(fresh) == 3
    assert held["bench"] == "mt_bench" and len(held["key"]) == 16  # (the key: tests/unit/test_bench_probe.py)
    drafter = load_drafter(str(run / "export"), target=target)
    est = replay_estimate(drafter, target, fresh, 12, stop, prefix="eval/bench_replay")
    assert est["eval/bench_replay_steps"] == evals[-1]["eval/bench_replay_steps"] > 0
    assert est["eval/bench_replay_accept_len"] == pytest.approx(
        evals[-1]["eval/bench_replay_accept_len"], abs=1e-9
    )
