"""Response-length predictor (eval/length_predictor.py, scripts/train_length_predictor.py): bucket edges, shapes
of every signal's features on a tiny target, a probe that learns a separable toy task, the accuracy report,
the save/load round trip, one clear error for a bad predictor file, and the script's one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.eval.length_predictor import (
    accuracy_report,
    bucket_names,
    bucketize,
    fit_length_predictor,
    load_length_predictor,
    prompt_features,
)
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import load_script, tiny_target

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_length_predictor.py"


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _toy(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Features (n, 5) whose first column decides the length: bucket = floor(x0 * 4) of a uniform x0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 5, generator=g, dtype=torch.float64)
    lengths = [int(v) for v in (x[:, 0] * 160)]  # buckets [0,32) [32,64) [64,128) [128,inf) by x0
    return x, lengths


def test_bucketize_and_names() -> None:
    assert bucketize([0, 31, 32, 63, 64, 127, 128, 500], (32, 64, 128)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert bucket_names((32, 64)) == ["[0,32)", "[32,64)", "[64,inf)"]


def test_prompt_features_shapes_and_values() -> None:
    model = tiny_target()
    prompts = [[5, 6, 7], [9] * 11]
    lens = torch.log1p(torch.tensor([3.0, 11.0]))
    f = prompt_features(model, prompts, "length")
    assert f.shape == (2, 1) and f.dtype == torch.float32 and torch.allclose(f[:, 0], lens)
    e = prompt_features(model, prompts, "embed")
    assert e.shape == (2, 33)
    emb = model.get_input_embeddings().weight
    assert torch.allclose(e[0, :32], emb[[5, 6, 7]].mean(0).float())
    h = prompt_features(model, prompts, "hidden")
    ref = forward_with_hidden(model, torch.tensor([prompts[1]]), logits=False).hidden[0, -1]
    assert h.shape == (2, 33) and torch.allclose(h[1, :32], ref.float(), atol=1e-6)
    with pytest.raises(ValueError, match="signal='bogus'"):
        prompt_features(model, prompts, "bogus")
    with pytest.raises(ValueError, match="empty prompt"):
        prompt_features(model, [[]], "length")


def test_fit_learns_a_separable_task_and_reports_accuracy() -> None:
    x, lengths = _toy()
    pred = fit_length_predictor(x[:150], lengths[:150], "embed", (32, 64, 128), weight_decay=1e-4)
    assert pred.num_buckets == 4 and pred.weight.shape == (4, 5) and pred.bucket_lengths.shape == (4,)
    logits = pred(x[150:])
    assert logits.shape == (50, 4)
    y = bucketize(lengths[150:], pred.edges)
    rep = accuracy_report(pred.predict_bucket(x[150:]), y, constant=3, num_buckets=4)
    assert rep["overall"] > 0.85 and rep["n"] == 50
    assert [b["n"] for b in rep["buckets"]] == torch.bincount(y, minlength=4).tolist()
    exp = pred.expected_length(x[150:])
    assert exp.shape == (50,) and bool((exp >= 0).all() and (exp <= 160).all())
    assert torch.corrcoef(torch.stack([exp, torch.tensor(lengths[150:], dtype=torch.float32)]))[0, 1] > 0.8


def test_accuracy_report_hand_case() -> None:
    rep = accuracy_report(torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 2]), constant=2, num_buckets=4)
    assert rep["overall"] == 0.75 and rep["constant_baseline"] == 0.5
    assert [b["accuracy"] for b in rep["buckets"]] == [1.0, 1.0, 0.5, None]


def test_save_load_round_trip(tmp_path: Path) -> None:
    x, lengths = _toy(80)
    pred = fit_length_predictor(x, lengths, "hidden", (32, 64, 128))
    pred.info = {"rows": 80, "note": "toy"}
    path = tmp_path / "sub" / "lp.safetensors"
    pred.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["lp.safetensors"]  # no temp file left behind
    back = load_length_predictor(path)
    assert (back.signal, back.edges, back.info) == ("hidden", (32, 64, 128), {"rows": 80, "note": "toy"})
    assert torch.equal(back(x), pred(x)) and torch.equal(back.bucket_lengths, pred.bucket_lengths)


def test_bad_predictor_files_fail_in_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="length predictor not found"):
        load_length_predictor(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_length_predictor(junk)
    other = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(ValueError, match="not a specdraft length predictor"):
        load_length_predictor(other)
    x, lengths = _toy(40)
    path = tmp_path / "lp.safetensors"
    fit_length_predictor(x, lengths, "length", (32, 64, 128)).save(path)
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        meta = json.loads(f.metadata()["specdraft_length_predictor"])
    save_file(
        tensors,
        str(path),
        metadata={"specdraft_length_predictor": json.dumps({**meta, "format_version": 99})},
    )
    with pytest.raises(ValueError, match="format_version=99"):
        load_length_predictor(path)


def _script():
    return load_script(SCRIPT)


def test_script_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    main = _script().main
    assert main(["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such folder" in err
    assert main(["--data", str(tmp_path), "--out", str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "manifest.json not found" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_script_trains_saves_and_records_its_command_and_machine(tmp_path: Path, monkeypatch) -> None:
    """The script's success path on a tiny target: the predictor file loads, and the JSON beside it carries the
    cross-validated table with the command, wall time and machine it was measured with."""
    mod = _script()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 90, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 40, (40,), generator=g)
    ]
    lengths = [len(p) * 4 for p in prompts]  # the prompt length decides the bucket
    monkeypatch.setattr(mod, "load_examples", lambda path: (prompts, lengths, {}))
    target = tiny_target()
    monkeypatch.setattr("specdraft.models.base_llm.load_target", lambda cfg: (target, None))
    out = tmp_path / "lp.safetensors"
    argv = ["--data", str(tmp_path), "--out", str(out), "--signal", "length", "--folds", "2"]
    assert mod.main(argv) == 0
    assert load_length_predictor(str(out)).signal == "length"
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["rows"] == 40 and record["cross_validation"]["length"]["n"] == 40
    assert record["command"] == " ".join(["python scripts/train_length_predictor.py", *argv])
    assert record["wall_s"] >= 0 and record["machine"]["device"] == "cpu" and "cpu_count" in record["machine"]
