"""A resume checks what it resumes; every folder a run writes is checked before anything starts.

Before: shard bytes overwritten at the same size passed the manifest (sizes only) and the run failed
a step later blaming the server (`malformed /generate result`); a read-only checkpoint.dir, or one
whose parent is a file, gave 20-line tracebacks (a resume from a read-only folder, 35 lines about an
SGLang log file); a resume with another prompt file went on silently, its old cursor applied to the
new file. Now each is one line, named before any server or process group starts.
"""
from __future__ import annotations

import json
import shutil
import time

import pytest

from faults_common import copy_run, in_process_error, remount, tmpfs, train_args
from test_trainer_e2e import PROMPTS, run_train, server_url  # noqa: F401

pytestmark = pytest.mark.slow


def test_shard_bytes_changed_at_the_same_size_are_named_before_start(tmp_path, capsys, trained, server_url):  # noqa: F811
    run_dir = copy_run(trained, tmp_path / "run")
    shard = sorted((run_dir / "ckpt" / "step_00000001" / "model").glob("*.distcp"))[0]
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF  # one byte, same size
    shard.write_bytes(bytes(damaged))
    t0 = time.perf_counter()
    line = in_process_error(capsys, train_args(run_dir, server_url, **{"train.steps": 2}))
    assert f"is damaged: {shard} does not match the CRC32 recorded at save (its bytes changed, its " \
           "size did not)" in line, line
    assert time.perf_counter() - t0 < 5  # no server started
    shard.write_bytes(original)
    proc = run_train(train_args(run_dir, server_url, **{"train.steps": 2}))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "ckpt" / "step_00000002" / "MANIFEST.json").read_text())
    assert set(manifest["crc32"]) == set(manifest["files"])


def test_resume_with_another_prompt_file_is_refused_or_starts_a_new_epoch(tmp_path, capsys, trained, server_url):  # noqa: F811
    run_dir = copy_run(trained, tmp_path / "run")
    other = tmp_path / "other.jsonl"
    other.write_text("".join(PROMPTS.read_text().splitlines(keepends=True)[:40]))
    args = train_args(run_dir, server_url, **{"train.steps": 2, "rollout.prompts": str(other)})
    line = in_process_error(capsys, args)
    assert f"rollout.prompts='{other}' is not the prompt set the run in checkpoint.dir=" in line
    assert f"the checkpoint's set was {PROMPTS.resolve()} (" in line and "now " + str(other) in line
    assert "rollout.prompts_changed=restart_epoch" in line
    proc = run_train(args + ["--set", "rollout.prompts_changed=restart_epoch"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a new epoch over the new set starts" in proc.stdout
    driver = json.loads((run_dir / "ckpt" / "step_00000002" / "driver.json").read_text())
    assert driver["data_cursor"]["epoch"] == 1 and driver["data_cursor"]["position"] == 2
    assert driver["extra"]["prompts"]["paths"] == [str(other.resolve())]
    # The same prompt set moved elsewhere is the same set: the resume goes on.
    moved = tmp_path / "moved.jsonl"
    shutil.copy(other, moved)
    proc = run_train(train_args(run_dir, server_url, **{"train.steps": 3, "rollout.prompts": str(moved)}))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_read_only_checkpoint_dir_fresh_and_resumed(tmp_path, capsys, trained, server_url):  # noqa: F811
    with tmpfs(tmp_path / "ro", "16m") as mnt:
        remount(mnt, "ro")
        line = in_process_error(capsys, train_args(tmp_path, server_url, **{"checkpoint.dir": str(mnt / "ck")}))
        assert line.endswith(f"checkpoint.dir='{mnt / 'ck'}' cannot be written ({mnt}: the filesystem is "
                             "read-only); make it writable or choose another path"), line
        remount(mnt, "rw")
        shutil.copytree(trained / "ckpt", mnt / "ck")
        remount(mnt, "ro")
        t0 = time.perf_counter()
        line = in_process_error(capsys, train_args(tmp_path, server_url, **{"checkpoint.dir": str(mnt / "ck"),
                                                                           "train.steps": 2}))
        assert f"checkpoint.dir='{mnt / 'ck'}' cannot be written ({mnt / 'ck'}: the filesystem is read-only)" in line
        assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "tb").exists()


def test_parent_is_a_file_and_a_file_in_place_of_a_folder(tmp_path, capsys, server_url):  # noqa: F811
    (tmp_path / "plain").write_text("")
    line = in_process_error(capsys, train_args(tmp_path, server_url, **{"checkpoint.dir": str(tmp_path / "plain" / "ck")}))
    assert line.endswith(f"checkpoint.dir='{tmp_path / 'plain' / 'ck'}' cannot be created: "
                         f"{tmp_path / 'plain'} is a file, not a directory; choose another path"), line
    line = in_process_error(capsys, train_args(tmp_path, server_url, **{"logging.tensorboard_dir": str(tmp_path / "plain")}))
    assert f"logging.tensorboard_dir='{tmp_path / 'plain'}' is a file, not a directory" in line
    assert not (tmp_path / "ckpt").exists()


def test_no_room_for_one_checkpoint_is_named_before_start(tmp_path, capsys, server_url):  # noqa: F811
    with tmpfs(tmp_path / "tiny", "1m") as mnt:
        line = in_process_error(capsys, train_args(tmp_path, server_url, **{"checkpoint.dir": str(mnt / "ck")}))
    assert f"checkpoint.dir='{mnt / 'ck'}': 1.0 MiB free, the initial conversion and one checkpoint " \
           "(parameters + optimizer state, estimated from the model) (2.1 MiB) and the disk transport (2 copies " \
           "of the model's weights) (1.1 MiB, sync.dir) needs about 3.2 MiB; free space or choose another path" \
           in line, line  # the sync's copies share the disk: the needs added up
