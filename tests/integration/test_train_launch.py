"""Real multi-process launches on CPU (slow): DDP over gloo, and DeepSpeed ZeRO-2 when DeepSpeed is installed.

ZeRO-2 shards optimizer state and gradients but does the same maths, so both runs must log the same numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.logging import read_metrics

REPO = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "omega"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("launch_assets")
    tiny_llama().save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    rng = random.Random(1)
    with (root / "convs.jsonl").open("w") as f:
        for i in range(40):
            q, a = (" ".join(rng.choice(WORDS) for _ in range(n)) for n in (3, 6))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return root


def launch(assets: Path, config: str, name: str) -> Path:
    args = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"scripts/accelerate/{config}",
        "train.py", f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32",
        "base_model.device=cpu", f"data.source={assets / 'convs.jsonl'}", "data.num_samples=null",
        "data.val_fraction=0.1", "data.max_length=96", f"output_root={assets / 'runs'}", f"name={name}",
        "drafter.draft_len=3", "drafter.init_from_lm_head=false", "optim.lr=1e-2", "optim.warmup_steps=2",
        "train.max_steps=6", "train.batch_size=4", "train.eval_every=3", "train.eval_batches=2",
        "train.ckpt_every=3", "train.log_every=1", "train.progress=false", "logger.tensorboard=false",
    ]  # fmt: skip
    # CPU processes, as the test means, also on a CUDA host (2 ranks cannot share one GPU over NCCL)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 process(es)" in proc.stderr + proc.stdout
    return assets / "runs" / name


@pytest.mark.slow
def test_ddp_and_deepspeed_zero2_on_cpu_agree(assets):
    ddp = launch(assets, "cpu_ddp.yaml", "ddp")
    assert (ddp / "export" / "model.safetensors").is_file()
    ref = {
        (r["step"], k): v
        for r in read_metrics(ddp)
        for k, v in r.items()
        if k.startswith(("train/loss", "eval/"))
    }
    assert any(k[1] == "eval/acc1_mean" for k in ref)
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install deepspeed): only the DDP launch ran")
    ds = launch(assets, "ds_zero2_cpu.yaml", "ds")
    assert (ds / "checkpoints" / "step-00000006" / "pytorch_model").is_dir()  # a DeepSpeed checkpoint
    got = {
        (r["step"], k): v
        for r in read_metrics(ds)
        for k, v in r.items()
        if k.startswith(("train/loss", "eval/"))
    }
    assert got.keys() == ref.keys()
    for key, v in ref.items():
        assert got[key] == pytest.approx(v, rel=1e-4, abs=1e-5), key
