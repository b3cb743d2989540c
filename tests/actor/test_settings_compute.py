"""GPU settings (config section `compute`): defaults that follow what the machine has, a clear
error at start for a setting whose extension is missing, and the TransformerConfig fields they
become. What a GPU with TE actually builds is checked by scripts/gpu_check.sh."""
from __future__ import annotations

import pytest

from gspo_megatron.actor.settings import Available, ComputeSettings

CPU = Available(cuda=False, transformer_engine=False, apex_wgrad=False)
GPU_TE = Available(cuda=True, transformer_engine=True, apex_wgrad=False)
GPU_NO_TE = Available(cuda=True, transformer_engine=False, apex_wgrad=False)


def test_defaults_follow_the_machine():
    cpu = ComputeSettings().resolve(CPU)
    assert not any(getattr(cpu, n) for n in ("transformer_engine", "moe_grouped_gemm", "moe_permute_fusion",
                                            "apply_rope_fusion", "bias_activation_fusion",
                                            "gradient_accumulation_fusion"))
    gpu = ComputeSettings().resolve(GPU_TE)
    assert gpu.transformer_engine and gpu.moe_grouped_gemm and gpu.moe_permute_fusion
    assert gpu.apply_rope_fusion and gpu.bias_activation_fusion and gpu.gradient_accumulation_fusion
    plain = ComputeSettings().resolve(GPU_NO_TE)
    assert not plain.transformer_engine and not plain.moe_grouped_gemm and plain.bias_activation_fusion
    assert not plain.gradient_accumulation_fusion
    local_on_gpu = ComputeSettings(transformer_engine=False).resolve(GPU_TE)
    assert not local_on_gpu.moe_grouped_gemm and not local_on_gpu.gradient_accumulation_fusion
    assert local_on_gpu.moe_permute_fusion  # TE's permute kernels serve the local spec too


@pytest.mark.parametrize("settings,available,needle", [
    (ComputeSettings(moe_grouped_gemm=True), CPU, "moe_grouped_gemm=True needs Transformer Engine"),
    (ComputeSettings(transformer_engine=True), GPU_NO_TE, "transformer_engine=True needs Transformer Engine"),
    (ComputeSettings(apply_rope_fusion=True), CPU, "apply_rope_fusion=True needs Transformer Engine"),
    (ComputeSettings(bias_activation_fusion=True), CPU, "bias_activation_fusion=True needs CUDA"),
    (ComputeSettings(gradient_accumulation_fusion=True), GPU_NO_TE,
     "gradient_accumulation_fusion=True needs the TE layer spec or apex's fused_weight_gradient_mlp_cuda"),
    (ComputeSettings(transformer_engine=False, moe_grouped_gemm=True), GPU_TE,
     "moe_grouped_gemm=True needs transformer_engine=True"),
    (ComputeSettings(recompute_modules=["moe_act"]), CPU, "expected null unless recompute is 'selective'"),
])
def test_a_setting_that_cannot_run_here_is_named(settings, available, needle):
    with pytest.raises(ValueError, match=needle):
        settings.resolve(available)


def test_apex_wgrad_makes_accumulation_fusion_possible_with_the_local_spec():
    ok = ComputeSettings(gradient_accumulation_fusion=True).resolve(
        Available(cuda=True, transformer_engine=False, apex_wgrad=True))
    assert ok.gradient_accumulation_fusion and not ok.transformer_engine


def test_transformer_config_fields():
    fields = ComputeSettings(recompute="full").resolve(GPU_TE).transformer_config_fields()
    assert fields["moe_grouped_gemm"] and fields["gradient_accumulation_fusion"]
    assert (fields["recompute_granularity"], fields["recompute_method"], fields["recompute_num_layers"]) == \
        ("full", "uniform", 1)
    sel = ComputeSettings(recompute="selective", recompute_modules=["core_attn", "layernorm"]).resolve(CPU)
    assert sel.transformer_config_fields()["recompute_modules"] == ["core_attn", "layernorm"]
    with pytest.raises(ValueError, match="resolve"):
        ComputeSettings().transformer_config_fields()


def test_recomputation_reaches_the_model_config():
    from gspo_megatron.actor.build import spec_for_layout
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    c = spec_for_layout(tiny_hf_config(), ParallelLayout(),
                        compute=ComputeSettings(recompute="selective", recompute_modules=["layernorm"])).config
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["layernorm"]
    assert not c.moe_grouped_gemm and not c.gradient_accumulation_fusion


def test_config_error_at_start_names_the_setting(capsys, tmp_path):
    """On this CPU machine: one line, before anything is written or started."""
    from fixtures_models import tiny_model_dir
    from gspo_megatron.cli import main
    assert main(["train", "examples/tiny_moe_larger_digit.yaml", "--set",
                 f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}", "--set",
                 f"checkpoint.dir={tmp_path / 'ck'}", "--set", "compute.moe_grouped_gemm=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("gspo-megatron: error: compute.moe_grouped_gemm=True needs Transformer Engine, "
                       "which does not import here (it needs CUDA and cuDNN)")
    assert not (tmp_path / "ck").exists()
