"""The code sandbox of `reward: code`: one untrusted program run on one input, bounded and isolated
(run.py), its first process inside the sandbox (first_process.py), its cgroup (cgroup.py), its
system-call filter (seccomp.py), and process mode's own pieces (process_mode.py)."""
