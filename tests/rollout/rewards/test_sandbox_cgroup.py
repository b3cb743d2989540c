"""Where the code sandbox makes a cgroup per run (rollout/rewards/sandbox/cgroup.py): on a fake
cgroup file system, the delegated cgroup v2 layouts a cluster node has (these machines have v1
only: the sandbox tests exercise v1 for real), the limits written, and leftovers of killed workers
removed."""
from __future__ import annotations

import os

from rollout.rewards.sandbox import cgroup as sandbox_cgroup
from rollout.rewards.sandbox.cgroup import CgroupLayout


def _fake_v2(tmp_path, monkeypatch, controllers: dict[str, str], own: str):
    """A cgroup2 mount at tmp_path with cgroup.subtree_control per folder, this process in `own`."""
    for folder, enabled in controllers.items():
        d = tmp_path / folder.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.subtree_control").write_text(enabled)
    monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [("/", str(tmp_path), "cgroup2", {"rw"})])
    monkeypatch.setattr(sandbox_cgroup, "_own_cgroups", lambda: {"": own})
    written: dict[str, str] = {}
    monkeypatch.setattr(sandbox_cgroup, "_write", lambda path, value: written.__setitem__(
        str(path.relative_to(tmp_path)), value))
    return written


def test_a_delegated_v2_parent_of_the_workers_leaf_is_used(tmp_path, monkeypatch):
    # Slurm: .../step_0/user (memory pids cpu delegated) holds the leaf task_0 this worker is in
    written = _fake_v2(tmp_path, monkeypatch, {"job/step_0/user": "cpu memory pids", "job/step_0/user/task_0": ""},
                       "/job/step_0/user/task_0")
    layout = CgroupLayout.find()
    assert layout is not None and layout.version == 2 and layout.cpu
    assert layout.parents[""] == tmp_path / "job/step_0/user"
    run = layout.create(memory_bytes=256 << 20, tasks=33)
    name = run.dirs[0].name
    assert name.startswith(f"gspo-sandbox-{os.getpid()}-")
    assert {k.rsplit("/", 1)[1]: v for k, v in written.items() if name in k} == {
        "memory.max": str(256 << 20), "pids.max": "33", "cpu.max": "100000 100000"}


def test_no_layout_without_memory_and_pids_delegated(tmp_path, monkeypatch):
    _fake_v2(tmp_path, monkeypatch, {"a": "cpu", "a/leaf": ""}, "/a/leaf")
    monkeypatch.setattr(CgroupLayout, "_v1", classmethod(lambda cls, mounts, own: None))
    assert CgroupLayout.find() is None


def test_cgroups_of_killed_workers_are_removed(tmp_path, monkeypatch):
    _fake_v2(tmp_path, monkeypatch, {"d": "memory pids"}, "/d/leaf")
    dead = 2 ** 22 + 1  # above pid_max: no such process
    stale, ours = tmp_path / "d" / f"gspo-sandbox-{dead}-3", tmp_path / "d" / f"gspo-sandbox-{os.getpid()}-0"
    stale.mkdir()
    ours.mkdir()
    assert CgroupLayout.find() is not None
    assert not stale.exists() and ours.exists()
