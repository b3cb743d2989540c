"""Checkpoint manager: exact round trip (model, optimizer, scheduler, RNG, loop state) under a
parallel layout, atomic visibility (an interrupted save never becomes `latest`), pruning.
The end-to-end kill-and-resume of a training run is in tests/trainer/test_trainer_resume.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distributed import run_distributed

pytestmark = pytest.mark.mcore019  # also run against megatron-core 0.19.2 (scripts/test.sh)


def _build(layout_kwargs, dist_opt):
    from gspo_megatron.actor import Actor
    from gspo_megatron.actor.settings import OptimizerSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    from model_specs.hf.tiny import qwen3_moe as tiny_hf_config
    return Actor(tiny_hf_config(), ParallelLayout(**layout_kwargs), seed=7,
                 optimizer=OptimizerSettings(lr=1e-2, use_distributed_optimizer=dist_opt,
                                             lr_decay_style="linear", lr_decay_steps=10))


def _one_step(actor):
    import torch
    for c in actor.chunks:
        c.zero_grad_buffer()
    actor.optimizer.zero_grad()
    for c in actor.chunks:
        for p in c.parameters():
            p.main_grad.copy_(torch.randn_like(p) * 0.01)
    actor.optimizer.step()
    actor.scheduler.step(1)


def _params(chunks):
    return {n: p.detach().clone() for i, c in enumerate(chunks) for n, p in
            c.module.named_parameters(prefix=f"c{i}")}


def _roundtrip(rank, world, root, layout_kwargs, dist_opt):
    import multiprocessing
    import random
    # dist_checkpointing's writer starts a multiprocessing Manager; run_distributed's ranks are
    # daemonic (not allowed children). torchrun's ranks are not: lift the flag, as they are.
    multiprocessing.current_process().daemon = False

    import torch
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager
    actor = _build(layout_kwargs, dist_opt)
    _one_step(actor)
    mgr = CheckpointManager(root, keep=2)
    mgr.clean_incomplete()
    loop = LoopState(step=1, data_cursor={"epoch": 0, "index": 5},
                     rollout_buffer={"buffer": [[{"x": 1}]]}, weight_version=3)
    path = mgr.save(1, actor, loop)
    saved = _params(actor.chunks)
    after_rng = (torch.rand(3), random.random())
    # Continue one step from the live state, then restore and repeat: must match bit for bit.
    _one_step(actor)
    cont = _params(actor.chunks)
    lr_cont = actor.optimizer.param_groups[0]["lr"]
    actor2 = _build(layout_kwargs, dist_opt)
    loop2 = mgr.load(mgr.latest(), actor2)
    restored = _params(actor2.chunks)
    rng_again = (torch.rand(3), random.random())
    _one_step(actor2)
    cont2 = _params(actor2.chunks)
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    return dict(path=str(path), loop=loop2.to_dict(), restored=same(saved, restored),
                continued=same(cont, cont2), rng=torch.equal(after_rng[0], rng_again[0])
                and after_rng[1] == rng_again[1], lr=(lr_cont, actor2.optimizer.param_groups[0]["lr"]))


@pytest.mark.slow
def test_checkpoint_roundtrip_is_exact_ep2_distributed_optimizer(tmp_path):
    # EP2 (DP2 for the dense part) with the distributed optimizer: expert shards, optimizer shards,
    # and megatron's shared-Adam-step bug on load (model_io.unshare_adam_steps) all exercised.
    out = run_distributed(_roundtrip, 2, (str(tmp_path), dict(expert=2), True), timeout=240)
    for r in out:
        assert r["restored"] and r["continued"] and r["rng"], r
        assert r["lr"][0] == r["lr"][1]
        assert r["loop"]["data_cursor"] == {"epoch": 0, "index": 5}
        assert r["loop"]["rollout_buffer"] == {"buffer": [[{"x": 1}]]}
        assert r["loop"]["weight_version"] == 3 and r["loop"]["scheduler"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def test_latest_pointer_and_incomplete_dirs(tmp_path):
    from gspo_megatron.checkpoint.manager import CheckpointError, CheckpointManager
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() is None
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "COMPLETE").write_text("2\n")
    (tmp_path / "step_00000004.tmp").mkdir()  # a save killed half-way
    (tmp_path / "step_00000005").mkdir()      # no COMPLETE marker: never valid
    assert mgr.latest() == tmp_path / "step_00000002"
    (tmp_path / "latest").write_text("step_00000002\n")
    assert mgr.latest() == tmp_path / "step_00000002"
    mgr.clean_incomplete()
    assert not (tmp_path / "step_00000004.tmp").exists()
    (tmp_path / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        mgr.latest()


class FakeActor:
    """Stands in for the Actor's model/optimizer part of a checkpoint (the manager's protocol)."""

    def save(self, path):
        path.mkdir(parents=True)
        (path / "weights.bin").write_bytes(b"x" * 1000)
        if os.environ.get("SLOW_SAVE"):
            import time
            (Path(os.environ["SLOW_SAVE"])).write_text("saving")
            time.sleep(60)
        return {}

    def load(self, path, scheduler_state):
        pass


_KILL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {here!r}]  # the tests' helpers, and this module
    from pathlib import Path
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager
    from test_checkpoint_manager import FakeActor
    mgr = CheckpointManager(Path({root!r}), keep=2)
    step = int(sys.argv[1])
    mgr.save(step, FakeActor(), LoopState(step=step))
""")


@pytest.mark.slow
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    root, marker = tmp_path / "ck", tmp_path / "saving"
    script = tmp_path / "save.py"
    here = Path(__file__).resolve().parent
    script.write_text(_KILL_SCRIPT.format(tests=str(here.parent), here=str(here), root=str(root)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    from gspo_megatron.checkpoint.loop_state import LoopState
    from gspo_megatron.checkpoint.manager import CheckpointManager
    for step in (1, 2, 3):
        CheckpointManager(root, keep=2).save(step, FakeActor(), LoopState(step=step))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    proc = subprocess.Popen([sys.executable, str(script), "4"], env={**env, "SLOW_SAVE": str(marker)})
    for _ in range(600):
        if marker.exists() or proc.poll() is not None:  # saving, or failed (asserted below)
            break
        import time
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from gspo_megatron.checkpoint.loop_state import load_driver_state
    mgr = CheckpointManager(root)
    assert (root / "step_00000004.tmp").exists()
    assert mgr.latest() == root / "step_00000003"
    assert load_driver_state(mgr.latest()).step == 3
