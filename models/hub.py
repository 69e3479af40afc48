"""Export, load and publish drafters as Hugging Face folders.

An export is `config.json` (family `architecture`, `base_model_name_or_path`, `format_version`, the target's
hidden size / vocab / tokenizer hash and a `training_summary`), `model.safetensors` (drafter weights only, never
the target's) and a `README.md` model card. `load_drafter` reads `architecture` and dispatches through
`models/registry.py`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

from specdraft.utils import atomic_dir, check_safetensors, hub_errors, local_or_hub

log = logging.getLogger(__name__)
MATCH_KEYS = ("hidden_size", "vocab_size", "tokenizer_hash")


def check_target_match(found: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Refuse a drafter/dataset made for another target.

    Args:
        found: what the artifact records (`hidden_size`, `vocab_size`, `tokenizer_hash`; missing keys are skipped).
        expected: `base_llm.target_fingerprint` of the target in use.
        what: a name for the message, e.g. "drafter outputs/x/export".

    Raises:
        ValueError: naming every mismatching field with both values.
    """
    bad = [
        f"{k}: {found[k]!r} (artifact) != {expected[k]!r} (target)"
        for k in MATCH_KEYS
        if found.get(k) not in (None, "") and expected.get(k) not in (None, "") and found[k] != expected[k]
    ]
    if bad:
        made_for = found.get("name_or_path") or found.get("base_model_name_or_path") or "another model"
        raise ValueError(
            f"{what} was made for a different target ({made_for}) than {expected.get('name_or_path')!r}: "
            + "; ".join(bad)
        )


def drafter_target_info(config: PretrainedConfig) -> dict[str, Any]:
    """The target identity a drafter config records, in `target_fingerprint` keys."""
    return {
        "name_or_path": getattr(config, "base_model_name_or_path", None),
        "hidden_size": getattr(config, "base_hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "tokenizer_hash": getattr(config, "tokenizer_hash", None),
    }


def model_card(config: PretrainedConfig, summary: dict[str, Any]) -> str:
    """README.md text: what the drafter is, for which target, how it was trained, its metrics."""
    metrics = summary.get("final_eval", {}) or {}
    rows = "\n".join(
        f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()
    )
    vd = getattr(config, "draft_vocab_size", None)
    extra = ""
    if vd and vd < config.vocab_size:
        extra += f"\n- draft vocabulary: the {vd} most frequent training labels of {config.vocab_size} tokens"
    if getattr(config, "norm_fused", False):
        extra += (
            "\n- EAGLE-3.1 normalisation: RMSNorm per fused target layer before fc, post-norm state fed back"
        )
    if summary.get("init_from"):
        extra += f"\n- warm-started from: {summary['init_from']}"
    return f"""---
library_name: transformers
tags: [speculative-decoding, drafter, specdraft, {config.architecture}]
base_model: {config.base_model_name_or_path}
---
# {config.architecture} drafter for `{config.base_model_name_or_path}`

A speculative-decoding drafter trained with specdraft. It does **not** contain the target's weights: load it
next to its target (hidden size {config.base_hidden_size}, vocab {config.vocab_size}, tokenizer hash
`{config.tokenizer_hash}`):

```python
from specdraft.models.base_llm import load_target
from specdraft.models.hub import load_drafter
drafter = load_drafter("<this folder or Hub id>", target=target_model)
```

## Training
- steps: {summary.get("steps")}, wall time: {summary.get("wall_time_s")} s, data: {summary.get("data")}
- draft length: {getattr(config, "draft_len", "?")}, format version: {config.format_version}{extra}

## Held-out metrics (last evaluation)
| metric | value |
|---|---|
{rows}
"""


def export_drafter(
    model: PreTrainedModel, out_dir: str | os.PathLike[str], summary: dict[str, Any] | None = None
) -> Path:
    """Write the HF folder atomically (replacing an older export).

    Args:
        model: an unwrapped drafter (`accelerator.unwrap_model`); borrowed embeddings are not in its state dict.
        out_dir: destination folder.
        summary: training summary stored in config.json (`training_summary`) and shown in README.md.

    Returns:
        the folder path.
    """
    out = Path(out_dir)
    model.config.training_summary = summary or {}
    with atomic_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "README.md").write_text(model_card(model.config, summary or {}), encoding="utf-8")
    return out


def read_config(path_or_hub_id: str, field: str = "drafter") -> dict[str, Any]:
    """config.json of a local export or a Hub repo, as a dict.

    Args:
        path_or_hub_id: an export folder or a Hub id `owner/name`.
        field: the config field it came from, for error messages (e.g. `train.init_from`).

    Raises:
        FileNotFoundError: a missing local path, a folder without config.json, or a Hub repo that cannot be
            fetched (e.g. not cached while offline); one line naming `field`.
    """
    local = Path(path_or_hub_id) / "config.json"
    if local.is_file():
        return json.loads(local.read_text(encoding="utf-8"))
    if Path(path_or_hub_id).exists():
        raise FileNotFoundError(f"{field}={path_or_hub_id!r}: not a drafter export (no config.json)")
    local_or_hub(path_or_hub_id, field, "drafter export folder")
    with hub_errors(field, path_or_hub_id):
        cfg, _ = PretrainedConfig.get_config_dict(path_or_hub_id)
    return cfg


def load_drafter(
    path_or_hub_id: str,
    target: PreTrainedModel | None = None,
    fingerprint: dict[str, Any] | None = None,
    field: str = "drafter",
) -> PreTrainedModel:
    """Load any specdraft drafter, dispatching on its `architecture` (models/registry.py).

    Args:
        path_or_hub_id: an export folder or Hub repo id.
        target: the frozen target; when given, the drafter is checked against it and its embeddings attached.
        fingerprint: `target_fingerprint(target, tokenizer)`; adds the tokenizer-hash check.
        field: the config field `path_or_hub_id` came from, for error messages (e.g. `eval.drafters`).

    Returns:
        the drafter in eval mode, on the target's device when a target is given.

    Raises:
        FileNotFoundError: a missing export folder, or a Hub repo that cannot be fetched.
        ValueError: not a specdraft drafter, a truncated model.safetensors, or a drafter for another target.
    """
    from specdraft.models.registry import get_family

    raw = read_config(path_or_hub_id, field)
    arch = raw.get("architecture")
    if arch is None:
        raise ValueError(f"{path_or_hub_id}/config.json has no `architecture` field: not a specdraft drafter")
    family = get_family(arch)
    if Path(path_or_hub_id).is_dir():
        fix = "re-export it: rerun `python train.py conf=<preset> train.resume=true` (exports at the end)"
        check_safetensors(path_or_hub_id, f"{field}={path_or_hub_id!r}", fix)
    with hub_errors(field, path_or_hub_id):
        model = family.MODEL.from_pretrained(path_or_hub_id)
    if target is not None:
        expected = dict(fingerprint or {})
        expected.setdefault("hidden_size", int(target.config.hidden_size))
        expected.setdefault("vocab_size", int(target.config.vocab_size))
        check_target_match(drafter_target_info(model.config), expected, f"drafter {path_or_hub_id}")
        family.attach(model, target)
        model.to(target.device)
    return model.eval()


def _draft_ids(model: PreTrainedModel) -> Any:
    """(Vd,) target id of each head row for drafters with a draft vocabulary (`draft_ids()`), else None."""
    fn = getattr(model, "draft_ids", None)
    return fn() if callable(fn) else None


def _vocab_head(model: PreTrainedModel, name: str) -> bool:
    """True for the weight of a vocabulary projection (rows = draft vocabulary): the names the drafter lists in
    `vocab_head_names()` (Medusa's K heads), else any `...head.weight` (ReDrafter)."""
    fn = getattr(model, "vocab_head_names", None)
    return name in fn() if callable(fn) else name.endswith("head.weight")


def _widened(src: Any, dst: Any) -> bool:
    """True when a (out, in) weight `dst` only adds input columns after `src`'s."""
    return len(src) == len(dst) == 2 and src[0] == dst[0] and src[1] < dst[1]


def _new_residual_block(name: str, dst: Any, theirs: dict[str, Any]) -> bool:
    """True for a parameter of a zero-initialised ResBlock `...blocks.<i>.` that the export does not have."""
    import re

    m = re.search(r"(^|\.)blocks\.(\d+)\.", name)
    if m is None or any(k.startswith(name[: m.end()]) for k in theirs):
        return False
    return not bool(dst.any())


# Modules a warm start may add to an export without them (`train.init_from`), each with the parameters that are
# zero at its init: ReDrafter prefix attention's output projection (so the logits stay the export's), the copy
# gate's output layer and per-length bias (copy weight 1/2 on every lookup candidate, `CopyGate`), and Medusa's
# root-token projection (the plain heads' function).
_ADDABLE_MODULES: dict[str, Callable[[Any], tuple[Any, ...]]] = {
    "ctx": lambda m: tuple(m.out.parameters()),
    "copy_gate": lambda m: (*m.out.parameters(), m.length_bias),
    "root_input": lambda m: (m.proj.weight,),  # Medusa's root token (models/medusa_root.py)
    # Medusa's copy gate (models/medusa_copy.py)
    "copy": lambda m: (*m.gate.out.parameters(), m.gate.length_bias),
}


def _new_module_at_init(name: str, model: Any, theirs: dict[str, Any]) -> bool:
    """True for a parameter of an `_ADDABLE_MODULES` module that the export does not have, while the module's
    zero-initialised parameters are still zero (a module trained elsewhere is refused)."""
    attr = name.split(".", 1)[0]
    if attr not in _ADDABLE_MODULES or any(k.startswith(attr + ".") for k in theirs):
        return False
    module = getattr(model, attr, None)
    return module is not None and not any(bool(p.any()) for p in _ADDABLE_MODULES[attr](module))


def warm_start(model: PreTrainedModel, path_or_hub_id: str, fingerprint: dict[str, Any]) -> int:
    """Start a freshly built drafter from an export's weights (`train.init_from`), e.g. to keep training a
    drafter on a grown dataset or with a reduced draft vocabulary.

    Every tensor is copied by name and must have the same shape, except (1) an input projection widened by new
    input features (ReDrafter `target_layers` added): the export's columns are copied first and the new columns
    start at zero; (2) ResBlocks added after the export's (a deeper drafter) stay at their identity init; (3) the
    vocabulary head: when the two drafters have different draft vocabularies (`draft_ids()`), the rows of the
    tokens both have are copied and a token new to the draft vocabulary gets the mean of the export's rows, so
    its logit starts at the mean logit and ranks below the trained tokens (a fresh row, e.g. the target's
    LM-head row, is on another scale than the trained features and can outrank them: a grown dataset's warm
    start then began at half the exported accuracy); (4) ReDrafter prefix attention (`ctx.`) added to an export
    without it stays at its init, whose zero output projection leaves the logits unchanged; (5) a ReDrafter copy
    gate (`copy_gate.`) added to an export without it starts at its init: copy weight 1/2 on every lookup candidate;
    (6) Medusa's root-token input (`root_input.`) added to plain heads starts at zero (the export's function), and
    its copy gate (`copy.`) at copy weight 1/2.
    An export tensor this drafter lacks (e.g. the root token's into plain heads) is refused, never dropped.

    Args:
        model: the freshly built drafter (same family as the export).
        path_or_hub_id: the export folder or Hub repo id.
        fingerprint: `target_fingerprint` of the target in use (the export must have been made for it).

    Returns:
        how many tensors were copied (new ResBlocks are not counted).
    """
    import torch

    src = load_drafter(path_or_hub_id, field="train.init_from")
    if src.config.architecture != model.config.architecture:
        raise ValueError(
            f"train.init_from={path_or_hub_id!r} is a {src.config.architecture} drafter, "
            f"not {model.config.architecture}"
        )
    check_target_match(drafter_target_info(src.config), fingerprint, f"train.init_from={path_or_hub_id!r}")
    ids_src, ids_dst = _draft_ids(src), _draft_ids(model)
    theirs, copied = src.state_dict(), 0
    ours = model.state_dict()
    dropped = [n for n in theirs if n not in ours and n not in ("d2t", "t2d")]
    if dropped:  # e.g. an export with the root token, prefix attention or a copy gate, into a drafter without
        raise ValueError(
            f"train.init_from={path_or_hub_id!r} has tensor {dropped[0]!r} that this drafter lacks, so the warm "
            "start would not compute the export's function (change the drafter settings to match the export)"
        )
    with torch.no_grad():
        for name, dst in ours.items():
            if name in ("d2t", "t2d"):
                continue  # the draft vocabulary is this run's (built from its own data)
            if name not in theirs and _new_residual_block(name, dst, theirs):
                continue  # a ResBlock added after the export's: kept at its identity init
            if name not in theirs and _new_module_at_init(name, model, theirs):
                continue  # prefix attention or a copy gate added to an export without it: kept at its init
            if name not in theirs:
                raise ValueError(
                    f"train.init_from={path_or_hub_id!r} has no tensor {name!r} "
                    "(change the drafter settings to match the export)"
                )
            w = theirs[name]
            if (
                ids_src is not None
                and ids_dst is not None
                and _vocab_head(model, name)
                and not torch.equal(ids_src, ids_dst)
            ):
                lut = torch.full((int(model.config.vocab_size),), -1, dtype=torch.long)
                lut[ids_src] = torch.arange(ids_src.numel())
                rows = lut[ids_dst]  # (Vd,) row of each of this drafter's tokens in the export (-1: none)
                have = rows >= 0
                dst[have.to(dst.device)] = w[rows[have]].to(dst)
                dst[(~have).to(dst.device)] = w.float().mean(0).to(dst)  # (H,) for each new token
            elif name.endswith("input_proj.weight") and _widened(w.shape, dst.shape):
                # more input features than the export (ReDrafter `target_layers` added): the export's columns
                # first, zeros for the new inputs, so the warm start computes exactly the export's function
                dst.zero_()
                dst[:, : w.shape[1]] = w.to(dst)
            elif w.shape != dst.shape:
                raise ValueError(
                    f"train.init_from={path_or_hub_id!r}: tensor {name!r} has shape {tuple(w.shape)}, "
                    f"this drafter's is {tuple(dst.shape)} (change the drafter settings to match the export)"
                )
            else:
                dst.copy_(w.to(dst))
            copied += 1
    return copied


def tensor_problems(
    need: dict[str, tuple[int, ...]], tensors: dict[str, Any], optional: tuple[str, ...] = ()
) -> list[str]:
    """What is wrong with an exported tensor set against the names and shapes it needs: missing, misshapen and
    unexpected tensors (`optional` names may be there or not), one line each (the serving-engine layouts)."""
    errs = [f"missing {k} {s}" for k, s in need.items() if k not in tensors]
    errs += [
        f"{k}: shape {tuple(tensors[k].shape)} != {s}"
        for k, s in need.items()
        if k in tensors and tuple(tensors[k].shape) != s
    ]
    return errs + [f"unexpected {k}" for k in tensors if k not in need and k not in optional]


def push_to_hub(folder: str | os.PathLike[str], repo_id: str, private: bool = True) -> str:
    """Upload an export folder to the Hub; the token comes from HF_TOKEN (never printed or logged).

    Returns:
        the repo URL.
    """
    from huggingface_hub import HfApi

    token = os.environ.get("HF_TOKEN")
    if not token:
        raise RuntimeError("train.push_to_hub is set but HF_TOKEN is not in the environment")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="specdraft drafter export")
    log.info("pushed %s to the Hub as %s", folder, repo_id)
    return f"https://huggingface.co/{repo_id}"
