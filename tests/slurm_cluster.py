"""A real Slurm (Debian's slurm-wlm 22.05: one slurmctld + two slurmd) on this host, for launch tests.

    from slurm_cluster import slurm_cluster          # the session-scoped pytest fixture

    def test_job(slurm_cluster):
        proc = slurm_cluster.sbatch_wait(["launch/slurm/colocated.sbatch", "cfg.yaml"], env=..., timeout=120)
        slurm_cluster.run(["squeue"])                 # any client command, inside the cluster's netns

Two emulated nodes, n1 and n2 (2 CPUs each), run as two `slurmd -N` on this host. Everything runs in
a network namespace of the cluster's own (slurmctld listens on all interfaces and has no bind option),
entered with `nsenter --net=` (`ip netns exec` remounts /sys and breaks slurmd). Jobs started by these
daemons inherit the namespace: their loopback is private, so torch.distributed rendezvous, servers
and ports of different test sessions never meet. `n1 n2` are added to /etc/hosts for the duration
(both resolve to 127.0.0.1) and removed at teardown.

Needs root (apt-get, `ip netns`, /etc/hosts) and Linux; the fixture skips otherwise with the reason.
As root it never skips: a cluster that fails to start fails the tests with the daemons' log tails.
The Slurm packages are installed with apt-get when missing (`apt-get update` once,
`--no-install-recommends`; policy-rc.d keeps apt from starting services: the daemons are started
here, no systemd). Every step has a timeout; teardown cancels jobs, stops the daemons by their PIDs,
ends what is left in the namespace (job steps) by PID, deletes the namespace and restores /etc/hosts.

docs/cpu.md ("A real Slurm") records what this took; the config below sets a short `cred_expire`: a requeued job may start again only `cred_expire` seconds after the requeue
(120 s by default), which would make the preemption test wait two minutes for nothing.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import pytest

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client")
HOSTS_FILE = Path("/etc/hosts")

SLURM_CONF = """\
# Written by tests/slurm_cluster.py: single-host Slurm 22.05, two emulated nodes (two slurmd).
ClusterName=gspo-ci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=5
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s only while MinJobAge/2 <= 2 (else 2, 8, 32 s: a 12 s job returned after 43 s).
MinJobAge=4
SlurmctldTimeout=30
SlurmdTimeout=30
Waittime=0
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port=17001 CPUs={cpus} RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port=17002 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmClusterError(RuntimeError):
    """The test cluster could not be installed, started or used; the message has the logs' tails."""


def _run(cmd: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise SlurmClusterError(f"{' '.join(cmd)!r} did not finish within {timeout} s") from e


def _check(cmd: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    proc = _run(cmd, timeout, **kw)
    if proc.returncode != 0:
        raise SlurmClusterError(f"{' '.join(cmd)!r} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def ensure_slurm_installed(timeout: float = 600.0) -> None:
    """Install Debian's slurmctld, slurmd and slurm-client when any Slurm binary is missing."""
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return
    if not shutil.which("apt-get"):
        raise SlurmClusterError(f"Slurm binaries {SLURM_BINARIES} are missing and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _check(["apt-get", "update", "-qq"], timeout, env=env)
    _check(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *SLURM_PACKAGES], timeout, env=env)
    missing = [b for b in SLURM_BINARIES if not shutil.which(b)]
    if missing:
        raise SlurmClusterError(f"after installing {SLURM_PACKAGES}, still missing: {missing}")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<{path}: {e}>"


class SlurmCluster:
    """A running two-node Slurm. Client commands go through `run`, `sbatch_wait` and `popen`."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.netns = f"gspo-slurm-{os.getpid()}"
        self.netns_path = Path("/run/netns") / self.netns
        self.conf = self.workdir / "slurm.conf"
        self.nodes = NODES
        self._daemons: dict[str, subprocess.Popen] = {}
        self._hosts_line = f"127.0.0.1 {' '.join(NODES)}  # gspo-megatron test Slurm {self.netns}"

    # ---------------------------------------------------------------- client side
    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (and so for the jobs they submit: sbatch exports it)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _nsenter(self, cmd: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net={self.netns_path}", *cmd]

    def run(self, cmd: Sequence[str], *, timeout: float = 30.0, check: bool = True,
            env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run a client command (sbatch, squeue, scontrol, ...) inside the cluster's namespace."""
        full_env = {**self.env, **(env or {}), "SLURM_CONF": str(self.conf)}
        proc = _run(self._nsenter(cmd), timeout, env=full_env, cwd=cwd)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"{' '.join(cmd)!r} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, cmd: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, **kw) -> subprocess.Popen:
        """Start a client command in the background (e.g. `sbatch --wait` while the test acts on the job)."""
        full_env = {**self.env, **(env or {}), "SLURM_CONF": str(self.conf)}
        return subprocess.Popen(self._nsenter(cmd), env=full_env, cwd=cwd, text=True, **kw)

    def sbatch_wait(self, args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
                    cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """`sbatch --wait ARGS`: returns when the job has ended (its exit code is the returncode).

        A job still running at `timeout` is cancelled and SlurmClusterError is raised."""
        cmd = ["sbatch", "--wait", *args]
        try:
            return subprocess.run(self._nsenter(cmd), capture_output=True, text=True, timeout=timeout,
                                  env={**self.env, **(env or {}), "SLURM_CONF": str(self.conf)}, cwd=cwd)
        except subprocess.TimeoutExpired as e:
            jobs = self.run(["squeue", "-h", "-o", "%i %j %T %r"], check=False).stdout
            self.cancel_all()
            raise SlurmClusterError(f"{' '.join(cmd)!r} did not finish within {timeout} s; queue was:\n"
                                    f"{jobs}\n{self.log_tails()}") from e

    def job_field(self, job_id: str, field: str) -> str:
        """One field of `scontrol show job` (e.g. JobState, RestartCnt, ExitCode)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        for item in out.split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        raise SlurmClusterError(f"no field {field!r} in `scontrol show job {job_id}`: {out}")

    def cancel_all(self, timeout: float = 30.0) -> None:
        """Cancel every job and wait until the queue is empty (jobs end within KillWait)."""
        self.run(["scancel", "--full", "--user", "root"], check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip():
                return
            time.sleep(0.5)

    def log_tails(self) -> str:
        logs = sorted((self.workdir / "log").glob("*.log"))
        return "\n".join(f"--- {p.name}\n{_tail(p)}" for p in logs)

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def cleanup_stale() -> None:
        """Remove what an earlier session killed before its teardown left: its namespace (and the
        daemons and job processes inside it, all started by that session) and its /etc/hosts line.
        Only namespaces named by this module whose creating process is gone are touched."""
        netns_dir = Path("/run/netns")
        for path in sorted(netns_dir.glob("gspo-slurm-*")) if netns_dir.is_dir() else []:
            owner = path.name.rsplit("-", 1)[-1]
            if not owner.isdigit() or Path(f"/proc/{owner}").exists():
                continue
            proc = _run(["ip", "netns", "pids", path.name], 10)
            for pid in (int(p) for p in proc.stdout.split() if p.isdigit()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run(["ip", "netns", "del", path.name], 10)
        try:
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
        except OSError:
            return
        marker = "# gspo-megatron test Slurm gspo-slurm-"
        kept = [line for line in lines if marker not in line
                or Path(f"/proc/{line.rsplit('-', 1)[-1].strip()}").exists()]
        if len(kept) != len(lines):
            HOSTS_FILE.write_text("".join(kept))

    def _start(self, timeout: float) -> None:
        self.cleanup_stale()
        for sub in ("state", "spool", "run", "log"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(SLURM_CONF.format(host=socket.gethostname(), d=self.workdir,
                                               cpus=CPUS_PER_NODE))
        _check(["ip", "netns", "add", self.netns], 10)
        _check(self._nsenter(["ip", "link", "set", "lo", "up"]), 10)
        # slurmctld loops on getaddrinfo when loopback holds only 127.0.0.1 (docs/cpu.md).
        _check(self._nsenter(["ip", "addr", "add", "127.0.0.2/8", "dev", "lo"]), 10)
        self._add_hosts_line()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait_for(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0,
                       timeout, "slurmctld to answer `scontrol ping`")
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(self._nodes_idle, timeout, f"nodes {NODES} to be idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.workdir / "log" / f"{name}.stdout", "w")
        self._daemons[name] = subprocess.Popen(self._nsenter(cmd), stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True)
        out.close()

    def _nodes_idle(self) -> bool:
        for name, proc in self._daemons.items():
            if proc.poll() is not None:
                raise SlurmClusterError(f"{name} exited {proc.returncode}:\n"
                                        f"{_tail(self.workdir / 'log' / f'{name}.stdout')}\n{self.log_tails()}")
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        raise SlurmClusterError(f"timed out after {timeout} s waiting for {what}\n{self.log_tails()}")

    def _add_hosts_line(self) -> None:
        text = HOSTS_FILE.read_text()
        if not text.endswith("\n"):
            text += "\n"
        HOSTS_FILE.write_text(text + self._hosts_line + "\n")

    def _remove_hosts_line(self) -> None:
        try:
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
        except OSError:
            return
        kept = [line for line in lines if line.rstrip("\n") != self._hosts_line]
        if len(kept) != len(lines):
            HOSTS_FILE.write_text("".join(kept))

    def _namespace_pids(self) -> list[int]:
        proc = _run(["ip", "netns", "pids", self.netns], 10)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def stop(self) -> None:
        """Tear everything down; safe to call on a partly started cluster, never raises on the way."""
        if self.netns_path.exists() and "slurmctld" in self._daemons:
            try:
                self.cancel_all()
            except SlurmClusterError:
                pass
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._daemons.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self.netns_path.exists():
            # Whatever still lives in the namespace was started by this cluster (job steps, servers).
            try:
                for pid in self._namespace_pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except SlurmClusterError:
                pass
            _run(["ip", "netns", "del", self.netns], 10)
        self._remove_hosts_line()


def cluster_unavailable_reason() -> str | None:
    """Why this machine cannot host the test cluster (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the test Slurm needs root (apt-get, ip netns, /etc/hosts)"
    for tool in ("ip", "nsenter"):
        if not shutil.which(tool):
            return f"the test Slurm needs `{tool}` (iproute2 / util-linux)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A started two-node Slurm for the whole session; torn down at the end."""
    reason = cluster_unavailable_reason()
    if reason:
        pytest.skip(reason)
    ensure_slurm_installed()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()
