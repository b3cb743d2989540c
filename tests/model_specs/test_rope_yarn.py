"""YaRN RoPE scaling (model_specs/features/rope/): megatron's frequencies and attention factor as
transformers computes them, and log-probs equal to transformers' (1e-5, fp32) at positions far
beyond the original context length, for Qwen3, Qwen3-MoE and Qwen2-MoE; other rope types named.
Slow: a real SGLang server on the same model directory applies the same YaRN (what the run's
servers do: they read the same config.json).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from distributed import gather_row_values, run_distributed
from fixtures_models import transformers_log_probs
from model_specs import HFConfigError, model_spec_for
from model_specs.hf.tiny import qwen3, qwen3_moe
from tools.make_tiny_model import make_tiny_model

ORIGINAL, ROWS, SEQ, TOL = 64, 3, 160, 1e-5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
VARIANTS = {
    "plain": YARN,
    "betas_no_truncate": dict(YARN, factor=8.0, beta_fast=16, beta_slow=2, truncate=False),
    "mscale_ratio": dict(YARN, mscale=1.3, mscale_all_dim=0.7),
    "mscale_without_all_dim": dict(YARN, mscale=1.3),  # HF: only both set count, else 0.1 ln f + 1
    "attention_factor": dict(YARN, attention_factor=1.25),
}


def _hf_config_object(scaling: dict, theta: float = 1e6):
    import transformers

    return transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rope_parameters=dict(scaling, rope_theta=theta))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_frequencies_and_attention_factor_are_transformers(variant):
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gspo_megatron.parallel.cpu_compat import apply
    apply()  # YarnRotaryEmbedding moves its frequencies to torch.cuda.current_device()
    scaling = VARIANTS[variant]
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](_hf_config_object(scaling))
    spec = model_spec_for(qwen3(rope_scaling=scaling, rope_theta=1e6,
                                               max_position_embeddings=4096))
    c = spec.config
    assert spec.position_embedding_type == "yarn" and spec.gpt_model_kwargs()["rotary_base"] == 1e6
    rope = YarnRotaryEmbedding(  # as GPTModel.__init__ builds it
        kv_channels=c.kv_channels, rotary_percent=spec.rotary_percent, rotary_base=spec.rotary_base,
        scaling_factor=c.yarn_rotary_scaling_factor,
        original_max_position_embeddings=c.yarn_original_max_position_embeddings,
        beta_fast=c.yarn_beta_fast, beta_slow=c.yarn_beta_slow, mscale=c.yarn_mscale,
        mscale_all_dim=c.yarn_mscale_all_dim,
        correction_range_round_to_int=c.yarn_correction_range_round_to_int,
        use_cpu_initialization=True)
    emb, mscale = rope.get_emb(SEQ)                                          # [s, 1, 1, d]
    positions = torch.arange(SEQ, dtype=torch.float32)[:, None]
    want = torch.cat([positions * inv_freq, positions * inv_freq], dim=-1)  # HF's freqs
    torch.testing.assert_close(emb[:, 0, 0], want, rtol=1e-6, atol=1e-6)
    assert mscale == 1.0  # megatron's own factor is pinned; the factor is in softmax_scale:
    assert c.softmax_scale == pytest.approx(attention ** 2 / math.sqrt(16), rel=1e-12)


def test_yarn_is_rejected_where_megatron_would_compute_something_else():
    with pytest.raises(HFConfigError, match="YaRN rope_scaling lacks 'factor'"):
        model_spec_for(qwen3(rope_scaling={"rope_type": "yarn",
                                                          "original_max_position_embeddings": 64}))
    no_original = model_spec_for(qwen3(rope_scaling={"rope_type": "yarn",
                                                                    "factor": 4.0}))
    assert no_original.config.yarn_original_max_position_embeddings == 2048  # as transformers
    with pytest.raises(HFConfigError, match="YaRN factor=0.5, expected >= 1"):
        model_spec_for(qwen3(rope_scaling=dict(YARN, factor=0.5)))
    for rope_type in ("llama3", "linear", "dynamic", "longrope"):
        with pytest.raises(HFConfigError, match=f"rope_type='{rope_type}' is not supported"):
            model_spec_for(qwen3(rope_scaling={"rope_type": rope_type, "factor": 2.0}))
    # transformers 5 spelling (rope_parameters) and the legacy one (rope_scaling.type) map alike
    new = model_spec_for(qwen3_moe(rope_parameters=dict(YARN, rope_theta=5e5)))
    old = model_spec_for(qwen3_moe(rope_scaling={"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64},
                                                  rope_theta=5e5))
    assert new.rotary_base == old.rotary_base == 5e5
    assert new.config.softmax_scale == old.config.softmax_scale
    assert new.config.yarn_original_max_position_embeddings == 64


# ---------------------------------------------------------------- end to end
MODELS = {  # arch -> rope_scaling
    "qwen3": YARN,
    "qwen3_moe": VARIANTS["mscale_ratio"],
    "qwen2_moe": VARIANTS["betas_no_truncate"],
}


def make_batch():
    from gspo_megatron.actor.batching.batch import TrainBatch

    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([SEQ, SEQ - 37, SEQ])
    t = torch.arange(SEQ)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, 512, (ROWS, SEQ), generator=g), 0)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=(t >= 1) & (t < lengths[:, None]),
                      advantages=torch.zeros(ROWS))


def _log_probs(rank, world, cases):
    from gspo_megatron.actor.actor import Actor
    from gspo_megatron.actor.weights.full import load_full_state_dict
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.weights.maps import weight_map_for
    from safetensors.torch import load_file

    out = {}
    for name, hf_dir in cases:
        actor = Actor(hf_dir, ParallelLayout(), micro_batch_size=3)
        hf = load_file(Path(hf_dir) / "model.safetensors")
        wmap = weight_map_for(actor.spec.hf_config)
        load_full_state_dict(actor.chunks, {m.megatron: wmap.to_megatron(m, [hf[n] for n in m.hf])
                                            for m in wmap.mappings()})
        shard = actor.shard(make_batch())
        old, _ = actor.compute_old_log_probs(shard)
        out[name] = (shard.global_rows.numpy(), old.numpy())
    return out


def _transformers_log_probs(hf_dir: Path, **config_changes) -> torch.Tensor:
    """[ROWS, SEQ] log p(token t | tokens < t) from transformers (fp32) on make_batch(), NaN where
    undefined."""
    batch = make_batch()
    return transformers_log_probs(hf_dir, batch.tokens, batch.lengths, **config_changes)


@pytest.fixture(scope="module")
def yarn_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("yarn")
    return {arch: make_tiny_model(arch, root / arch, seed=2,
                                  rope_parameters=dict(scaling, rope_theta=1e5))
            for arch, scaling in MODELS.items()}


@pytest.fixture(scope="module")
def megatron_log_probs(yarn_models):
    cases = [(arch, str(path)) for arch, path in yarn_models.items()]
    return run_distributed(_log_probs, 1, (cases,), timeout=600)[0]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_log_probs_beyond_the_original_context_equal_transformers(yarn_models, megatron_log_probs,
                                                                  arch):
    got = gather_row_values([megatron_log_probs[arch]], ROWS, SEQ)
    want = _transformers_log_probs(yarn_models[arch])
    valid = make_batch().loss_mask
    beyond = valid & (torch.arange(SEQ)[None] > ORIGINAL)
    err, err_beyond = (float((got - want)[m].abs().max()) for m in (valid, beyond))
    print(f"{arch} YaRN {MODELS[arch]}: max |megatron - transformers| log-prob {err:.3g} "
          f"(positions > {ORIGINAL}: {err_beyond:.3g})")
    assert beyond.sum() > 150 and err <= TOL and err_beyond <= TOL
    # The comparison sees YaRN: without it transformers' answer is far from megatron's.
    plain = _transformers_log_probs(yarn_models[arch], rope_parameters={"rope_type": "default",
                                                                        "rope_theta": 1e5})
    assert float((got - plain)[beyond].abs().max()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_runs_sglang_server_applies_the_same_yarn(yarn_models, arch):
    """The SGLang server a run starts reads the rope settings from the same config.json: its
    log-probs of tokens beyond the original context equal transformers' (1e-4, the bound of
    test_rollout_logprobs), and transformers without YaRN is far from them."""
    import random

    from rollout.servers.pool import ServerPool
    from rollout.servers.launch import ServerConfig, ServerGroup
    path = yarn_models[arch]
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(2 * ORIGINAL)]
    with ServerGroup.launch(ServerConfig(model_path=str(path), device="cpu", startup_timeout_s=300)) as group:
        out = ServerPool(group.server_urls).generate(prompt, {"max_new_tokens": 24, "temperature": 1.0,
                                                              "ignore_eos": True})
    ids = torch.tensor([prompt + list(out.output_ids)])
    lengths = torch.tensor([ids.shape[1]])
    got = torch.tensor(out.logprobs)
    want = transformers_log_probs(path, ids, lengths)[0, len(prompt):]
    plain = transformers_log_probs(path, ids, lengths, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 1e5})[0, len(prompt):]
    err = float((got - want).abs().max())
    print(f"{arch}: max |sglang - transformers| log-prob at positions {len(prompt)}-{ids.shape[1] - 1} "
          f"(original context {ORIGINAL}): {err:.3g}")
    assert len(got) == 24 and err < 1e-4
    assert float((got - plain).abs().max()) > 1e-3
