"""The newer MoE families (Qwen2-MoE: gated shared expert; GLM-4.5: sigmoid routing with expert
bias, groups, scaling, a plain shared expert, dense first layer, partial RoPE) through the weight
sync into a real SGLang server: after a GSPO step under EP2, the server's log-probs equal the
trainer's, as tests/sync/test_weight_sync_sglang.py checks for Qwen3. One server per family (~30 s each)."""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from fixtures_models import tiny_model_dir
from fixtures_servers import launch_tiny_server
from test_weight_sync_sglang import PROMPT, _gspo_step, _trainer_log_probs

pytestmark = pytest.mark.slow


def _step_and_sync(rank, world, ckpt, url):
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import TensorTransport, WeightSync
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(expert=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=2e-3, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None

    def server():
        out = [None]
        if rank == 0:
            g = pool.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})
            out = [(g.output_ids, torch.tensor(g.logprobs))]
        torch.distributed.broadcast_object_list(out, src=0)
        return out[0]

    before_ids, before_lp = server()
    start = _trainer_log_probs(actor, PROMPT + before_ids, len(PROMPT))
    _gspo_step(actor, seed=1)
    WeightSync(actor.chunks, hf, TensorTransport(pool) if rank == 0 else None, pool,
               bucket_bytes=50_000).sync(version="stepped")
    ids, lp = server()
    mine = _trainer_log_probs(actor, PROMPT + ids, len(PROMPT))
    if mine is None:
        return None
    moved = _trainer_log_probs(actor, PROMPT + before_ids, len(PROMPT))
    return dict(initial=float((start - before_lp).abs().max()), synced=float((mine - lp).abs().max()),
                moved=float((moved - before_lp).abs().max()))


@pytest.mark.parametrize("arch", ["qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_gspo_step_then_sync(arch, tmp_path):
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    ckpt = convert_hf_to_megatron(tiny_model_dir(arch, 0), tmp_path / "mcore")
    with launch_tiny_server(arch) as group:
        results = run_distributed(_step_and_sync, 2, (str(ckpt), group.server_urls[0]), timeout=600)
    r = next(x for x in results if x is not None)
    print(f"{arch}: before the step |sglang - trainer| {r['initial']:.2e}; the step moved the "
          f"trainer by {r['moved']:.2e}; after the sync {r['synced']:.2e}")
    assert r["initial"] < 1e-4 and r["moved"] > 1e-3 and r["synced"] < 1e-4
