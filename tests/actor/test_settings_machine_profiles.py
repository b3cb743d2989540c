"""Every machine profile's resolved compute settings build a model, and a GSPO step runs.

A GPU node has CUDA and usually Transformer Engine but not NVIDIA apex (not on PyPI). On an H100
every actor build once crashed there (docs/results.md): the defaults turned gradient_accumulation_fusion on
with the TE spec, and megatron's own ColumnParallelLinear (the output layer, in either spec)
refuses that flag without apex's fused_weight_gradient_mlp_cuda. CI has no GPU, so each profile is
resolved here and the parts of its model that can be built on a CPU (the local-spec layers and the
output layer, with the profile's flags) are built through the actor's own code, so that
megatron's constructor checks run; then a train step runs its backward, where a native linear
left fused would call the missing extension (NameError). TE's own layers are checked on a GPU
(scripts/gpu_check.sh).
"""
from __future__ import annotations

import pytest

from distributed import run_distributed
from gspo_megatron.actor.settings import Available, ComputeSettings

PROFILES = {
    "cpu": Available(cuda=False, transformer_engine=False, apex_wgrad=False),
    "cuda": Available(cuda=True, transformer_engine=False, apex_wgrad=False),
    "cuda+te": Available(cuda=True, transformer_engine=True, apex_wgrad=False, te_version="2.20.2"),
    "cuda+te+apex": Available(cuda=True, transformer_engine=True, apex_wgrad=True, te_version="2.20.2"),
}
# TransformerConfig fields of the resolved settings that a local-spec model on a CPU can take: the
# rest name TE or CUDA kernels (grouped GEMM, permute and RoPE fusion, fused SwiGLU) that megatron
# checks for in TransformerConfig itself, before any layer exists.
CPU_BUILDABLE = ("gradient_accumulation_fusion", "recompute_granularity", "recompute_method",
                 "recompute_num_layers", "recompute_modules")


def _build_and_step(rank, world, profiles):
    import torch
    from megatron.core import tensor_parallel

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.batching.batch import TrainBatch
    from gspo_megatron.actor.build import _native_linears_buildable_without_apex
    from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs import model_spec_for
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config

    layout = ParallelLayout()
    g = torch.Generator().manual_seed(0)
    lengths, t = torch.tensor([12, 9, 7, 12]), torch.arange(12)[None]
    batch = TrainBatch(tokens=torch.randint(0, 512, (4, 12), generator=g), lengths=lengths,
                       loss_mask=(t >= 4) & (t < lengths[:, None]),
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    out = {}
    for name, (available, settings) in profiles.items():
        resolved = settings.resolve(available)
        fields = {k: v for k, v in resolved.transformer_config_fields().items() if k in CPU_BUILDABLE}
        spec = model_spec_for(tiny_hf_config(), overrides={
            **layout.transformer_config_fields(is_moe=True), **cpu_config_overrides(), **fields},
            transformer_engine=False)
        # apex cannot be installed here: where the profile has it, megatron's import-time flag
        # says so (its constructor check passes; no backward runs, it would call the extension).
        with _native_linears_buildable_without_apex(available.apex_wgrad):
            actor = Actor(spec, layout, optimizer=OptimizerSettings(optimizer="sgd", lr=0.1),
                          loss=LossSettings(name="gspo"), micro_batch_size=2, available=available)
        model = actor.models[0]
        native = {n: m.gradient_accumulation_fusion for n, m in model.named_modules()
                  if isinstance(m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear))}
        row = dict(config_fusion=model.config.gradient_accumulation_fusion, native=native,
                   recompute=model.config.recompute_granularity)
        if not available.apex_wgrad:
            shard = actor.shard(batch)
            shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
            row["metrics"] = actor.train_step(shard)
        actor.close()
        out[name] = row
    return out


@pytest.mark.slow
@pytest.mark.mcore019
def test_every_profile_builds_and_trains_with_its_resolved_flags():
    cases = {name: (available, ComputeSettings()) for name, available in PROFILES.items()}
    cases["cuda+te, recompute selective"] = (PROFILES["cuda+te"], ComputeSettings(recompute="selective"))
    cases["cuda+te, recompute full"] = (PROFILES["cuda+te"], ComputeSettings(recompute="full"))
    out = run_distributed(_build_and_step, 1, args=(cases,), timeout=300)[0]
    for name, (available, settings) in cases.items():
        row = out[name]
        want = settings.resolve(available).gradient_accumulation_fusion
        assert row["config_fusion"] == want, name
        assert "output_layer" in row["native"] and len(row["native"]) > 2, name
        # A native linear keeps the fusion only where apex can run it.
        assert set(row["native"].values()) == {want and available.apex_wgrad}, (name, row["native"])
        if "metrics" in row:
            m = row["metrics"]
            assert m["update_successful"] == 1.0 and m["grad_norm"] > 0, (name, m)
    assert out["cuda+te"]["config_fusion"]  # TE's layers keep the fused accumulation
    assert out["cuda+te, recompute full"]["recompute"] == "full"
    # One step from the same weights and batch: the flags change how, not what, is computed.
    losses = {name: row["metrics"]["loss"] for name, row in out.items() if "metrics" in row}
    grads = {name: row["metrics"]["grad_norm"] for name, row in out.items() if "metrics" in row}
    assert max(losses.values()) - min(losses.values()) < 1e-6, losses
    assert max(grads.values()) - min(grads.values()) < 1e-5, grads


def test_resolved_defaults_per_profile():
    """What each machine gets when the config leaves compute: at null."""
    got = {name: ComputeSettings().resolve(a) for name, a in PROFILES.items()}
    assert not got["cpu"].gradient_accumulation_fusion and not got["cpu"].transformer_engine
    assert not got["cuda"].gradient_accumulation_fusion and got["cuda"].bias_activation_fusion
    for name in ("cuda+te", "cuda+te+apex"):
        assert got[name].transformer_engine and got[name].moe_grouped_gemm
        assert got[name].gradient_accumulation_fusion  # TE's layers fuse it without apex
    assert "output layer unfused" in got["cuda+te"].describe(PROFILES["cuda+te"])
    assert "output layer unfused" not in got["cuda+te+apex"].describe(PROFILES["cuda+te+apex"])
