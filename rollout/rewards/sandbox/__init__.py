"""The code sandbox of `reward: code`: one untrusted program run on one input, bounded and isolated
(run.py), its streams (streams.py), its first process inside the sandbox (first_process.py), what
it may read (interpreter_files.py), its cgroup (cgroup.py), its system-call filter (seccomp.py),
its user (users.py), the reaping of what its kill orphans (reaping.py), and process mode's own
pieces (process_mode.py)."""
