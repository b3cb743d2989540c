"""The first process of a sandboxed program (sandbox.py): sets the sandbox up, then becomes the program.

Run as `python -I -S -c <this file's text> <config JSON>` (its text travels as an argument, so the
sandbox user need not be able to read this checkout). Trusted code; nothing here trusts the program.
Standard library only, Linux only.

namespaces mode (inside fresh user, mount, PID and network namespaces, as the namespace's root):
  1. every mount read-only (remounted, keeping its locked flags), mount events private;
  2. an empty tmpfs on /tmp (the program's directory, 64 MiB), /var/tmp and /dev/shm, and an empty
     read-only one over /root and /home;
  3. the program copied from an inherited file descriptor to /tmp/main.py;
  4. resource limits; every capability dropped (bounding set, then all sets), no_new_privs;
  5. "ok" on the status descriptor, which is closed; exec the interpreter on the program.
process mode (no namespaces): limits, a private temporary directory, the unprivileged user when
started as root, then the same steps 3-5. Any failure before the exec exits with code 121 and no
"ok": the runner reports a sandbox failure, never a program result.
"""
import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
FLAG_OF_OPTION = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                  "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
NOBODY = 65534

libc = ctypes.CDLL(None, use_errno=True)


def fail(message):
    sys.stderr.write(f"sandbox set-up failed: {message}\n")
    os._exit(121)


def mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")


def read_only_everything():
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        point = row[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in row[5].split(","):
            flags |= FLAG_OF_OPTION.get(option, 0)
        try:
            mount(None, point, None, flags)
        except OSError as e:
            # /proc and /sys are the kernel's (not writable from a user namespace); anything else
            # left writable would break the promise: stop
            if not point.startswith(("/proc", "/sys")):
                fail(f"cannot make {point} read-only ({e})")


def private_dirs():
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    for point, data in (("/var/tmp", "size=16m,mode=1777"), ("/dev/shm", "size=16m,mode=1777")):
        if os.path.isdir(point):
            mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, data)
    for point in ("/root", "/home"):
        if os.path.isdir(point):
            mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")


def set_limits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def drop_capabilities():
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability this kernel knows
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: all zero
    if libc.capset(ctypes.byref(header), data) != 0:
        fail(f"capset: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail(f"no_new_privs: {os.strerror(ctypes.get_errno())}")


def main():
    config = json.loads(sys.argv[1])
    with os.fdopen(config["program_fd"], "rb") as f:
        program = f.read()
    try:
        if config["mode"] == "namespaces":
            read_only_everything()
            private_dirs()
            workdir = "/tmp"
        else:
            import tempfile
            if os.geteuid() == 0:
                parent = os.getppid()
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL again: the uid change cleared it
                if os.getppid() != parent:
                    fail("the reward worker is gone")
            workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")
        os.chdir(workdir)
        with open("main.py", "wb") as f:
            f.write(program)
        set_limits(config["limits"])
        if config["mode"] == "namespaces":
            drop_capabilities()
    except OSError as e:
        fail(str(e))
    status = config["status_fd"]
    os.write(status, f"ok {workdir}\n".encode())
    os.close(status)
    python = config["python"]
    os.execv(python, [python, "-I", "main.py"])


main()
