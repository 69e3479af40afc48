"""Medusa heads in the checkpoint layout vLLM's Medusa drafter loads (`MedusaModel`), and back.

Our HF folder (`models/hub.py`) names the heads as the trainer builds them; vLLM (`vllm/model_executor/models/
medusa.py`, config class `transformers_utils/configs/medusa.py`) reads a folder with a `config.json` of
`model_type: medusa` and these tensors:

    ours (K heads, n ResBlocks each)             vLLM
    heads.{k}.{i}.linear.weight (H, H), .bias    blocks.{k}.layers.{i}.weight, .bias    (medusa_fc_bias: true)
    heads.{k}.{n}.weight (Vd, H)                 lm_heads.{k}.weight (Vd, H)
    d2t (Vd,) draft id -> target id offsets      token_map (Vd,) the target ids          (truncated_vocab_size: Vd)

Both compute head k as W_k (x + SiLU(A x + b))^n on the target's last normed hidden state, and predict the token
after the next one plus k (vLLM's head 0 drafts the first token after the one the target just sampled). vLLM
scatters a truncated head's logits into the full vocabulary through `token_map`; a full-vocabulary export writes
neither `token_map` nor a smaller `truncated_vocab_size`. Heads that read the root token (`root_token`,
`models/medusa_root.py`) or draft through a copy gate (`copy_ngram`, `models/medusa_copy.py`) have no counterpart
there and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdraft.models.hub import tensor_problems
from specdraft.models.medusa import Medusa, MedusaConfig
from specdraft.utils import atomic_dir

ARCH = "MedusaModel"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def engine_config(model: Medusa, dtype: str) -> dict[str, Any]:
    """vLLM's `MedusaConfig` fields for `model` (the identity of its target kept under `specdraft`)."""
    cfg = cast(MedusaConfig, model.config)
    vd = int(cast(int, cfg.draft_vocab_size))
    return {
        "architectures": [ARCH],
        "model_type": "medusa",
        "hidden_size": int(cfg.base_hidden_size),
        "vocab_size": int(cfg.vocab_size),
        "truncated_vocab_size": vd,
        "num_heads": int(cfg.draft_len),
        "num_hidden_layers": int(cfg.num_layers),
        "medusa_fc_bias": True,
        "topk": int(cfg.topk),
        "torch_dtype": dtype,
        "specdraft": {  # not read by vLLM: what a reader needs to check the target
            "base_model_name_or_path": cfg.base_model_name_or_path,
            "base_revision": cfg.base_revision,
            "tokenizer_hash": cfg.tokenizer_hash,
        },
    }


def required_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor name -> shape a Medusa engine folder with `config` must hold."""
    h, k, n = int(config["hidden_size"]), int(config["num_heads"]), int(config["num_hidden_layers"])
    v = int(config["vocab_size"])
    vd = int(config.get("truncated_vocab_size") or v)
    shapes: dict[str, tuple[int, ...]] = {}
    for head in range(k):
        for i in range(n):
            shapes[f"blocks.{head}.layers.{i}.weight"] = (h, h)
            if config.get("medusa_fc_bias", False):
                shapes[f"blocks.{head}.layers.{i}.bias"] = (h,)
        shapes[f"lm_heads.{head}.weight"] = (vd, h)
    if vd < v:
        shapes["token_map"] = (vd,)
    return shapes


def check_engine_layout(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    """Problems of a (config, tensors) pair: wrong model type, missing, misshapen or unexpected tensors, a
    token map outside the vocabulary."""
    if config.get("model_type") != "medusa":
        return [f"model_type {config.get('model_type')!r} is not 'medusa'"]
    errs = tensor_problems(required_tensors(config), tensors)
    tm = tensors.get("token_map")
    if tm is not None and tm.numel() and not 0 <= int(tm.min()) <= int(tm.max()) < int(config["vocab_size"]):
        errs.append(f"token_map ids outside [0, vocab_size={config['vocab_size']})")
    return errs


def engine_tensors(model: Medusa, dtype: str = "float16") -> dict[str, Tensor]:
    """Our heads' weights under vLLM's names, in `dtype` (the token map as int64 target ids)."""
    cfg = cast(MedusaConfig, model.config)
    if cfg.root_token:
        raise ValueError(
            "these Medusa heads read the root token (drafter.root_token=true, models/medusa_root.py); vLLM's "
            "Medusa heads read only the hidden state: export heads trained with root_token=false"
        )
    if int(cfg.copy_ngram or 0) > 0:
        raise ValueError(
            "these Medusa heads draft through a copy gate (drafter.copy_ngram > 0, models/medusa_copy.py); vLLM's "
            "Medusa heads run alone: export heads trained with copy_ngram=0"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    out: dict[str, Tensor] = {}
    n = int(cfg.num_layers)
    for k, head in enumerate(model.heads):
        seq = cast(nn.Sequential, head)
        for i in range(n):
            lin = cast(nn.Linear, cast(Any, seq[i]).linear)
            out[f"blocks.{k}.layers.{i}.weight"] = lin.weight
            out[f"blocks.{k}.layers.{i}.bias"] = (
                lin.bias if lin.bias is not None else torch.zeros(lin.out_features)
            )
        out[f"lm_heads.{k}.weight"] = cast(nn.Linear, seq[n]).weight
    tensors = {k: v.detach().to(DTYPES[dtype]).cpu().contiguous() for k, v in out.items()}
    if model.reduced_vocab:
        tensors["token_map"] = model.draft_ids().detach().to(torch.long).cpu().contiguous()  # (Vd,)
    return tensors


def export_engine_layout(model: Medusa, out_dir: str | Path, dtype: str = "float16") -> Path:
    """Write `config.json` + `model.safetensors` in vLLM's Medusa layout (atomic, replacing an older export).

    Args:
        model: Medusa heads without `root_token`.
        out_dir: destination folder.
        dtype: float16 | bfloat16 | float32 for the weights and `torch_dtype`.

    Returns:
        the folder path.
    """
    tensors = engine_tensors(model, dtype)
    cfg = engine_config(model, dtype)
    errs = check_engine_layout(cfg, tensors)
    if errs:  # a bug here, not the user's input
        raise ValueError("Medusa engine layout is inconsistent: " + "; ".join(errs))
    out = Path(out_dir)
    with atomic_dir(out, overwrite=True) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def read_engine_layout(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, tensors) of a Medusa engine folder."""
    root = Path(path)
    cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
    return cfg, load_file(str(root / "model.safetensors"))


def engine_logits(config: dict[str, Any], tensors: dict[str, Tensor], hidden: Tensor) -> Tensor:
    """What vLLM's Medusa computes from an engine folder, in fp32: hidden (N, H) -> (N, K, V) logits over the
    target vocabulary (-inf outside a truncated head's token map). The reference the export is checked
    against."""
    k, n = int(config["num_heads"]), int(config["num_hidden_layers"])
    v = int(config["vocab_size"])
    tm = tensors.get("token_map")
    x0 = hidden.float()
    heads = []
    for head in range(k):
        x = x0
        for i in range(n):  # vLLM's ResidualBlock: x = x + SiLU(layer(x))
            w = tensors[f"blocks.{head}.layers.{i}.weight"].float()
            b = tensors.get(f"blocks.{head}.layers.{i}.bias")
            x = x + torch.nn.functional.silu(
                torch.nn.functional.linear(x, w, None if b is None else b.float())
            )
        logits = x @ tensors[f"lm_heads.{head}.weight"].float().T  # (N, Vd)
        if tm is not None:
            full = torch.full((x.shape[0], v), float("-inf"))
            full[:, tm] = logits
            logits = full
        heads.append(logits)
    return torch.stack(heads, dim=1)  # (N, K, V)


def export_from_folder(src: str | Path, dst: str | Path, dtype: str = "float16") -> Path:
    """Convert our HF export folder (`models/hub.py`) of Medusa heads to vLLM's layout (no target needed)."""
    from specdraft.models.hub import load_drafter

    model = load_drafter(str(src))
    if not isinstance(model, Medusa):
        raise ValueError(f"{src}: not Medusa heads ({type(model).__name__})")
    return export_engine_layout(model, dst, dtype)
