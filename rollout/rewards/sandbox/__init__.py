"""The code sandbox of `reward: code`: one untrusted program run on one input, bounded and isolated
(run.py), in one of its backends: gVisor, a kernel of its own per response (gvisor/: its sessions, its runner
inside the sandbox), or the host's kernel behind namespaces or in process mode.
Beside them: its streams (streams.py), its first process inside the namespaces (first_process.py),
what it may read (interpreter_files.py), its cgroup (cgroup.py), its system-call filter
(seccomp.py), its user (users.py), the reaping of what its kill orphans (reaping.py), process
mode's own pieces (process_mode.py), and its start-up line (start_line.py)."""
