"""EAGLE / EAGLE-3 heads in the checkpoint layout serving engines load, and back.

Besides our own HF folder (`models/hub.py`), `export_engine_layout` writes what the EAGLE reference code
(SafeAILab/EAGLE `EaModel`), vLLM (`EagleLlamaForCausalLM`, `Eagle3LlamaForCausalLM`) and SGLang
(`LlamaForCausalLMEagle3`) read: a Llama-style `config.json` with `num_hidden_layers: 1` and `model.safetensors`.

EAGLE-1 (as yuhuili/EAGLE-Vicuna-7B-v1.3)         EAGLE-3 (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)
  fc.weight (H, 2H), fc.bias (H)                    fc.weight (H, m*H)           midlayer.hidden_norm.weight (H)
  layers.0.self_attn.{q,k,v,o}_proj.weight          midlayer.self_attn.{q,k,v}_proj.weight (*, 2H), o_proj
  layers.0.mlp.{gate,up,down}_proj.weight           midlayer.mlp.*, midlayer.{input,post_attention}_layernorm
  layers.0.post_attention_layernorm.weight          norm.weight (H), lm_head.weight (Vd, H)
  (no input_layernorm: EAGLE-1 drops it)            d2t (Vd,) int64 target-draft offsets, t2d (V,) bool
  config: architectures [LlamaForCausalLM], bias    config: architectures [LlamaForCausalLMEagle3], draft_vocab_size,
                                                    eagle_config.eagle_aux_hidden_state_layer_ids
`embed_tokens.weight` is optional in both (engines share the target's); it is written only on request.
An EAGLE-3.1 head (`norm_fused`, models/eagle31.py) adds `fc_norm.{i}.weight` (H) per fused layer and the
config flags `fc_norm` and `norm_output` (both true), the engines' names for its two normalisations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import PreTrainedModel

from specdraft.utils import atomic_dir

EAGLE1_ARCH, EAGLE3_ARCH = "LlamaForCausalLM", "LlamaForCausalLMEagle3"
SPECDRAFT_ONLY = (
    "architecture",
    "format_version",
    "base_model_name_or_path",
    "base_revision",
    "base_hidden_size",
    "tokenizer_hash",
    "block_config",
    "training_summary",
    "feature_weight",
    "token_weight",
    "noise",
    "ttt_decay",
    "target_layers",
    "fc_bias",
    "draft_len",
    "tree_total_tokens",
    "tree_depth",
    "tree_top_k",
    "model_type",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def engine_config(model: PreTrainedModel, dtype: str = "float16") -> dict[str, Any]:
    """The engine `config.json` of an EAGLE (-3) head: the target's block config, 1 layer, EAGLE keys."""
    cfg = model.config
    out = {k: v for k, v in dict(cfg.block_config).items() if k not in SPECDRAFT_ONLY}
    out.update(
        model_type=cfg.block_config.get("model_type", "llama"),
        num_hidden_layers=1,
        torch_dtype=dtype,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.base_hidden_size),
        tie_word_embeddings=False,
    )
    if cfg.architecture == "eagle3":
        out.update(
            architectures=[EAGLE3_ARCH],
            draft_vocab_size=int(cfg.draft_vocab_size),
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": [int(i) for i in cfg.target_layers],
                "use_aux_hidden_state": True,
            },
        )
        if getattr(cfg, "norm_fused", False):  # EAGLE-3.1
            out.update(fc_norm=True, norm_output=True)
    else:
        out.update(architectures=[EAGLE1_ARCH], bias=bool(cfg.fc_bias))
    return out


def required_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor an engine loads for an EAGLE(-3) head, with its shape, derived from `config.json` alone.

    Optional `embed_tokens.weight` is not listed. Attention biases are listed when `attention_bias` is set.
    """
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    eagle3 = EAGLE3_ARCH in config.get("architectures", [])
    p, din = ("midlayer.", 2 * h) if eagle3 else ("layers.0.", h)
    shapes = {
        f"{p}self_attn.q_proj.weight": (heads * hd, din),
        f"{p}self_attn.k_proj.weight": (kv * hd, din),
        f"{p}self_attn.v_proj.weight": (kv * hd, din),
        f"{p}self_attn.o_proj.weight": (h, heads * hd),
        f"{p}mlp.gate_proj.weight": (inter, h),
        f"{p}mlp.up_proj.weight": (inter, h),
        f"{p}mlp.down_proj.weight": (h, inter),
        f"{p}post_attention_layernorm.weight": (h,),
    }
    if config.get("attention_bias"):
        shapes.update(
            {
                f"{p}self_attn.{n}_proj.bias": (s,)
                for n, s in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))
            }
        )
        shapes[f"{p}self_attn.o_proj.bias"] = (h,)
    if eagle3:
        vd, m = (
            int(config["draft_vocab_size"]),
            len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        )
        shapes.update(
            {
                "fc.weight": (h, m * int(config.get("target_hidden_size") or h)),
                "norm.weight": (h,),
                "lm_head.weight": (vd, h),
                "d2t": (vd,),
                "t2d": (v,),
                f"{p}input_layernorm.weight": (h,),
                f"{p}hidden_norm.weight": (h,),
            }
        )
        if config.get("fc_norm"):  # EAGLE-3.1: one RMSNorm per fused target layer
            th = int(config.get("target_hidden_size") or h)
            shapes.update({f"fc_norm.{i}.weight": (th,) for i in range(m)})
    else:
        shapes["fc.weight"] = (h, 2 * h)
        if config.get("bias", True):
            shapes["fc.bias"] = (h,)
    return shapes


def check_engine_layout(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    """Problems of a (config, tensors) pair against `required_tensors`: missing, misshapen, unexpected keys."""
    from specdraft.models.hub import tensor_problems

    return tensor_problems(required_tensors(config), tensors, optional=("embed_tokens.weight",))


def export_engine_layout(
    model: PreTrainedModel,
    out_dir: str | Path,
    dtype: str = "float16",
    target: PreTrainedModel | None = None,
    drop_copy_gate: bool = False,
) -> Path:
    """Write `config.json` + `model.safetensors` in the engine layout (atomic, replacing an older export).

    Args:
        model: an EagleDrafter or Eagle3Drafter.
        out_dir: destination folder.
        dtype: float16 | bfloat16 | float32 for the weights and `torch_dtype`.
        target: when given, its input embeddings are saved as `embed_tokens.weight` (engines that do not share).
        drop_copy_gate: a head trained with a copy gate (`drafter.copy_ngram`, models/eagle_copy.py) is exported
            without it (engines draft with the head's own logits); False: such a head is refused.

    Returns:
        the folder path.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    state = model.state_dict()
    gate = [k for k in state if k.startswith("copy_gate.")]
    if gate and not drop_copy_gate:
        raise ValueError(
            f"this {type(model).__name__} drafts with a copy gate (drafter.copy_ngram="
            f"{getattr(model.config, 'copy_ngram', '?')}), which serving engines do not run: export it without "
            "the gate (drop_copy_gate=True; scripts/export_engine.py --drop-copy-gate), drafting with the head's "
            "own logits"
        )
    cfg = engine_config(model, dtype)
    tensors = {
        k: (v if v.dtype in (torch.long, torch.bool) else v.to(DTYPES[dtype])).detach().cpu().contiguous()
        for k, v in state.items()
        if k not in gate
    }
    if cfg["architectures"] == [EAGLE1_ARCH]:  # engines draft EAGLE-1 over the full vocabulary
        tensors.pop("d2t", None)
    if target is not None:
        tensors["embed_tokens.weight"] = (
            cast(Tensor, target.get_input_embeddings().weight).detach().to(DTYPES[dtype]).cpu()
        )
    errs = check_engine_layout(cfg, tensors)
    if errs:
        raise ValueError(f"engine layout of {type(model).__name__} is inconsistent: " + "; ".join(errs))
    out = Path(out_dir)
    with atomic_dir(out, overwrite=True) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def export_from_folder(
    src: str | Path, dst: str | Path, dtype: str = "float16", drop_copy_gate: bool = False
) -> Path:
    """Convert our HF export folder (`models/hub.py`) of an EAGLE(-3) head to the engine layout (no target needed)."""
    from specdraft.models.hub import load_drafter

    return export_engine_layout(load_drafter(str(src)), dst, dtype, drop_copy_gate=drop_copy_gate)


def read_engine_layout(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, tensors) of an engine-layout folder (`model.safetensors` or `pytorch_model.bin`)."""
    root = Path(path)
    cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
    if (root / "model.safetensors").is_file():
        return cfg, load_file(str(root / "model.safetensors"))
    if (root / "pytorch_model.bin").is_file():
        return cfg, torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{root}: no model.safetensors or pytorch_model.bin")


def import_engine_layout(
    path: str | Path, target: PreTrainedModel, fingerprint: dict[str, Any]
) -> PreTrainedModel:
    """Load an engine-layout EAGLE(-3) head (ours or a public one) as a specdraft drafter attached to `target`.

    Args:
        path: folder with `config.json` and weights.
        target: the frozen target whose embeddings/LM head the head borrows.
        fingerprint: `base_llm.target_fingerprint(target, tokenizer)` (name, sizes, tokenizer hash).

    Returns:
        EagleDrafter or Eagle3Drafter in eval mode (fp32).
    """
    from types import SimpleNamespace

    from specdraft.models import eagle, eagle3

    cfg, tensors = read_engine_layout(path)
    errs = check_engine_layout(cfg, tensors)
    if errs:
        raise ValueError(f"{path}: not a loadable EAGLE checkpoint: " + "; ".join(errs))
    is3 = EAGLE3_ARCH in cfg.get("architectures", [])
    tree = SimpleNamespace(draft_len=5 if is3 else 4, tree_total_tokens=24, tree_depth=5, tree_top_k=6)
    common = eagle.common_config(tree, target, fingerprint)
    config: eagle.EagleConfig | eagle3.Eagle3Config
    model: eagle.EagleDrafter | eagle3.Eagle3Drafter
    if is3:
        layers = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        fc_norm, norm_output = bool(cfg.get("fc_norm")), bool(cfg.get("norm_output"))
        if fc_norm != norm_output:
            raise ValueError(
                f"{path}: fc_norm={fc_norm} with norm_output={norm_output} is not supported: "
                "the EAGLE-3 head has both (EAGLE-3.1, drafter.norm_fused=true) or neither"
            )
        config = eagle3.Eagle3Config(
            **common,
            target_layers=layers,
            draft_vocab_size=int(cfg["draft_vocab_size"]),
            norm_fused=fc_norm,
        )
        model = eagle3.attach(eagle3.Eagle3Drafter(config), target)
    else:
        config = eagle.EagleConfig(**common, fc_bias="fc.bias" in tensors)
        model = eagle.attach(eagle.EagleDrafter(config), target)
    tensors.pop("embed_tokens.weight", None)
    model.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True
    )
    return model.eval()
