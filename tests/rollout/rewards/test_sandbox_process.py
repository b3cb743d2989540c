"""Process mode's own promises (rollout/rewards/sandbox/process_mode.py, `isolation: process`): a user per
reward worker as root, the run's folder its own, files confined (Landlock, or as root without it what
the run's user left removed), no sockets, a probe that meets something else retried, the folder's
removal within the caller's deadline. Each was an attack that worked: a run swapped a concurrent
run's program (SABOTAGED in 10-27 of 40 runs) or failed a starting worker's probe (the run stopped),
left 960 MB in the host's /dev/shm per run, read the row's expected output from the host's data."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rollout.rewards.sandbox import run as sandbox_module
from rollout.rewards.sandbox.run import RunResult, Sandbox
from rollout.rewards.settings import CodeSandboxSettings
from sandboxes import leftovers, probed_sandbox

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a user per worker needs a root worker")


@pytest.fixture(params=["landlock", "no landlock"])
def confined(request, monkeypatch) -> Sandbox:
    """A process-mode sandbox with Landlock (where the kernel has it) and one without (forced)."""
    if request.param == "no landlock":
        monkeypatch.setattr(sandbox_module, "landlock_abi", lambda: 0)
    sandbox = probed_sandbox("process")
    if request.param == "landlock" and not sandbox.landlock:
        pytest.skip("no Landlock in this kernel")
    return sandbox


VICTIM = """
import sys
sys.path.insert(0, {root!r})
from rollout.rewards.sandbox.run import Sandbox
from rollout.rewards.settings import CodeSandboxSettings
s = Sandbox(CodeSandboxSettings(isolation="process"))
s.probe()
print(s.tag, flush=True)
s.run("import time; time.sleep(30)", b"", 40.0)
"""
SWAP = """
import os, sys
folder = sys.stdin.read()
for what, act in (("list", lambda: os.listdir(folder)), ("read", lambda: open(folder + "/main.py").read()),
                  ("replace", lambda: open(folder + "/main.py", "w").write("print('SABOTAGED')")),
                  ("add", lambda: open(folder + "/x.py", "w").write("x"))):
    try:
        act()
        print(what, "DONE")
    except OSError as e:
        print(what, "refused")
"""


@root_only
def test_a_run_cannot_reach_a_concurrent_runs_folder(confined):
    # another reward worker's run, in the middle of its test: its folder and program are its own
    victim = subprocess.Popen([sys.executable, "-c", VICTIM.format(root=str(ROOT))], stdout=subprocess.PIPE,
                              text=True)
    try:
        tagged = Sandbox(CodeSandboxSettings())
        tagged.tag = victim.stdout.readline().strip()
        deadline, folders = time.monotonic() + 20, []
        while not folders and time.monotonic() < deadline:
            folders = [f for f in map(_cwd, leftovers(tagged)) if f.startswith("/tmp/gspo-sandbox-")]
            time.sleep(0.05)
        assert folders, "the victim's run never started"
        r = confined.run(SWAP, folders[0].encode(), 5.0)
        assert r.status == "ok", r.stderr_tail
        assert r.stdout.decode().split("\n")[:-1] == ["list refused", "read refused", "replace refused",
                                                      "add refused"]
    finally:
        victim.kill()  # as at a reward timeout: in the middle of its run
        victim.wait()
    # the next worker's probe removes the folder of a run whose worker was killed
    probed_sandbox("process")
    assert not Path(folders[0]).exists()


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _write_everywhere(tag: str) -> str:
    return textwrap.dedent(f"""
        import os
        for d in ("/dev/shm", "/var/tmp", "/tmp"):
            try:
                with open(f"{{d}}/{tag}", "wb") as f:
                    f.write(bytes(1 << 20))
                os.makedirs(f"{{d}}/{tag}-dir/sub")
                open(f"{{d}}/{tag}-dir/sub/x", "w").write("x")
                print(d, "written")
            except OSError as e:
                print(d, "refused")
        open("mine.txt", "w").write("its own folder")
        print(open("mine.txt").read())
    """)


def test_writes_outside_its_folder_do_not_stay(confined):
    # as nobody (root worker) or the worker's user, a run wrote 960 MB to the host's /dev/shm and
    # 0.5-0.9 GB to /var/tmp, and they stayed
    if not confined.landlock and os.geteuid() != 0:
        pytest.skip("a worker that is not root, without Landlock, cannot tell the run's files from its own")
    tag = f"gspo-test-{uuid.uuid4().hex}"
    try:
        r = confined.run(_write_everywhere(tag), b"", 5.0)
        assert r.status == "ok", r.stderr_tail
        *writes, own = r.stdout.decode().splitlines()
        assert own == "its own folder"
        assert all(w.endswith("refused" if confined.landlock else "written") for w in writes), writes
        left = [p for d in ("/dev/shm", "/var/tmp", "/tmp") for p in Path(d).glob(f"{tag}*")]
        assert left == []
    finally:
        for d in ("/dev/shm", "/var/tmp", "/tmp"):
            for p in Path(d).glob(f"{tag}*"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()


def test_with_landlock_it_reads_the_interpreter_only(confined, tmp_path):
    # the host's data holds the rows' expected outputs: a program that looks its input up there scores
    # 1.0 without solving anything
    if not confined.landlock:
        pytest.skip("reads are confined by Landlock only")
    token = uuid.uuid4().hex
    markers = [tmp_path / "marker", ROOT / f".sandbox-marker-{token}"]
    for m in markers:
        m.write_text(token)
        m.chmod(0o644)
    tmp_path.chmod(0o755)
    try:
        r = confined.run(textwrap.dedent(f"""
            import os
            for path in {[str(m) for m in markers] + [str(ROOT / "examples" / "data"), "/etc/passwd"]!r}:
                try:
                    print(open(path).read() if os.path.isfile(path) else os.listdir(path))
                except OSError as e:
                    print("refused", e.errno)
            import json, collections, fractions  # the standard library still loads
            print(open("/proc/self/status").read().split()[0], open("/dev/null").read() == "")
        """), b"", 5.0)
        assert r.status == "ok", r.stderr_tail
        assert token not in r.stdout.decode()
        assert r.stdout.decode().splitlines() == ["refused 13"] * 4 + ["Name: True"]
    finally:
        markers[1].unlink()


def test_no_sockets_but_pairs(proc, tmp_path):
    # the host's network is the run's in process mode: it reached 98 of the host's 99 local TCP
    # services, and unix sockets by path (a docker.sock its group may open)
    tcp, unix = socket.socket(), socket.socket(socket.AF_UNIX)
    tcp.bind(("127.0.0.1", 0))
    tmp_path.chmod(0o755)
    unix.bind(str(tmp_path / "sock"))
    (tmp_path / "sock").chmod(0o777)
    for listener in (tcp, unix):
        listener.listen(1)
        listener.settimeout(0.3)
    r = proc.run(textwrap.dedent(f"""
        import asyncio, socket
        for family, address in ((socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                                (socket.AF_UNIX, {str(tmp_path / "sock")!r})):
            try:
                socket.socket(family).connect(address)
                print("CONNECTED")
            except OSError as e:
                print("refused", e.errno)
        asyncio.run(asyncio.sleep(0))   # its event loop's socketpair
        print("asyncio ran")
    """), b"", 5.0)
    assert r.status == "ok", r.stderr_tail
    assert r.stdout.decode().splitlines() == ["refused 1"] * 2 + ["asyncio ran"]
    for listener in (tcp, unix):
        with pytest.raises(socket.timeout):
            listener.accept()
        listener.close()


def test_a_probe_that_meets_something_else_is_retried(monkeypatch):
    # a run beside the probe replaced its program once: the worker failed to start, and the pool
    # with it (RewardWorkerError: the training run stopped)
    real, calls = Sandbox._run_once, []

    def swapped_once(self, program, stdin, time_limit_s, deadline=None, bounded=True):
        calls.append(bounded)
        if calls == [False, True]:  # the warm-up outside a cgroup, then the probe's first run
            return RunResult("ok", b"SABOTAGED\n", b"", 0, 0.1)
        return real(self, program, stdin, time_limit_s, deadline, bounded)
    monkeypatch.setattr(Sandbox, "_run_once", swapped_once)
    sandbox = Sandbox(CodeSandboxSettings(isolation="process"))
    assert "process isolation only" in sandbox.probe() and calls == [False, True, True]


def test_the_folders_removal_keeps_to_the_callers_deadline(proc, monkeypatch):
    # the worker removed the run's folder after the run, outside its time: 177k files made in 3.5 s
    # cost 2.2 s more, and a row's long limit could take the call past the reward timeout
    real, removed = shutil.rmtree, []

    def slow_rmtree(path, *args, **kwargs):
        time.sleep(2.0)
        real(path, *args, **kwargs)
        removed.append(path)
    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    t0 = time.monotonic()
    r = proc.run("import os\nprint(os.getcwd())", b"", 4.0, deadline=t0 + 1.0)
    assert r.status == "ok" and time.monotonic() - t0 < 1.0 + 0.3
    folder = r.stdout.decode().strip()
    deadline = time.monotonic() + 10
    while folder not in removed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert folder in removed and not Path(folder).exists()  # the rest went on in the background


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the worker as nobody")
def test_without_root_other_processes_of_the_user_stay_out_of_reach():
    # a worker that is not root runs its programs as its own user: another process of that user (the
    # trainer, with HF_TOKEN) had its environment and memory open to them (read and write)
    check = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                            "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import rollout.rewards.sandbox.run; "
                                  "import ctypes; print(max(0, ctypes.CDLL(None).syscall(444, None, 0, 1)))"],
                           capture_output=True, text=True, cwd="/")
    if check.returncode != 0:
        pytest.skip(f"nobody cannot import this checkout: {check.stderr[-200:]}")
    if check.stdout.strip() == "0":
        pytest.skip("no Landlock in this kernel: a same-user process is reachable (docs/rewards.md)")
    trainer = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env",
                                "FAKE_HF_TOKEN=hf_secret", "/usr/bin/python3", "-c", "import time; time.sleep(60)"])
    program = textwrap.dedent(f"""
        for what in ("environ", "mem"):
            try:
                open("/proc/{trainer.pid}/" + what, "rb").close()  # mem: the open is the access check
                print(what, "OPENED")
            except OSError as e:
                print(what, "refused")
    """)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from rollout.rewards.sandbox.run import Sandbox
        from rollout.rewards.settings import CodeSandboxSettings
        print(Sandbox(CodeSandboxSettings(isolation="process")).run({program!r}, b"", 5.0).stdout.decode())
    """)
    try:
        time.sleep(0.2)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                              "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[:2] == ["environ refused", "mem refused"], out.stdout
    finally:
        trainer.kill()
        trainer.wait()


REACH = """
import ctypes, fcntl, os, platform, resource, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
IOPRIO_SET, RT_SIGQUEUEINFO = {{"x86_64": (251, 129), "aarch64": (30, 138)}}[platform.machine()]
trainer, outcome = int(sys.stdin.read()), {{}}
def attempt(name, call):
    try:
        call()
        outcome[name] = "DONE"
    except OSError as e:
        outcome[name] = "refused"
def checked(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), "")
attempt("worker RLIMIT_CPU", lambda: resource.prlimit(os.getppid(), resource.RLIMIT_CPU, (1, 1)))
attempt("trainer RLIMIT_NOFILE", lambda: resource.prlimit(trainer, resource.RLIMIT_NOFILE, (0, 0)))
attempt("trainer nice", lambda: os.setpriority(os.PRIO_PROCESS, trainer, 19))
attempt("user nice", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19))
attempt("trainer SCHED_IDLE", lambda: os.sched_setscheduler(trainer, os.SCHED_IDLE, os.sched_param(0)))
attempt("trainer ioprio", lambda: checked(libc.syscall(IOPRIO_SET, 1, trainer, 3 << 13)))
info = (ctypes.c_int * 32)(signal.SIGKILL, 0, -1)   # si_code SI_QUEUE
attempt("trainer queued SIGKILL", lambda: checked(libc.syscall(RT_SIGQUEUEINFO, trainer, signal.SIGKILL, info)))
r, w = os.pipe()
attempt("trainer SIGIO owner", lambda: fcntl.fcntl(r, fcntl.F_SETOWN, trainer))
attempt("trainer oom_score_adj", lambda: open(f"/proc/{{trainer}}/oom_score_adj", "w").write("1000"))
print(outcome)
"""
NOBODY_WORKER = """
import sys
sys.path.insert(0, {root!r})
from rollout.rewards.sandbox.run import Sandbox
from rollout.rewards.settings import CodeSandboxSettings
s = Sandbox(CodeSandboxSettings(isolation="process"))
reach = s.run({program!r}, sys.stdin.read().encode(), 5.0)
after = s.run("print(6 * 7)", b"", 5.0)
print(reach.status, reach.stdout.decode().strip(), sep="\\n")
print(after.status, after.stdout.decode().strip(), after.stderr_tail.decode()[-300:])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the worker and a stand-in trainer as nobody")
def test_without_root_a_program_reaches_neither_its_worker_nor_the_trainer():
    # a worker that is not root runs its programs as its own user: prlimit(worker, RLIMIT_CPU, 1)
    # scored 1.0, and every later run of that worker failed to start (a reward error that stopped
    # the run); SCHED_IDLE, nice 19, RLIMIT_NOFILE 0 reached the trainer, which the kernel then
    # slowed and killed
    from rollout.rewards.sandbox.seccomp import machine
    if machine() is None:
        pytest.skip("no system-call filter for this architecture")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    check = subprocess.run(nobody + ["/usr/bin/python3", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                                     "import rollout.rewards.sandbox.run"], capture_output=True, text=True, cwd="/")
    if check.returncode != 0:
        pytest.skip(f"nobody cannot import this checkout: {check.stderr[-200:]}")
    trainer = subprocess.Popen(nobody + ["/usr/bin/python3", "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        out = subprocess.run(nobody + ["/usr/bin/python3", "-c", NOBODY_WORKER.format(root=str(ROOT),
                                                                                      program=REACH.format())],
                             input=str(trainer.pid), capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr[-2000:]
        status, outcome, after = out.stdout.split("\n")[:3]
        assert status == "ok" and "DONE" not in outcome, outcome
        assert after.split()[:2] == ["ok", "42"], after  # the worker's next run starts
        assert trainer.poll() is None
        stat = Path(f"/proc/{trainer.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert (stat[16], stat[38]) == ("0", "0")  # nice 0, SCHED_OTHER
        assert "Max open files" in Path(f"/proc/{trainer.pid}/limits").read_text()
        assert " 0 " not in Path(f"/proc/{trainer.pid}/limits").read_text().split("Max open files")[1].split("\n")[0]
    finally:
        trainer.kill()
        trainer.wait()
