"""The first process inside a gVisor sandbox (sessions.py): runs one program per request, each in a
fresh folder as an unprivileged user of the sandbox, and answers on its stdout.

Run as `python -I -S -c <this file's text>` as the sandbox's root, with the capabilities
setup.CAPABILITIES only. Trusted code; nothing here trusts the program, which runs as PROGRAM_UID
(it cannot signal, trace or read this process) in a process group of its own, with the request's
limits. The expected outputs never enter the sandbox: the worker compares.
    worker -> runner   {"program": n, "stdin": n, "limit_s": s, "cap": n, "limits": {...}} \\n, then the bytes
    runner -> worker   ready \\n                                                        once, when up
                       {"status": ..., "returncode": n, "stdout": n, "stderr": n} \\n, then the bytes
status: ok, runtime_error, timeout (past limit_s, wall clock), output_limit (stdout past cap).
Standard library only.
"""
import json
import os
import resource
import select
import shutil
import signal
import sys
import time

PROGRAM_UID = 65534
STDERR_TAIL = 4096


def kill_programs():
    """SIGKILL every process of the program's user (what left its group by setsid too)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == PROGRAM_UID:
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass


def reap():
    """This process is the sandbox's first: what a program orphaned comes here. Kill and reap
    until no child is left (2 s at most: a fork bomb's last children)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        kill_programs()
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def run(request, program, stdin, n, python):
    folder = f"/tmp/run-{n}"
    os.mkdir(folder, 0o700)
    with open(f"{folder}/main.py", "wb") as f:
        f.write(program)
    for path in (f"{folder}/main.py", folder):
        os.chown(path, PROGRAM_UID, PROGRAM_UID)
    r0, w0 = os.pipe()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for fd, to in ((r0, 0), (w1, 1), (w2, 2)):
                os.dup2(fd, to)
            os.closerange(3, 1 << 16)
            os.setgroups([])
            os.setgid(PROGRAM_UID)
            os.setuid(PROGRAM_UID)
            os.chdir(folder)
            for name, value in request["limits"].items():  # never above the sandbox's own
                hard = resource.getrlimit(getattr(resource, name))[1]
                value = value if hard == resource.RLIM_INFINITY else min(value, hard)
                resource.setrlimit(getattr(resource, name), (value, value))
            os.execve(python, [python, "-I", "main.py"], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                                                          "TMPDIR": folder, "HOME": folder})
        except BaseException as e:  # noqa: BLE001 - said on the program's stderr, a failed start
            os.write(2, f"the runner could not start the program: {type(e).__name__}: {e}\n".encode())
        os._exit(121)
    for fd in (r0, w1, w2):
        os.close(fd)
    out, err, pending = bytearray(), bytearray(), memoryview(stdin)
    readers: dict[int, bytearray] = {r1: out, r2: err}
    writer: int | None = w0
    for fd in (r1, r2, w0):
        os.set_blocking(fd, False)
    if not pending:
        os.close(w0)
        writer = None
    deadline, status = time.monotonic() + request["limit_s"], None
    while readers:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        r, w, _ = select.select(list(readers), [writer] if writer is not None else [], [], left)
        if w and writer is not None:
            try:
                pending = pending[os.write(writer, pending[:65536]):]
            except OSError:
                pending = pending[len(pending):]
            if not pending:
                os.close(writer)
                writer = None
        for fd in r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                del readers[fd]
                continue
            readers[fd] += chunk
            if fd == r2 and len(err) > 4 * STDERR_TAIL:
                del err[:-STDERR_TAIL]
        if len(out) > request["cap"]:
            status = "output_limit"
            break
    while status is None:  # its streams are closed: it has exited, or it is about to
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(code)
            status = "ok" if returncode == 0 else "runtime_error"
            break
        if time.monotonic() >= deadline:
            status = "timeout"
        else:
            time.sleep(0.001)
    kill_programs()
    if status in ("timeout", "output_limit"):
        returncode = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    reap()
    for fd in [r1, r2] + ([writer] if writer is not None else []):
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)
    return status, returncode, bytes(out[:request["cap"]]), bytes(err[-STDERR_TAIL:])


def main():
    python = sys.executable
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sink.write(b"ready\n")
    sink.flush()
    n = 0
    while True:
        line = source.readline()
        if not line:
            return
        request = json.loads(line)
        program, stdin = source.read(request["program"]), source.read(request["stdin"])
        n += 1
        status, returncode, out, err = run(request, program, stdin, n, python)
        header = {"status": status, "returncode": returncode, "stdout": len(out), "stderr": len(err)}
        sink.write(json.dumps(header).encode() + b"\n" + out + err)
        sink.flush()


main()
