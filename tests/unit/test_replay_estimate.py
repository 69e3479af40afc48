"""`train.eval_replay_rows`: the training-time estimate from the decoder's own proposer (`replay_estimate`) equals
what the static decoder serves on greedy rows, for every family; the loop refuses rows that are not the
target's greedy output."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from specdraft.eval import proposers
from specdraft.eval.decode import ar_generate
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.testing import OracleBeamProposer, tiny_proposer, tiny_target
from specdraft.train.evaluate import decoder_features, greedy_span, replay_estimate
from specdraft.train.loop import replay_rows_for


def _rows(target: torch.nn.Module, new: int = 30) -> list[dict]:
    """Two rows (prompts of 9 and 4 tokens) whose responses are the target's greedy output, then 3 tokens of
    a next turn (not trained: loss_mask 0)."""
    rows = []
    for n in (9, 4):
        prompt = torch.randint(5, 128, (n,), generator=torch.Generator().manual_seed(n))
        out, _ = ar_generate(target, None, prompt, new, stop_ids=set())
        ids = prompt.tolist() + out + [7, 8, 9]
        rows.append({"input_ids": ids, "loss_mask": [0] * n + [1] * new + [0] * 3})
    return rows


def _served(target: torch.nn.Module, rows: list[dict], fresh, new: int, stop: set[int]) -> list[int]:
    """Accepted drafts per step of the static decoder on each row's prompt."""
    dec, accepted = StaticDecoder(target, 128), []
    for row in rows:
        start = row["loss_mask"].index(1)
        out, stats = dec.speculative_generate(
            None, torch.tensor(row["input_ids"][:start]), fresh(), new, stop_ids=stop
        )
        assert out == row["input_ids"][start : start + len(out)]  # the row is what the decoder serves
        accepted += stats.accepted
    return accepted


@pytest.mark.parametrize("family", ["redrafter_copy", "medusa_root", "eagle", "eagle3"])
def test_replay_estimate_is_what_the_decoder_serves(family: str) -> None:
    target = tiny_target()
    rows = _rows(target)
    stop = {rows[0]["input_ids"][9 + 20]}  # a stop token on the way in the first row
    drafter = tiny_proposer(family, target).drafter
    drafter.train()
    est = replay_estimate(drafter, target, rows, 24, stop)
    assert drafter.training  # the caller's mode is restored
    served = _served(target, rows, lambda: make_proposer(drafter), 24, stop)
    assert est["eval/replay_steps"] == len(served)
    assert est["eval/replay_accept_len"] == pytest.approx(1.0 + sum(served) / len(served), abs=1e-12)


def test_replay_estimate_follows_long_accepted_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """An oracle proposer (the true continuation among its beams) accepts long paths: the replay counts them
    step for step as the decoder does (a start, stop or row-end mistake would shift them)."""
    target = tiny_target()
    row = _rows(target)[0]
    ref = row["input_ids"][9:39]
    monkeypatch.setattr(proposers, "make_proposer", lambda model: OracleBeamProposer(ref, 9, vocab=128))
    model = torch.nn.Linear(2, 2).double()  # only its parameters' device and dtype are read
    est = replay_estimate(model, target, [row], 24, set())  # the row's 30 tokens cover the last step's drafts
    served = _served(target, [row], lambda: OracleBeamProposer(ref, 9, vocab=128), 24, set())
    assert sum(served) > len(served)  # long paths were exercised
    assert est["eval/replay_accept_len"] == pytest.approx(1.0 + sum(served) / len(served), abs=1e-12)
    assert est["eval/replay_steps"] == len(served)


def test_greedy_span_is_the_first_run_of_trained_tokens() -> None:
    assert greedy_span([0, 0, 1, 1, 1, 0, 0, 1, 1]) == (2, 5)  # a second turn is not the first response
    assert greedy_span([0, 1, 1]) == (1, 3)
    assert greedy_span([0, 0]) is None and greedy_span([]) is None


def test_replay_stops_where_distill_stopped_vouching() -> None:
    """A masked tail (distill zeroes a turn from a retokenisation mismatch on) is not replayed: the estimate is
    the same as on the row cut there, whatever tokens follow."""
    target = tiny_target()
    row = _rows(target)[0]
    cut = {"input_ids": row["input_ids"][:20], "loss_mask": [0] * 9 + [1] * 11}
    tail = {"input_ids": cut["input_ids"] + [5] * 19, "loss_mask": cut["loss_mask"] + [0] * 19}
    drafter = tiny_proposer("eagle", target).drafter
    assert replay_estimate(drafter, target, [tail], 30) == replay_estimate(drafter, target, [cut], 30)
    served = _served(target, [cut], lambda: make_proposer(drafter), 11, set())
    assert replay_estimate(drafter, target, [tail], 30)["eval/replay_steps"] == len(served)


def test_decoder_features_layout() -> None:
    """No layers: the last hidden state; layers: flattened, after the last hidden state when kept."""
    target = tiny_target()
    ids = torch.arange(5, 12)
    last = decoder_features(target, ids, (), False)
    both = decoder_features(target, ids, (1, 2), True)
    only = decoder_features(target, ids, (1, 2), False)
    assert last.shape == (7, 32) and both.shape == (7, 96) and only.shape == (7, 64)
    assert torch.equal(both[:, :32], last) and torch.equal(both[:, 32:], only)


def _cfg(tmp_path, n: int = 2, data_dir: str | None = "d", val_dir: str | None = None):
    return OmegaConf.create(
        {
            "train": {
                "eval_replay_rows": n,
                "data_dir": data_dir and str(tmp_path / data_dir),
                "val_data_dir": val_dir,
            }
        }
    )


def test_replay_rows_for_takes_the_first_held_out_rows(tmp_path) -> None:
    rows = [{"input_ids": [i, 1], "loss_mask": [0, 1], "hidden": [[0.0]]} for i in range(5)]
    greedy = {"generation": {"regenerate": True, "do_sample": False}}
    assert replay_rows_for(_cfg(tmp_path, 0), rows, greedy) == []
    assert replay_rows_for(_cfg(tmp_path, 2), rows, greedy) == [
        {"input_ids": [0, 1], "loss_mask": [0, 1]},
        {"input_ids": [1, 1], "loss_mask": [0, 1]},
    ]
    assert len(replay_rows_for(_cfg(tmp_path, 9), rows, greedy)) == 5


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        (None, "train.eval_replay_rows=2 replays greedy self-distilled rows but train.data_dir is not set"),
        ({"generation": {"regenerate": False, "do_sample": False}}, "holds the conversations' own responses"),
        ({"generation": {"regenerate": True, "do_sample": True}}, "holds sampled responses"),
    ],
)
def test_replay_rows_for_refuses_rows_that_are_not_greedy(tmp_path, manifest, expected: str) -> None:
    cfg = _cfg(tmp_path, 2, None if manifest is None else "d")
    with pytest.raises(ValueError) as err:
        replay_rows_for(cfg, [{"input_ids": [1], "loss_mask": [1]}], manifest)
    assert expected in str(err.value) and "train.eval_replay_rows=0" in str(err.value)
    assert "\n" not in str(err.value)


def test_replay_rows_for_reads_the_val_data_dirs_manifest(tmp_path) -> None:
    """Held-out rows from `train.val_data_dir` are judged by that set's manifest, not the training set's."""
    import json

    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "manifest.json").write_text(json.dumps({"generation": {"regenerate": False}}))
    greedy = {"generation": {"regenerate": True, "do_sample": False}}
    with pytest.raises(ValueError, match="v holds the conversations' own responses"):
        replay_rows_for(
            _cfg(tmp_path, 2, "d", str(tmp_path / "v")), [{"input_ids": [1], "loss_mask": [1]}], greedy
        )
