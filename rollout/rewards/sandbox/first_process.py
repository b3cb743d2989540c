"""The first process of a sandboxed program (run.py): sets the sandbox up, then becomes the program.

Run as `python -I -S -c <this file's text> <config JSON>` (its text travels as an argument, so the
sandbox user need not be able to read this checkout). Trusted code; nothing here trusts the program.
Standard library only, Linux only.

namespaces mode (inside fresh user, mount, PID, network, IPC, UTS and cgroup namespaces, as the
namespace's root):
  1. a new root, on a small tmpfs, holding only what the plan from interpreter_files.py lists:
     the interpreter, the directories of its import path and the shared libraries they load,
     bound read-only, with every symbolic link on the way to them (/lib -> usr/lib),
     /etc/ld.so.cache and a passwd of two lines, the device nodes null, zero, full, random and
     urandom bound from the host; all of it made read-only at once (mount_setattr, 5.12+; else
     one remount per mount after step 2); then a fresh /proc of its PID namespace, and
     size-bounded tmpfs on /tmp (the program's directory) and /dev/shm;
  2. pivot_root into it and the old root detached: nothing else of the host is reachable (no
     project, run folders, data, sockets, /sys, /home, /root, /var, /run, nor the rest of /usr);
  3. user.max_user_namespaces = 0 in its user namespace (no nested user namespace gives
     capabilities back; written before the new /proc, which shows the run's processes only,
     `subset=pid`, where the kernel has it: 5.8+); hostname "sandbox";
  4. the program copied from an inherited file descriptor to /tmp/main.py;
  5. resource limits; every capability dropped (bounding set, then all sets), no_new_privs; the
     system-call filter (seccomp.py), last;
  6. "ok" on the status descriptor, which is closed; exec the interpreter on the program.
process mode (no namespaces): as root, the worker's own unprivileged user (process_mode.py); a
private folder (0700) in the host's temporary directory, also the program's TMPDIR; then steps
4-6, where Landlock, when the kernel has it, comes between no_new_privs and the filter: reads
of what step 1 would bind and of /proc only, writes beneath the folder only. Any failure before
the exec exits with code 121 and no "ok": the runner reports a sandbox failure, never a program
result.
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
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
PR_SET_PDEATHSIG, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 22, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
"""pivot_root has no C library wrapper before glibc 2.36."""
SYS_LANDLOCK = (444, 445, 446)
"""landlock_create_ruleset, landlock_add_rule, landlock_restrict_self: the same on every architecture."""
SYS_MOUNT_SETATTR, MOUNT_ATTR_RDONLY, AT_FDCWD, AT_RECURSIVE = 442, 1, -100, 0x8000
"""mount_setattr (5.12+), the same on every architecture."""
LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1, 2, 4, 8
LL_REFER, LL_TRUNCATE = 1 << 13, 1 << 14
"""Landlock ABI 2 and 3; ABI 1's thirteen rights are the bits below 1 << 13."""
NEW_ROOT = "/tmp"  # where the new root is built: a mount here is seen only in this mount namespace
WRITABLE = ("/tmp", "/dev/shm", "/proc")
PASSWD = "root:x:0:0:root:/tmp:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"

libc = ctypes.CDLL(None, use_errno=True)


def fail(message):
    sys.stderr.write(f"sandbox set-up failed: {message}\n")
    os._exit(121)


def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def build_root(plan, tmp_mb, shm_mb):
    """Steps 1 and 2 of the module docstring; whether the root's mounts are read-only already."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    made = set()
    for entry in plan:  # each path's directories are real (no link among them), so made in the tmpfs
        kind, path, dest = entry[0], entry[1], NEW_ROOT + entry[1]
        if os.path.dirname(dest) not in made:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            made.add(os.path.dirname(dest))
        if kind == "link":
            os.symlink(entry[2], dest)
        elif kind == "dir":
            os.makedirs(dest, exist_ok=True)
            mount(path, dest, None, MS_BIND | MS_REC)
        else:  # "file" or "dev": a node of the host bound onto an empty file
            os.close(os.open(dest, os.O_CREAT | os.O_WRONLY, 0o644))
            mount(path, dest, None, MS_BIND)
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        os.makedirs(f"{NEW_ROOT}/etc", exist_ok=True)
        with open(f"{NEW_ROOT}/etc/{name}", "w") as f:
            f.write(text)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.makedirs(f"{NEW_ROOT}/dev", exist_ok=True)
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    for point in ("/proc", "/tmp", "/dev/shm"):
        os.makedirs(NEW_ROOT + point, exist_ok=True)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr: set, clr, propagation, userns
    read_only = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), NEW_ROOT.encode(),
                             ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(32)) == 0
    try:
        mount("proc", f"{NEW_ROOT}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "subset=pid")
    except OSError:  # before 5.8: the whole /proc of its PID namespace
        mount("proc", f"{NEW_ROOT}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("tmpfs", f"{NEW_ROOT}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    mount("tmpfs", f"{NEW_ROOT}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={shm_mb}m,mode=1777")
    os.chdir(NEW_ROOT)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(0, f"pivot_root: unknown on {machine}")
    check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")
    return read_only


def read_only_but_private_dirs():
    """Step 1's read-only root where mount_setattr is missing: every mount but /tmp, /dev/shm and
    /proc remounted read-only, keeping the flags it is locked with."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        point = row[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        if point in WRITABLE or point.startswith("/proc/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in row[5].split(","):
            flags |= FLAG_OF_OPTION.get(option, 0)
        mount(None, point, None, flags)


def no_nested_user_namespaces():
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    name = b"sandbox"
    check(libc.sethostname(name, len(name)), "sethostname")


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
    check(libc.capset(ctypes.byref(header), data), "capset")


def confine_files(abi, plan, folder):
    """Landlock (process mode): reads and execution beneath the plan's directories and files (what
    build_root would bind) and /proc, every access beneath `folder`, nothing else of the file system."""
    every = (LL_REFER - 1) | (LL_REFER if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0)
    attr = ctypes.c_uint64(every)  # handled_access_fs; no network or scope fields: size 8
    ruleset = libc.syscall(ctypes.c_long(SYS_LANDLOCK[0]), ctypes.byref(attr), ctypes.c_size_t(8),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        check(-1, "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def allow(path, access):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = PathBeneath(access, fd)
            check(libc.syscall(ctypes.c_long(SYS_LANDLOCK[1]), ctypes.c_int(ruleset), ctypes.c_int(1),
                               ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock rule for {path}")
        finally:
            os.close(fd)
    device = LL_READ_FILE | LL_WRITE_FILE | (LL_TRUNCATE if abi >= 3 else 0)
    for entry in plan:  # "link" entries are resolved by the path walk, which Landlock does not restrict
        access = {"dir": LL_EXECUTE | LL_READ_FILE | LL_READ_DIR, "file": LL_EXECUTE | LL_READ_FILE,
                  "dev": device}
        if entry[0] in access:
            allow(entry[1], access[entry[0]])
    allow("/proc", LL_READ_FILE | LL_READ_DIR)
    allow(folder, every)
    check(libc.syscall(ctypes.c_long(SYS_LANDLOCK[2]), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
          "landlock_restrict_self")
    os.close(ruleset)


def install_filter(program, self_pid_placeholder):
    """The seccomp filter (built by seccomp.py; struct sock_filter[] bytes), with this process's
    pid where the filter holds the placeholder for it; no_new_privs is set already."""
    if not program:
        return
    import struct
    stand_in = {self_pid_placeholder: os.getpid(), -self_pid_placeholder & 0xFFFFFFFF: -os.getpid() & 0xFFFFFFFF}
    ops = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    program = b"".join(struct.pack("=HBBI", code, jt, jf, stand_in.get(k, k)) for code, jt, jf, k in ops)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_char_p))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def main():
    config = json.loads(sys.argv[1])
    with os.fdopen(config["program_fd"], "rb") as f:
        program = f.read()
    try:
        if config["mode"] == "namespaces":
            no_nested_user_namespaces()
            if not build_root(config["root"], config["tmp_mb"], config["shm_mb"]):
                read_only_but_private_dirs()
            workdir = "/tmp"
        else:
            import tempfile
            if config["uid"] is not None:
                parent = os.getppid()
                os.setgroups([])
                os.setgid(config["uid"])
                os.setuid(config["uid"])
                libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL again: the uid change cleared it
                if os.getppid() != parent:
                    fail("the reward worker is gone")
            workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")  # 0700
            os.environ["TMPDIR"] = workdir
        os.chdir(workdir)
        with open("main.py", "wb") as f:
            f.write(program)
        set_limits(config["limits"])
        if config["mode"] == "namespaces":
            drop_capabilities()
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if config["mode"] == "process" and config["landlock"]:
            confine_files(config["landlock"], config["root"], workdir)
        install_filter(bytes.fromhex(config["seccomp"]) if config["seccomp"] else None, config["self_pid"])
    except OSError as e:
        fail(str(e))
    status = config["status_fd"]
    os.write(status, f"ok {workdir}\n".encode())
    os.close(status)
    python = config["python"]
    os.execv(python, [python, "-I", "main.py"])


main()
