"""Hardware-aware dtype/device resolution (specdraft.hardware), with the machine's capabilities mocked."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from specdraft import hardware
from specdraft.hardware import (
    auto_dtype,
    cpu_native_bf16,
    log_environment,
    mixed_precision_for,
    resolve_dtype,
    resolve_placement,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def cpu_with(monkeypatch):
    """Pretend this CPU has exactly the given /proc/cpuinfo flags."""

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))

    return set_flags


@pytest.fixture
def cuda_gpu(monkeypatch):
    """Pretend a CUDA GPU is present, with or without bf16."""

    def set_gpu(bf16: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "FakeGPU")

    return set_gpu


@pytest.mark.parametrize(
    "flags,native",
    [
        (("avx512f", "avx512_bf16"), True),
        (("avx512f", "amx_bf16", "amx_tile"), True),
        (("avx512f", "avx512_vnni", "avx2"), False),  # the 2-core Xeon that emulates bf16
        (("avx2", "fma"), False),
    ],
)
def test_cpu_bf16_follows_the_flags(cpu_with, flags, native):
    cpu_with(*flags)
    assert cpu_native_bf16()[0] is native
    dtype, reason = auto_dtype(CPU)
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert ("lacks" in reason) is not native
    assert mixed_precision_for("auto", CPU) == ("bf16" if native else "no")


@pytest.mark.parametrize(
    "model,flags,compiler,dtype",
    [
        ("AMD EPYC", ("avx2", "fma", "f16c", "avx512_bf16"), True, torch.float32),  # the panel kernels decode
        ("Intel(R) Xeon(R) Platinum 8480+", ("avx2", "fma", "f16c", "amx_bf16"), True, torch.float32),  # AMX
        ("AMD EPYC", ("avx512f", "avx512_bf16"), True, torch.bfloat16),  # no AVX2/FMA/F16C: no panel kernels
        ("AMD EPYC", ("avx2", "fma", "f16c", "avx512_bf16"), False, torch.bfloat16),  # nothing to build them
    ],
)
def test_native_bf16_cpus_decode_in_fp32_where_the_panel_kernels_run(
    cpu_with, monkeypatch, model, flags, compiler, dtype
):
    """A target under `auto` on a CPU with native bf16 loads in fp32 where the fp32 panel kernels are the decode
    layout (x86-64, Intel or AMD, AVX2 + FMA + F16C, a C compiler), else bf16; training's mixed precision stays
    bf16 on all of them, and the reason says why."""
    cpu_with(*flags)
    monkeypatch.setattr(hardware, "cpu_model", lambda: model)
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware.shutil, "which", lambda name: "/usr/bin/cc" if compiler else None)
    got, reason = auto_dtype(CPU)
    assert got == dtype
    assert ("panel kernels decode faster" in reason) is (dtype == torch.float32)
    assert hardware.native_dtype(CPU)[0] == torch.bfloat16
    assert mixed_precision_for("auto", CPU) == "bf16"
    assert resolve_placement("cpu", "auto").dtype == dtype
    assert hardware.draft_dtype_for("auto", torch.nn.Linear(2, 2)) == dtype


def test_unreadable_flags_mean_fp32(cpu_with):
    cpu_with()  # e.g. macOS: no /proc/cpuinfo
    assert auto_dtype(CPU)[0] == torch.float32


@pytest.mark.parametrize("bf16,dtype,mp", [(True, torch.bfloat16, "bf16"), (False, torch.float16, "fp16")])
def test_cuda_picks_bf16_or_fp16(cuda_gpu, bf16, dtype, mp):
    cuda_gpu(bf16)
    assert auto_dtype(CUDA)[0] == dtype
    assert mixed_precision_for("auto", CUDA) == mp
    placement = resolve_placement("auto", "auto")
    assert (
        placement.device.type == "cuda" and placement.dtype == dtype and placement.reason.startswith("auto")
    )


def test_explicit_values_win(cpu_with, cuda_gpu):
    cpu_with("avx2")
    assert resolve_placement("cpu", "bf16") == hardware.Placement(CPU, torch.bfloat16, "explicit")
    assert resolve_dtype("fp16", CPU) == torch.float16
    assert mixed_precision_for("no", CPU) == "no" and mixed_precision_for("bf16", CPU) == "bf16"
    cuda_gpu(True)
    assert resolve_placement("cpu", "auto").device == CPU  # an explicit cpu on a CUDA host stays on CPU
    assert resolve_placement("cpu", "auto").dtype == torch.float32


def test_auto_device_is_this_ranks_gpu(cuda_gpu, monkeypatch):
    cuda_gpu(True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert hardware.resolve_device("auto") == torch.device("cuda", 3)


def test_bad_values_name_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"eval\.draft_dtype='int3'"):
        resolve_dtype("int3", CPU, "eval.draft_dtype")
    with pytest.raises(ValueError, match=r"base_model\.device='cuda'.*no CUDA"):
        hardware.resolve_device("cuda")


def test_drafters_follow_the_target_dtype_unless_set(cpu_with):
    """`eval.draft_dtype` unset: the drafter decodes in the target's dtype (an fp32 export next to a bf16 target
    drafted 2-7x slower); a set value wins, `auto` follows the machine; a bad value names the field."""
    bf16_target = torch.nn.Linear(2, 2).to(torch.bfloat16)
    fp32_target = torch.nn.Linear(2, 2)
    assert hardware.draft_dtype_for(None, bf16_target) == torch.bfloat16
    assert hardware.draft_dtype_for(None, fp32_target) == torch.float32
    assert hardware.draft_dtype_for("fp32", bf16_target) == torch.float32
    cpu_with("avx512f", "avx512_bf16")
    assert hardware.draft_dtype_for("auto", fp32_target) == torch.bfloat16
    cpu_with("avx512f")
    assert hardware.draft_dtype_for("auto", bf16_target) == torch.float32
    with pytest.raises(ValueError, match=r"--draft-dtype='int3'"):
        hardware.draft_dtype_for("int3", fp32_target, "--draft-dtype")


def test_environment_line_says_what_and_why(cpu_with):
    cpu_with("avx512f")
    line = log_environment("distill", resolve_placement("cpu", "auto"))
    assert "[distill]" in line and "dtype fp32" in line and "AVX512-BF16" in line and "threads" in line


def test_a_passive_openmp_wait_policy_is_called_out_on_a_cpu(cpu_with, monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE makes CPU decoding several times slower: the environment line says so (on a CPU
    only), and says nothing without it."""
    cpu_with("avx512f")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "OMP_WAIT_POLICY" not in log_environment("evaluate", resolve_placement("cpu", "auto"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert hardware.PASSIVE_WARNING in log_environment("evaluate", resolve_placement("cpu", "auto"))


def test_specdraft_switches_are_named_in_the_line_and_the_record(cpu_with, monkeypatch):
    """A run with a code-path switch set (here the native draft chain turned off) says so in its environment
    line and in every results record's machine info; without any, neither mentions one."""
    from specdraft.hardware import host_info

    cpu_with("avx512f")
    for k in [k for k in os.environ if k.startswith("SPECDRAFT_")]:
        monkeypatch.delenv(k)
    assert "set:" not in log_environment("evaluate", resolve_placement("cpu", "auto"))
    assert host_info(torch.device("cpu"))["specdraft_env"] == {}
    monkeypatch.setenv("SPECDRAFT_NATIVE_CHAIN", "0")
    assert "set: SPECDRAFT_NATIVE_CHAIN=0" in log_environment("evaluate", resolve_placement("cpu", "auto"))
    assert host_info(torch.device("cpu"))["specdraft_env"] == {"SPECDRAFT_NATIVE_CHAIN": "0"}


def test_load_target_resolves_auto(cpu_with, tmp_path, monkeypatch):
    """base_model.dtype=auto loads fp32 on a CPU without native bf16, bf16 on one with it."""
    from specdraft.models.base_llm import load_target
    from specdraft.testing import tiny_llama, tiny_tokenizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    cfg = SimpleNamespace(name_or_path=str(tmp_path), dtype="auto", device="auto")
    cpu_with("avx512f", "avx512_vnni")
    assert load_target(cfg)[0].dtype == torch.float32
    cpu_with("avx512f", "avx512_bf16")
    model = load_target(cfg)[0]
    assert model.dtype == torch.bfloat16 and model.device == CPU


def test_host_info_names_the_gpu_of_the_device_it_is_given(cuda_gpu):
    from specdraft.hardware import host_info

    cuda_gpu(True)
    assert host_info()["gpu"] == "FakeGPU"  # no device: the first GPU
    assert host_info(torch.device("cuda", 0))["gpu"] == "FakeGPU"
    assert "gpu" not in host_info(torch.device("cpu"))  # a CPU model on a GPU host: no GPU in its numbers
