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


# ------------------------------------------------------------------ what the process keeps
def _tensors_alive() -> list:
    """Every torch.Tensor the collector can see (type() rather than isinstance: some objects'
    __class__ is a property that warns)."""
    import gc
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _te_stand_in():
    """Transformer Engine's module of workspaces as TE 2.x keeps them (release.TE_BASE), for the
    TE profiles: TE does not import without CUDA, so this double stands in for its globals, empty
    until the Actor's life fills them as TE's first GEMMs would."""
    import types

    from gspo_megatron.actor.release import TE_BASE
    base = types.ModuleType(TE_BASE)
    base._cublas_workspace, base._multi_stream_cublas_workspace = None, []
    base._dummy_wgrads, base._ub_communicators = {}, None
    return base


def _fill_te_workspaces(base) -> int:
    base._cublas_workspace = torch.empty(1024, dtype=torch.uint8)
    base._multi_stream_cublas_workspace = [torch.empty(1024, dtype=torch.uint8) for _ in range(4)]
    base._dummy_wgrads[(8, 8, torch.float32)] = torch.empty(8, 8)
    return 5 * 1024 + 8 * 8 * 4


def _profile_lives(rank, world, profiles):
    """Per machine profile: the tensors alive before an Actor is built (after a GSPO step, where
    the profile can take one) and after it closed; then two Actors at once, the first closed."""
    import sys

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.actor.build import _native_linears_buildable_without_apex
    from gspo_megatron.actor.release import TE_BASE, storage_bytes
    from gspo_megatron.parallel.cpu_compat import cpu_config_overrides
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs import model_spec_for
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    from test_settings_machine_profiles import CPU_BUILDABLE

    def build(available, settings):
        fields = {k: v for k, v in settings.resolve(available).transformer_config_fields().items()
                  if k in CPU_BUILDABLE}
        spec = model_spec_for(tiny_hf_config(), overrides={
            **ParallelLayout().transformer_config_fields(is_moe=True), **cpu_config_overrides(), **fields},
            transformer_engine=False)
        with _native_linears_buildable_without_apex(available.apex_wgrad):
            return Actor(spec, ParallelLayout(), optimizer=OptimizerSettings(optimizer="sgd", lr=0.1),
                         loss=LossSettings(name="gspo"), micro_batch_size=2, available=available)

    def step(actor):
        shard = actor.shard(_batch())
        shard.old_log_probs, _ = actor.compute_old_log_probs(shard)
        actor.train_step(shard)

    out = {}
    for name, (available, settings) in profiles.items():
        base = _te_stand_in() if available.transformer_engine else None
        if base is not None:
            sys.modules[TE_BASE] = base
        before = _tensors_alive()  # held: no id of these is reused by a tensor made later
        known = {id(t) for t in before}
        actor = build(available, settings)
        planted = _fill_te_workspaces(base) if base is not None else 0
        if not available.apex_wgrad:  # apex's extension is not here: no backward (profile test)
            step(actor)
        actor.close()
        left = [t for t in _tensors_alive() if id(t) not in known]
        sys.modules.pop(TE_BASE, None)
        out[name] = dict(left=[f"{tuple(t.shape)} {t.dtype}" for t in left], left_bytes=storage_bytes(left),
                         released=actor.released, planted=planted)
        del before, left, actor
    available, settings = profiles["cpu"]
    first, second = build(available, settings), build(available, settings)
    first.close()
    step(second)  # megatron's RNG states are still there for the Actor left open
    second.close()
    out["two at once"] = dict(first=first.released, second=second.released)
    return out


@pytest.mark.slow
@pytest.mark.mcore019
def test_nothing_of_an_actor_stays_alive_after_close_on_any_machine_profile():
    """Every tensor alive once an Actor closed was alive before it was built, for every machine
    profile (tests/actor/test_settings_machine_profiles.py fakes them): megatron's RNG states, its
    aux-loss scale and the CPU causal-mask cache stayed before Actor.close freed them, and the
    TE profiles' workspaces (a stand-in for TE's module: _te_stand_in) would. On a GPU the same
    close frees torch's cuBLAS workspaces, which no tensor holds: tools/gpu_check.py's memory
    row measures them (docs/results.md)."""
    from test_settings_machine_profiles import PROFILES

    from gspo_megatron.actor.settings import ComputeSettings
    profiles = {name: (available, ComputeSettings()) for name, available in PROFILES.items()}
    out = run_distributed(_profile_lives, 1, args=(profiles,), timeout=600)[0]
    for name, available in PROFILES.items():
        row = out[name]
        assert row["left"] == [] and row["left_bytes"] == 0, (name, row)
        assert row["released"]["megatron's RNG tracker"] > 0, (name, row)  # the last Actor of its process
        assert ("torch's cuBLAS workspaces" in row["released"]) == available.cuda, (name, row)
        if available.transformer_engine:
            assert row["released"]["Transformer Engine's workspaces"] == row["planted"] > 0, (name, row)
    two = out["two at once"]
    assert "megatron's RNG tracker" not in two["first"], two  # the second was still open
    assert two["second"]["megatron's RNG tracker"] > 0, two
