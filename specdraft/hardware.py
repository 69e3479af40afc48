"""Hardware-aware defaults: which device and dtype a stage runs in when the config says `auto`.

bf16 is only worth it where the hardware does it natively: a CUDA GPU with bf16 (Ampere and newer), or an
x86 CPU with AVX512-BF16 or AMX. Elsewhere torch emulates it: on a 2-core Xeon without AVX512-BF16 a bf16
GEMM runs ~3x slower than fp32 and a SmolLM2 decode step 2.3x slower. So `auto` picks

    CUDA with bf16 -> bf16 | CUDA without -> fp16 | CPU with AVX512-BF16/AMX -> bf16 | other CPUs, MPS -> fp32

with one exception for the target (`base_model.dtype`): on a CPU where specdraft's fp32 panel kernels are the
decode layout (`models/linear_layout.py`: an x86-64 CPU with AVX2, FMA, F16C and a C compiler, Intel's or
AMD's), fp32 even where bf16 is native. There a decode step streams the GGUF's own 4-bit blocks rebuilt in
registers: on a 2-core AMD EPYC (Zen 5, AVX512-BF16) fp32 AR ran 202.1 tok/s against 54.6 in native bf16
(SmolLM2-135M, session 50), on a 2-core Intel Xeon with AMX-BF16 93.7 against 22.5 (session 60; both
`scripts/bench_dtype.py`). Training's `train.mixed_precision: auto` follows the plain rule (bf16 / fp16 / no:
the drafter's own products are large there). Explicit values always win. Each stage prints its choice and the
reason once (`log_environment`).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {  # short names first: the order config errors list them in
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 matmuls on x86
# int8 dot products that accumulate in 32 bits (fbgemm's int8 products need no 7-bit activations there)
VNNI_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_int8_full_range() -> bool:
    """Whether int8 products may quantise activations to the full 8 bits here: VNNI (or AMX) dot products
    accumulate in 32 bits; without them fbgemm's AVX2 path sums pairs in saturating 16 bits, which 7-bit
    activations (`reduce_range`) keep from overflowing."""
    return any(f in cpu_flags() for f in VNNI_CPU_FLAGS)


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else `platform.processor()` / the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info(device: torch.device | None = None) -> dict[str, Any]:
    """Where numbers are measured: platform, CPU (model, cores, native bf16), torch threads, torch and
    transformers versions, load average, and the GPU's name: `device`'s when it is a CUDA device, none for
    another device, the first GPU's (when CUDA is available) without one."""
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_native_bf16": cpu_native_bf16()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "specdraft_env": specdraft_env(),
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    elif device is None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def specdraft_env() -> dict[str, str]:
    """The `SPECDRAFT_*` environment variables set in this process (kernel and code-path switches such as
    `SPECDRAFT_NATIVE_CHAIN=0` or `SPECDRAFT_AVX512=0`, cache folders), by name: a measurement taken with one
    of them set is not the default path, so records and environment lines name them."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECDRAFT_")}


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively, and the evidence (a flag name, or why not).

    Returns:
        (native, reason). On Apple silicon / Arm, bf16 matmuls are not assumed native (fp32 is the safe pick).
    """
    flags = cpu_flags()
    found = [f for f in BF16_CPU_FLAGS if f in flags]
    if found:
        return True, f"CPU has {'+'.join(found)}"
    if not flags:
        return False, f"no CPU bf16 flags readable on {platform.machine() or 'this CPU'}"
    return False, "CPU lacks AVX512-BF16/AMX (bf16 would be emulated, ~2-3x slower than fp32)"


def resolve_device(name: str | None) -> torch.device:
    """`auto`/None -> this rank's CUDA device when available, else CPU; anything else is passed to torch.

    Raises:
        ValueError: an explicit CUDA device on a machine without CUDA.
    """
    if name in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(str(name))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"base_model.device={name!r} but torch sees no CUDA device: use `auto` or `cpu`")
    return device


def panel_kernel_blocker() -> tuple[str | None, str | None]:
    """Why `models/panel_linear.py` cannot build its kernel here, before trying: (the reason, or None; the C
    compiler's path, or None). It needs an x86-64 CPU with AVX2, FMA and F16C (unreadable flags: assumed) and a C
    compiler (`$CC`, default `cc`) on PATH."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the panel kernel is x86-64 AVX2 code; this machine is {platform.machine()}", None
    if cpu_flags() and not {"avx2", "fma", "f16c"} <= cpu_flags():
        return "the panel kernel needs AVX2, FMA and F16C, which this CPU lacks", None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return f"no C compiler {os.environ.get('CC', 'cc')!r} on PATH to build the panel kernel", None
    return None, cc


def cpu_fp32_panels() -> tuple[bool, str]:
    """Whether specdraft's fp32 panel kernels are expected to be this CPU's decode layout (`linear_layout`
    `auto` picks `panel` wherever the kernel builds, Intel and AMD alike: `panel_kernel_blocker`), and the
    evidence. A check before building: the kernel is built when a model is laid out, not here.

    Returns:
        (expected, reason).
    """
    blocker, _ = panel_kernel_blocker()
    if blocker is not None:
        return False, blocker
    return True, "the fp32 panel kernels decode faster (AR 3.7x bf16 on a Zen 5, 4.2x AMX bf16 on a Xeon)"


def native_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The fastest dtype that is native on `device`, with the reason (training's mixed precision follows it).

    Args:
        device: where the model runs.

    Returns:
        (dtype, reason): bf16 on CUDA with bf16 or on a CPU with AVX512-BF16/AMX, fp16 on older CUDA GPUs,
        fp32 otherwise.
    """
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"{torch.cuda.get_device_name(device)} supports bf16"
        return torch.float16, f"{torch.cuda.get_device_name(device)} has no bf16: fp16"
    if device.type == "cpu":
        native, why = cpu_native_bf16()
        return (torch.bfloat16, why) if native else (torch.float32, why)
    return torch.float32, f"{device.type}: fp32 is the safe default"


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype a target (and a drafter decoding beside it) runs in under `auto`, with the reason:
    `native_dtype`, except fp32 on a CPU with native bf16 where the fp32 panel kernels decode
    (`cpu_fp32_panels`; see the module docstring).

    Args:
        device: where the model runs.

    Returns:
        (dtype, reason).
    """
    dtype, why = native_dtype(device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        panels, because = cpu_fp32_panels()
        if panels:
            return torch.float32, f"{why}, but {because}"
    return dtype, why


def resolve_dtype(
    name: str | torch.dtype | None, device: torch.device | None = None, field: str = "base_model.dtype"
) -> torch.dtype:
    """Map `auto`/"fp32"/"bf16"/"fp16"/"fp64" (or a torch.dtype) to a torch.dtype.

    Args:
        name: the configured value; `auto` (or None) picks `auto_dtype(device)`.
        device: where the model runs (needed for `auto`; default: `resolve_device("auto")`).
        field: the config key named in the error.

    Raises:
        ValueError: an unknown name, naming `field` and the choices.
    """
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return auto_dtype(device if device is not None else resolve_device("auto"))[0]
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r} is not one of {['auto', *sorted(set(DTYPES))]}")
    return DTYPES[name]


def draft_dtype_for(
    setting: str | None, target: torch.nn.Module, field: str = "eval.draft_dtype"
) -> torch.dtype:
    """The dtype a drafter decodes in next to `target` (`eval.draft_dtype`).

    Args:
        setting: None: the target's own dtype, so a bf16 target drafts in bf16 and an fp32 one
            in fp32; `auto` | `fp32` | `bf16` | `fp16`: that dtype (`auto`: as the target's `auto_dtype`).
        target: the loaded target (its first parameter's dtype and device).
        field: the config key named in the error.

    Raises:
        ValueError: an unknown name, naming `field` and the choices.
    """
    param = next(target.parameters())
    if setting is None:
        return param.dtype
    return resolve_dtype(setting, param.device, field)


def mixed_precision_for(setting: str, device: torch.device) -> str:
    """accelerate's `mixed_precision` for `train.mixed_precision` (`auto` follows the dtype rule).

    Args:
        setting: `auto` | `no` | `bf16` | `fp16`.
        device: the device the drafter trains on.

    Returns:
        `bf16` where bf16 is native on `device`, `fp16` on CUDA without bf16, else `no`; explicit values as given.
    """
    if setting != "auto":
        return setting
    dtype = native_dtype(device)[0]
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")


@dataclass(frozen=True)
class Placement:
    """Where and in what precision a stage runs, and why (printed once per stage)."""

    device: torch.device  # resolved device
    dtype: torch.dtype  # resolved model dtype
    reason: str  # `explicit` or the auto rule's evidence


def resolve_placement(
    device: str | None, dtype: str | torch.dtype | None, field: str = "base_model"
) -> Placement:
    """Resolve a (device, dtype) pair from the config, `auto` allowed in both.

    Args:
        device: `auto` | `cpu` | `cuda` | `cuda:N` | `mps`.
        dtype: `auto` | `fp32` | `bf16` | `fp16` | `fp64` | a torch.dtype.
        field: the config group named in errors (`base_model`, `eval`).
    """
    dev = resolve_device(device)
    if dtype in (None, "auto"):
        dt, reason = auto_dtype(dev)
        reason = f"auto: {reason}"
    else:
        dt, reason = resolve_dtype(dtype, dev, f"{field}.dtype"), "explicit"
    return Placement(dev, dt, reason)


# OpenMP threads that sleep between the decode step's many short parallel products (measured: our AR 250 -> 71
# tok/s on a 2-core Zen 5, session 51)
PASSIVE_WARNING = (
    "WARNING OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep between a decode step's products (3.5x slower CPU "
    "decoding measured); unset it or set ACTIVE"
)


def log_environment(stage: str, placement: Placement | None = None, extra: str = "") -> str:
    """Log (once per call) where `stage` runs: device, dtype and why, CPU threads, library versions.

    Returns:
        the logged line (for tests).
    """
    import transformers

    parts: list[str] = []
    if placement is not None:
        parts.append(
            f"device {placement.device} | dtype {SHORT_NAMES.get(placement.dtype, placement.dtype)} "
            f"({placement.reason})"
        )
    parts.append(
        f"threads {torch.get_num_threads()} | torch {torch.__version__} | transformers {transformers.__version__}"
    )
    if extra:
        parts.append(extra)
    switches = specdraft_env()
    if switches:
        parts.append("set: " + " ".join(f"{k}={v}" for k, v in switches.items()))
    on_cpu = placement is None or str(placement.device).startswith("cpu")
    if on_cpu and os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        parts.append(PASSIVE_WARNING)
    line = f"[{stage}] " + " | ".join(parts)
    log.info(line)
    return line
