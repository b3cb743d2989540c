"""Where the code sandbox makes a cgroup per run (rollout/rewards/sandbox/cgroup.py): on a fake
cgroup file system, the delegated cgroup v2 layouts a cluster node has (these machines have v1
only: the sandbox tests exercise v1 for real), the limits written, leftovers of killed workers
removed, and a run's page cache reclaimed before its cgroup is removed (v1 for real, v2 faked)."""
from __future__ import annotations

import os
import time

import pytest

from rollout.rewards.sandbox import cgroup as sandbox_cgroup
from rollout.rewards.sandbox.cgroup import CgroupLayout
from rollout.rewards.sandbox.interpreter_files import files


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


def _memory_cgroups() -> int:
    """The kernel's count of memory cgroups, removed ones still pinned included (/proc/cgroups)."""
    for line in open("/proc/cgroups"):
        if line.split()[0] == "memory":
            return int(line.split()[2])
    raise AssertionError("no memory controller")


@pytest.mark.slow
def test_a_runs_cgroup_is_not_pinned_by_the_pages_it_read(ns, tmp_path):
    # a run's cgroup, removed, lived on while the page cache it brought in stayed charged to it:
    # 87 -> 118 cgroups after 30 runs that each read a cold file; at the kernel's 65,535 no cgroup
    # can be made and every code reward errs
    if ns.cgroups is None:
        pytest.skip("no cgroup can be made here")
    sources = sorted(p for p in files(ns.root) if p.endswith(".py") and os.path.getsize(p) > 8192)[:30]
    for path in sources:  # cold: each run is the first to read its file (and what pinned them is freed)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    time.sleep(0.5)
    before = _memory_cgroups()
    for path in sources:
        r = ns.run(f"print(len(open({path!r}, 'rb').read()))", b"", 5.0)
        assert r.status == "ok", r.stderr_tail
    deadline = time.monotonic() + 5  # a removed cgroup is freed after an RCU grace period
    while _memory_cgroups() > before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _memory_cgroups() <= before + 5  # others' cgroups come and go meanwhile


def test_a_v2_cgroup_has_its_page_cache_reclaimed_before_it_is_removed(tmp_path, monkeypatch):
    written = _fake_v2(tmp_path, monkeypatch, {"d": "memory pids"}, "/d/leaf")
    layout = CgroupLayout.find()
    run = layout.create(memory_bytes=256 << 20, tasks=33)
    # no file pages: still reclaimed, whole (a run that reads nothing leaves negative dentries,
    # charged to it as kernel memory: memory.current, not memory.stat's file)
    (run.dirs[0] / "memory.stat").write_text("anon 0\nfile 0\nfile_dirty 0\n")
    (run.dirs[0] / "memory.current").write_text("12288\n")
    (run.dirs[0] / "memory.reclaim").write_text("")
    monkeypatch.setattr(type(run.dirs[0]), "rmdir", lambda self: None)
    run.remove()
    assert written[f"d/{run.dirs[0].name}/memory.reclaim"] == "12288"
