"""A closed Actor gives its memory back at once.

On an H100 benchmarks/mfu.py's configurations ran out of memory at 72.8 GiB when run
in one process, and any new Actor after an out-of-memory did too: the model, its config and the
optimizer refer to each other, so dropping the Actor left them to Python's cycle collector, which
runs by object counts, not bytes. Actor.close() (and `with Actor(...)`) cut the cycles and collect.
On CPU the proof is that every parameter, gradient buffer and optimizer-state tensor is gone
(weak references die) with the cycle collector switched off; on CUDA, memory_allocated() returns
to its level before the Actor.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed


def _batch():
    from gspo_megatron.actor.batching.batch import TrainBatch
    g = torch.Generator().manual_seed(0)
    lengths, t = torch.tensor([10, 7, 10, 5]), torch.arange(10)[None]
    return TrainBatch(tokens=torch.randint(0, 512, (4, 10), generator=g), lengths=lengths,
                      loss_mask=(t >= 3) & (t < lengths[:, None]), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _tensors_of(actor) -> list:
    """Weak references to what holds the Actor's memory: parameters, DDP's param/grad buffers, the
    optimizer's state tensors (Adam moments after a step)."""
    import weakref
    refs = [weakref.ref(p) for p in actor._local_params()]
    for chunk in actor.chunks:
        for buf in chunk.buffers + chunk.expert_parallel_buffers:
            refs += [weakref.ref(t) for t in (buf.param_data, buf.grad_data) if t is not None]
    for sub in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in sub.optimizer.state.values():
            refs += [weakref.ref(v) for v in state.values() if torch.is_tensor(v)]
    return refs


def _close_frees(rank, world, use_with):
    import gc

    from gspo_megatron.actor import Actor, LossSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    gc.collect()
    gc.disable()  # what matters is what close() frees, not when the collector happens to run
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else 0

    def build():
        return Actor(tiny_hf_config(), ParallelLayout(), loss=LossSettings(name="gspo"), micro_batch_size=2)

    def step(actor):
        shard = actor.shard(_batch())
        shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
        actor.train_step(shard)
        return _tensors_of(actor)

    if use_with:
        with build() as actor:
            refs = step(actor)
    else:
        actor = build()
        refs = step(actor)
        actor.close()
        actor.close()  # twice is harmless
    alive = sum(r() is not None for r in refs)
    after = torch.cuda.memory_allocated() if cuda else 0
    # Closed, the Actor refuses work in one line.
    try:
        actor.train_step(_batch())
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return dict(total=len(refs), alive=alive, before=before, after=after, refused=refused)


@pytest.mark.slow
@pytest.mark.parametrize("use_with", [False, True], ids=["close", "with"])
def test_closed_actor_frees_parameters_gradients_and_optimizer_state(use_with):
    out = run_distributed(_close_frees, 1, args=(use_with,), timeout=300)[0]
    assert out["total"] > 60 and out["alive"] == 0, out
    assert out["after"] <= out["before"], out  # CUDA only; 0 == 0 on a CPU
    assert out["refused"] == "this Actor was closed (Actor.close()); build a new one", out
