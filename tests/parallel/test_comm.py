"""Device discipline of collectives (gspo_megatron/parallel/comm.py): every tensor the project
hands to a collective is on the backend's device. NCCL's rule (CUDA tensors only) is imitated on
gloo by comm.strict_checks(): project code that passes a tensor made on the default device fails
as it would on a GPU node. The actor's steps, the weight stream and the checkpoint code run under
it on real gloo process groups."""
from __future__ import annotations

import textwrap

import pytest

from distributed import run_distributed

pytestmark = pytest.mark.slow  # 0.19.2: the same megatron-core paths run in test_actor_layouts' mcore019 layouts (suite time)

# The project's code as the GPU run found it, kept to show the failure: a count made on the
# default device, all-reduced over the data-parallel group.
_OLD_GLOBAL_COUNT = textwrap.dedent("""
    import torch, torch.distributed as dist
    def old_global_count(local):
        t = torch.tensor([local], dtype=torch.long)
        dist.all_reduce(t)
        return int(t.item())
    def fixed_global_count(local):
        t = torch.tensor([local], dtype=torch.long, device=comm_device())
        dist.all_reduce(t)
        return int(t.item())
    def moved_to_host(x):
        y = x.cpu()
        dist.all_reduce(y)
""")


def _strict_mode_cases(rank, world):
    import torch
    from gspo_megatron.parallel.comm import comm_device, strict_checks
    namespace = {"__name__": "gspo_megatron.fake_module", "comm_device": comm_device}
    exec(compile(_OLD_GLOBAL_COUNT, "gspo_megatron/fake_module.py", "exec"), namespace)
    out = {}
    with strict_checks():
        try:
            namespace["old_global_count"](3)
            out["old"] = "no error"
        except RuntimeError as e:
            out["old"] = str(e)
        out["fixed"] = namespace["fixed_global_count"](3)
        try:
            namespace["moved_to_host"](torch.ones(2, requires_grad=False) * 2)
            out["cpu"] = "no error"
        except RuntimeError as e:
            out["cpu"] = str(e)
        t = torch.tensor([1.0])  # test code is not project code: left alone
        torch.distributed.all_reduce(t)
        out["test_code"] = float(t)
    return out


def test_strict_checks_imitate_nccl_for_project_code():
    for r in run_distributed(_strict_mode_cases, 2, timeout=120):
        assert "all_reduce at gspo_megatron.fake_module:" in r["old"], r["old"]
        assert "got a host tensor (made at gspo_megatron.fake_module:" in r["old"]
        assert "No backend type associated with device type cpu" in r["old"]
        assert r["fixed"] == 6
        assert "got a host tensor" in r["cpu"]
        assert r["test_code"] == 2.0


def _everything_under_strict_checks(rank, world, layout_kwargs, root):
    import multiprocessing

    import torch
    multiprocessing.current_process().daemon = False  # dist_checkpointing's writer (see resume test)
    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.batching.batch import TrainBatch
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager
    from gspo_megatron.parallel.comm import strict_checks
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync.stream import build_plan, stream_hf_weights
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    from model_specs.weights.maps import weight_map_for

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (6, 12), generator=g)
    mask = torch.arange(12)[None].expand(6, 12) >= 4
    batch = TrainBatch(tokens=tokens, lengths=torch.full((6,), 12), loss_mask=mask,
                       advantages=torch.randn(6, generator=g),
                       rollout_log_probs=-5.0 * torch.ones(6, 12))
    with strict_checks():
        actor = Actor(tiny_hf_config(), ParallelLayout(**layout_kwargs), micro_batch_size=2,
                      optimizer=OptimizerSettings(lr=1e-3), loss=LossSettings(name="gspo", kl_coef=0.1))
        shard = actor.shard(batch, num_mini_batches=2)
        shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
        actor.set_reference()
        shard.ref_log_probs, _ = actor.compute_ref_log_probs(shard)
        metrics = [actor.train_step(mini) for mini in shard.mini_batches()]
        actor.sft_step(shard, lr=1e-3)
        full = actor.full_state_dict()
        actor.load_full_state_dict(full)
        wmap = weight_map_for(tiny_hf_config())
        plan = build_plan(actor.chunks, wmap)
        streamed = sum(len(b) for b in stream_hf_weights(actor.chunks, wmap, plan, 1 << 16))
        mgr = CheckpointManager(root)
        path = mgr.save(1, actor, LoopState(step=1))
        mgr.load(path, actor)
    return dict(loss=metrics[-1]["loss"], streamed=streamed, names=len(full))


@pytest.mark.parametrize("layout", [dict(tensor=2), dict(pipeline=2), dict(expert=2)],
                         ids=["tp2", "pp2", "ep2"])
def test_actor_sync_and_checkpoint_keep_the_device_discipline(tmp_path, layout):
    out = run_distributed(_everything_under_strict_checks, 2, args=(layout, str(tmp_path)), timeout=300)
    assert out[0]["streamed"] > 0 and out[0]["names"] > 0
    assert all(r["loss"] == out[0]["loss"] for r in out)
