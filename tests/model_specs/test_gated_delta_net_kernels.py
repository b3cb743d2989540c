"""Qwen3-Next on a Hopper GPU whose Triton makes flash-linear-attention's gated backward wrong
(model_specs/features/gated_delta_net/kernels.py): refused at start in one line, naming the Triton
version, the GPU and what to install, where the H200 run of 2026-12-04 reached fla's own refusal at
the first backward after minutes of set-up. The machines are faked (Available, as
tests/actor/test_settings_machine_profiles.py does): none of them runs here."""
from __future__ import annotations

import dataclasses

import pytest

from model_specs.features.gated_delta_net.kernels import (DeltaRuleKernelError, backward_refusal,
                                                          check_backward_kernels, tilelang_usable)

H200 = dict(capability=(9, 0), device="NVIDIA H200")


@pytest.mark.parametrize("triton, capability, tilelang, refused", [
    ("3.6.0", (9, 0), False, True),      # torch 2.11's Triton on an H100 / H200: the visit's machine
    ("3.4.0", (9, 0), False, True),      # the first broken version
    ("3.7.0+git1234", (9, 0), False, True),
    ("3.7.1", (9, 0), False, False),     # fla's fix
    ("3.8.0", (9, 0), False, False),
    ("3.3.1", (9, 0), False, False),     # before the regression
    ("3.6.0", (8, 0), False, False),     # A100: not Hopper
    ("3.6.0", (10, 0), False, False),    # Blackwell
    ("3.6.0", (9, 0), True, False),      # fla takes its TileLang backend for that kernel
    (None, (9, 0), False, False),        # no Triton: fla itself cannot run, megatron says so
    ("3.6.0", None, False, False),       # no GPU
])
def test_refused_only_on_hopper_with_a_broken_triton_and_no_tilelang(triton, capability, tilelang, refused):
    line = backward_refusal(triton=triton, capability=capability, device="NVIDIA H200", tilelang=tilelang)
    assert (line is not None) == refused, line


def test_the_line_names_the_version_the_gpu_and_what_to_install():
    line = backward_refusal(triton="3.6.0", tilelang=False, **H200)
    assert line == ("Gated DeltaNet layers (Qwen3-Next) on NVIDIA H200 (compute capability 9.0) with Triton "
                    "3.6.0: flash-linear-attention's gated backward gives wrong results with Triton >= 3.4.0 "
                    "and < 3.7.1 on Hopper (fla issue #640) and refuses at the first backward; install "
                    "triton>=3.7.1, or tilelang with an nvcc on PATH or CUDA_HOME (fla's TileLang backend), "
                    "then start again")
    with pytest.raises(DeltaRuleKernelError) as e:
        check_backward_kernels(triton="3.6.0", **H200)
    assert str(e.value) == line and e.value.exit_code == 2  # an input of the run: exit 2


def test_the_triton_version_is_the_installed_ones():
    from importlib import metadata

    from model_specs.features.gated_delta_net.kernels import triton_version
    assert triton_version() == metadata.version("triton")  # torch's own dependency, installed here


def test_tilelang_counts_only_importable_with_nvcc_and_not_switched_off(monkeypatch, tmp_path):
    """fla's own test (has_usable_nvcc, TileLangBackend.is_enabled): tilelang is not installed here."""
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    assert not tilelang_usable()
    (tmp_path / "tilelang").mkdir()
    (tmp_path / "tilelang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert tilelang_usable()
    monkeypatch.setenv("FLA_TILELANG", "0")
    assert not tilelang_usable()


@pytest.mark.parametrize("profile", ["cpu", "cuda", "cuda+te", "cuda+te+apex"])
def test_every_machine_profile_on_hopper_with_triton_3_6_refuses_a_qwen3_next_actor(profile):
    """Each profile of the machine-profile tests, its GPU an H200 with torch 2.11's Triton: the
    Actor refuses before anything is built (no process group, no model), CUDA or not deciding;
    with Triton 3.7.1 the same machine passes the check."""
    from gspo_megatron.actor import Actor
    from gspo_megatron.actor.settings import ComputeSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_next
    from test_settings_machine_profiles import PROFILES

    available = dataclasses.replace(PROFILES[profile], gpu_name="NVIDIA H200", gpu_capability=(9, 0),
                                    triton_version="3.6.0")
    dataclasses.replace(available, triton_version="3.7.1").check_gated_delta_net()
    # the TE spec does not build here (TE does not import): the local spec, as the TE profiles' check does
    compute = ComputeSettings(transformer_engine=False, apply_rope_fusion=False, moe_permute_fusion=False) \
        if available.transformer_engine else None
    if not available.cuda:
        available.check_gated_delta_net()  # the CPU takes the torch forms: nothing to refuse
        return
    with pytest.raises(DeltaRuleKernelError, match=r"^Gated DeltaNet layers \(Qwen3-Next\) on NVIDIA H200 "
                                                   r"\(compute capability 9.0\) with Triton 3.6.0: "):
        Actor(qwen3_next(), ParallelLayout(), available=available, compute=compute)
