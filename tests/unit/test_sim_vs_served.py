"""Simulated decoding (`train.evaluate.replay_decode`, scripts/sim_vs_served.py): the helpers, and replay ==
served step for step on a tiny fp64 target whose greedy output is the row."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specdraft.eval.decode import ar_generate
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree
from specdraft.models import eagle
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import OracleBeamProposer, tiny_target
from specdraft.train.evaluate import greedy_accepted, pearson, replay_decode


def test_pearson_golden_values() -> None:
    assert pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert pearson([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert pearson([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(0.8)
    assert math.isnan(pearson([1.0], [2.0])) and math.isnan(pearson([1.0, 1.0], [2.0, 3.0]))
    with pytest.raises(ValueError):
        pearson([1.0], [1.0, 2.0])


def test_greedy_accepted_takes_the_deepest_matching_path() -> None:
    #      0 (root)
    #     / \
    #    1:7  2:5
    #    |     \
    #   3:8    4:6 - 5:9
    tree = DraftTree(torch.tensor([4, 7, 5, 8, 6, 9]), torch.tensor([-1, 0, 0, 1, 2, 4]))
    assert greedy_accepted(tree, torch.tensor([5, 6, 9, 1])) == 3
    assert greedy_accepted(tree, torch.tensor([5, 6, 2])) == 2
    assert greedy_accepted(tree, torch.tensor([7, 8])) == 2
    assert greedy_accepted(tree, torch.tensor([5])) == 1  # the row ends: deeper nodes cannot be judged
    assert greedy_accepted(tree, torch.tensor([1, 2])) == 0


def _eagle(target: torch.nn.Module):
    fp = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
    schema = SimpleNamespace(
        draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
        token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=None, ttt_decay=0.8,
    )  # fmt: skip
    torch.manual_seed(0)
    return make_proposer(eagle.build(schema, target, fp).double().eval(), tree_nodes=10)


@pytest.mark.parametrize("proposer", ["oracle", "eagle"])
def test_replay_equals_served_on_the_targets_own_greedy_row(proposer: str) -> None:
    target = tiny_target()
    prompt = torch.randint(5, 128, (9,), generator=torch.Generator().manual_seed(3))
    out, _ = ar_generate(target, None, prompt, 40, stop_ids=set())
    row = torch.cat([prompt, torch.tensor(out)])  # (9 + 40,) prompt, then the target's greedy response
    stop = {out[30]}  # a stop token hit on the way, as in a finished conversation

    def fresh():
        return OracleBeamProposer(out, len(prompt), vocab=128) if proposer == "oracle" else _eagle(target)

    served_out, stats = StaticDecoder(target, 128).speculative_generate(
        None, prompt, fresh(), 36, stop_ids=stop
    )
    feats = forward_with_hidden(target, row[None], logits=False).hidden[0]  # (L, H)
    sim = replay_decode(fresh(), feats, row, len(prompt), 36, stop)
    assert served_out == out[: len(served_out)]
    assert sim == stats.accepted  # step for step
    if proposer == "oracle":
        assert sum(sim) > len(sim)  # long accepted paths were exercised


def test_logged_replay_is_read_for_exports_and_checkpoints(tmp_path) -> None:
    """The "logged replay" column: an export's final eval, a checkpoint's eval at its own step; None where the
    run did not replay."""
    import json
    from pathlib import Path

    from specdraft.testing import load_script

    mod = load_script(Path(__file__).resolve().parents[2] / "scripts" / "sim_vs_served.py")
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    summary = {"final_eval": {"eval/replay_accept_len": 2.5}}
    (run / "export" / "config.json").write_text(json.dumps({"training_summary": summary}))
    records = [
        {"step": 10, "eval/loss": 1.0, "eval/replay_accept_len": 1.75},
        {"step": 10, "train/loss": 1.0},
        {"step": 20, "eval/replay_accept_len": 2.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in (10, 15):
        ckpt = run / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(
            json.dumps({"step": step, "config": {"run_dir": str(run), "train": {}}})
        )
    assert mod.logged_replay(run / "export") == 2.5
    assert mod.logged_replay(run / "checkpoints" / "step-00000010") == 1.75
    assert mod.logged_replay(run / "checkpoints" / "step-00000015") is None  # no eval at that step
    (run / "export" / "config.json").write_text(json.dumps({"training_summary": {"final_eval": {}}}))
    assert mod.logged_replay(run / "export") is None


def test_the_held_out_split_is_the_one_the_runs_recorded(tmp_path, capsys) -> None:
    """Held-out rows are those the exports never trained on: the split an export recorded (or a checkpoint's
    config) unless the flags say otherwise; runs of different splits are refused; unrecorded ones say the
    default they get."""
    import json
    from pathlib import Path

    from specdraft.testing import load_script

    mod = load_script(Path(__file__).resolve().parents[2] / "scripts" / "sim_vs_served.py")
    a, b, old, ckpt = (tmp_path / n for n in ("a", "b", "old", "ckpt"))
    for d in (a, b, old, ckpt):
        d.mkdir()
    (a / "config.json").write_text(
        json.dumps({"training_summary": {"split": {"val_fraction": 0.04, "seed": 0}}})
    )
    (b / "config.json").write_text(
        json.dumps({"training_summary": {"split": {"val_fraction": 0.1, "seed": 3}}})
    )
    (old / "config.json").write_text(json.dumps({"training_summary": {}}))
    (ckpt / "meta.json").write_text(json.dumps({"config": {"data": {"val_fraction": 0.04, "seed": 0}}}))
    assert mod.held_out_split([a, ckpt, old], None, None) == (0.04, 0)
    assert mod.held_out_split([a], 0.2, None) == (0.2, 0)
    with pytest.raises(ValueError, match="different held-out splits"):
        mod.held_out_split([a, b], None, None)
    assert mod.held_out_split([a, b], 0.04, 0) == (0.04, 0)
    assert mod.held_out_split([old], None, None) == (0.05, 0)
    assert "did not record their split" in capsys.readouterr().out
