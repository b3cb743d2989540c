"""The disk transport on a disk without room, on a real small file system (a tmpfs mounted for the
test: root only, skipped elsewhere), and the start check of `sync.delta`:
- `gspo-megatron train` with sync.dir on a file system without room for two copies of the model
  is refused at start: one line naming sync.dir, exit 2, nothing written;
- a disk that fills up during a sync stops it on every rank with WeightSyncError (a runtime stop,
  exit 3) whose message is one line, and leaves no `weights-<version>` folder; the server keeps
  its version, paused, until the next sync (here through the tensor transport) succeeds;
- sync.delta=true with the disk transport (which carries whole tensors only) is refused at start.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_distributed
from faults_common import CONFIG
from fixtures_models import tiny_model_dir
from test_trainer_e2e import ROOT, env
from test_weight_sync_sglang import _gspo_step


@pytest.fixture
def small_disk(tmp_path):
    """mount(kib) -> a folder on a tmpfs of `kib` KiB, unmounted after the test."""
    mounted = []

    def mount(kib: int) -> Path:
        folder = tmp_path / f"small-{len(mounted)}"
        folder.mkdir()
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)],
                             capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({got.stderr.strip()}): a full disk needs one")
        mounted.append(folder)
        return folder
    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


def _train(tmp_path: Path, *sets: str) -> tuple[int, list[str]]:
    run = tmp_path / "run"
    args = [CONFIG, "--set", f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}", "--set",
            f"checkpoint.dir={run / 'ck'}", "--set", f"logging.tensorboard_dir={run / 'tb'}",
            "--set", "checkpoint.export_hf=null"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert not run.exists(), proc.stderr[-3000:]
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.slow
def test_a_sync_dir_without_room_is_refused_at_start(tmp_path, small_disk):
    folder = small_disk(512)  # the tiny model's weights are 565 KB: two copies do not fit
    code, lines = _train(tmp_path, "sync.transport=disk", f"sync.dir={folder}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"gspo-megatron: error: sync.dir='{folder}': ") and \
        "free, the disk transport (2 copies of the model's weights) needs about 1.1 MiB" in lines[0], lines
    assert list(folder.iterdir()) == []


@pytest.mark.slow
def test_a_checkpoint_and_the_sync_copies_on_one_disk_must_fit_together(tmp_path, small_disk):
    """The conversion and one checkpoint (2.2 MB) fit, the disk transport's two copies (1.1 MB) fit,
    both do not (2.8 MiB): refused at start, not at the first save."""
    folder = small_disk(2900)
    code, lines = _train(tmp_path, "sync.transport=disk", f"checkpoint.dir={folder / 'ck'}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"gspo-megatron: error: checkpoint.dir='{folder / 'ck'}': 2.8 MiB free, the initial "
                               "conversion and one checkpoint (parameters + optimizer state, estimated from the "
                               "model) (2.1 MiB) and the disk transport (2 copies of the model's weights) (1.1 MiB, "
                               "sync.dir) needs about 3.2 MiB"), lines
    assert list(folder.iterdir()) == []


def test_delta_on_a_transport_without_deltas_is_refused_at_start(tmp_path):
    code, lines = _train(tmp_path, "sync.transport=disk", "sync.delta=true")
    assert code == 2 and lines == [
        "gspo-megatron: error: sync.delta=true: the disk transport carries whole tensors only; set "
        "sync.delta to null (deltas where the transport can) or false, or choose a sync.transport "
        "that carries them (tensor, distributed)"], lines


def _fill_up(rank, world, ckpt, url, root):
    import os

    import torch

    from gspo_megatron.actor import Actor, LossSettings, OptimizerSettings
    from gspo_megatron.checkpoint import checkpoint_hf_config
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.sync import DiskTransport, TensorTransport, WeightSync, WeightSyncError
    from rollout.servers.pool import ServerPool

    hf = checkpoint_hf_config(ckpt)
    actor = Actor(hf, ParallelLayout(tensor=2), micro_batch_size=2,
                  optimizer=OptimizerSettings(lr=2e-3, clip_grad=0.0), loss=LossSettings(name="gspo"))
    actor.load_weights(ckpt)
    pool = ServerPool([url]) if rank == 0 else None
    sync = WeightSync(actor.chunks, hf, DiskTransport(pool, root, f"{ckpt}/hf") if rank == 0 else None,
                      pool, bucket_bytes=100_000)
    before = list(pool.weight_versions().values()) if rank == 0 else None
    _gspo_step(actor, seed=1)
    with pytest.raises(WeightSyncError) as stopped:
        sync.sync(version="filled")
    out = {"message": str(stopped.value), "exit_code": stopped.value.exit_code, "stale": sync.stale}
    if rank == 0:
        out.update(folders=sorted(os.listdir(root)), before=before,
                   versions=list(pool.weight_versions().values()))
        sync.transport = TensorTransport(pool)
    out["after"] = sync.sync(version="after")["full_syncs"]  # (rank 0's view)
    if rank == 0:
        out["versions_after"] = list(pool.weight_versions().values())
        gen = pool.generate([5, 7, 9], {"max_new_tokens": 2})  # generating again
        out["labels"] = sorted(set(gen.weight_versions))
    torch.distributed.barrier()
    return out


@pytest.mark.slow
def test_a_disk_that_fills_up_during_a_sync_stops_it_in_one_line(qwen3_server, tmp_path, small_disk):
    from gspo_errors import EXIT_RUNTIME
    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron
    from rollout.servers.pool import ServerPool

    hf_dir = tiny_model_dir("qwen3", 0)  # what the session server serves (561 KB of weights)
    url = qwen3_server.server_urls[0]
    root = small_disk(160)  # the config and tokenizer files fit, the weights do not
    ckpt = convert_hf_to_megatron(hf_dir, tmp_path / "mcore")
    try:
        results = run_distributed(_fill_up, 2, (str(ckpt), url, str(root)), timeout=600)
    finally:  # the session server must serve the seed-0 weights again
        pool = ServerPool([url])
        pool.continue_generation()
        pool.update_weights_from_disk(str(hf_dir), weight_version="default")
    r0 = results[0]
    print(f"a full sync.dir: {r0['message']}")
    for r in results:
        assert r["exit_code"] == EXIT_RUNTIME and r["stale"] and "\n" not in r["message"], r
        assert r["message"] == r0["message"]
    assert r0["message"].startswith("weight sync to version filled failed: rank 0: DiskWriteError: writing "
                                    f"{root}/weights-filled/"), r0["message"]
    assert "No space left on device" in r0["message"] and "MiB free there" in r0["message"], r0["message"]
    assert r0["folders"] == [], r0  # nothing half-written is left
    assert r0["after"] == 1  # the next sync: whole, through the tensor transport
    assert r0["versions"] == r0["before"] and r0["versions_after"] == ["after"] and r0["labels"] == ["after"]
