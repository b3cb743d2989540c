"""HF -> megatron -> (load under a parallel layout -> save) -> HF is bit-exact, and the model the
trainer runs computes what transformers computes on the exported weights.

One spawn of 4 gloo ranks serves every case: each rank loads the converted checkpoint under the
case's layout (TP2xPP2xVPP2xEP2 for a tiny Qwen3-MoE with a dense layer among its MoE layers,
TP2xPP2 for tiny Qwen3 with tied and with untied embeddings), runs a forward pass through megatron's
pipeline schedule, saves the model again, and streams it as the weight sync does (full HF tensors
gathered over TP/EP/PP onto rank 0 in small buckets); the parent exports the saved checkpoint to HF
and checks the stream and the export against the original files.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.mcore019  # also run against megatron-core 0.19.2 (scripts/test.sh)

TOKENS = torch.randint(3, 512, (4, 16), generator=torch.Generator().manual_seed(7))  # [b, s]


def _layout(kind: str):
    from gspo_megatron.parallel.layout import ParallelLayout

    if kind == "moe":
        return ParallelLayout(tensor=2, pipeline=2, virtual_pipeline=2, expert=2, expert_tensor=1)
    return ParallelLayout(tensor=2, pipeline=2)


def _load_forward_save(rank, world, cases):
    """Per case: load under the layout, forward (log-probs + entropy of TOKENS), save elsewhere."""
    from gspo_megatron.actor.batching.micro_batch import MicroBatch
    from gspo_megatron.actor.build import build_model_chunks
    from gspo_megatron.actor.forward import is_last_stage_rank, run_schedule, set_fused
    from gspo_megatron.actor.settings import LogProbSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config, load_model, save_model
    from gspo_megatron.parallel.process_groups import init_process_groups
    from gspo_megatron.sync import build_plan, stream_hf_weights
    from gspo_megatron.actor.build import spec_for_layout
    from model_specs.weights.maps import weight_map_for

    out = {}
    for name, kind, ckpt, saved in cases:
        layout = _layout(kind)
        init_process_groups(layout)
        spec = spec_for_layout(checkpoint_hf_config(ckpt), layout)
        chunks = build_model_chunks(spec, layout)
        load_model(chunks, ckpt)
        set_fused(chunks, False)
        mbs = [MicroBatch(index=i, rows=torch.arange(2), tokens=TOKENS[2 * i:2 * i + 2],
                          position_ids=torch.arange(16).expand(2, 16),
                          loss_mask=torch.ones(2, 16, dtype=torch.bool), advantages=torch.zeros(2),
                          old_log_probs=None, rollout_log_probs=None)
               for i in range(2)]
        got = []

        def keep(mb, log_probs, entropy):
            got.append((log_probs.detach(), entropy))
            return log_probs.sum() * 0, {}

        with torch.no_grad():
            run_schedule(chunks, mbs, LogProbSettings(), keep, forward_only=True)
        if is_last_stage_rank():
            out[name] = (torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got]))
        save_model(chunks, saved, hf_dir=Path(ckpt) / "hf")
        # The weight sync's stream of the same model: full HF tensors on rank 0, small buckets.
        wmap = weight_map_for(checkpoint_hf_config(ckpt))
        plan = build_plan(chunks, wmap)
        streamed = [b for b in stream_hf_weights(chunks, wmap, plan, bucket_bytes=40_000)]
        if rank == 0:
            out[f"{name}/stream"] = ([dict(b) for b in streamed], max(
                sum(t.numel() * t.element_size() for _, t in b) for b in streamed))
        else:
            assert all(b == [] for b in streamed)
    return out


def _hf_logprobs_entropy(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits.float()                        # [b, s, v]
    logp = torch.log_softmax(logits, dim=-1)
    token_lp = logp[:, :-1].gather(2, TOKENS[:, 1:, None])[..., 0]  # [b, s-1]
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]                   # [b, s-1]
    zero = torch.zeros(TOKENS.shape[0], 1)
    return torch.cat([zero, token_lp], 1), torch.cat([zero, entropy], 1)


@pytest.mark.slow
def test_hf_megatron_layouts_hf_bit_exact_and_logits_match(tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf

    models = {
        "qwen3_moe": ("moe", make_tiny_model("qwen3_moe", tmp_path / "hf-moe", seed=1,
                                             num_hidden_layers=4, mlp_only_layers=[2])),
        "qwen3_tied": ("dense", make_tiny_model("qwen3", tmp_path / "hf-tied", seed=2,
                                                tie_word_embeddings=True)),
        "qwen3_untied": ("dense", make_tiny_model("qwen3", tmp_path / "hf-untied", seed=3)),
    }
    cases = []
    for name, (kind, hf_dir) in models.items():
        ckpt = convert_hf_to_megatron(hf_dir, tmp_path / f"mcore-{name}")
        cases.append((name, kind, str(ckpt), str(tmp_path / f"resaved-{name}")))
    results = run_distributed(_load_forward_save, 4, (cases,), timeout=600)
    forward = {k: v for r in results for k, v in r.items()}

    for name, (kind, hf_dir) in models.items():
        exported = convert_megatron_to_hf(tmp_path / f"resaved-{name}", tmp_path / f"export-{name}")
        original = load_file(hf_dir / "model.safetensors")
        again = load_file(exported / "model.safetensors")
        assert sorted(again) == sorted(original), name
        for key, t in original.items():
            assert again[key].dtype == t.dtype and torch.equal(again[key], t), (name, key)

        buckets, biggest = forward[f"{name}/stream"]
        assert len(buckets) > 3 and biggest <= 40_000 + 512 * 64 * 4  # bounded (one big tensor alone)
        streamed = {k: v for b in buckets for k, v in b.items()}
        assert sorted(streamed) == sorted(original), name
        for key, t in original.items():
            assert torch.equal(streamed[key], t), (name, "stream", key)

        log_probs, entropy = forward[name]
        hf_log_probs, hf_entropy = _hf_logprobs_entropy(exported)
        torch.testing.assert_close(log_probs, hf_log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, hf_entropy, atol=1e-5, rtol=0)
        print(f"{name}: max |megatron - transformers| log-prob "
              f"{(log_probs - hf_log_probs).abs().max():.3g}, entropy "
              f"{(entropy - hf_entropy).abs().max():.3g}")
