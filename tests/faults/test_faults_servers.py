"""SGLang servers lost in a run (rollout/servers/health.py): a killed server the run launched comes back
and serves again only with the current weights; with none left the run saves, waits its bound
and exits 75 (retryable) with one line, and a resume trains every prompt once.

The kill is tested in the synchronous and the asynchronous loop.

Before: one server killed out of two went unnoticed and never came back; the only server killed
ended the run with exit 2, after no save (docs/faults.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from faults_common import train_args
from fixtures_servers import launch_tiny_server
from test_faults_signal import _expected_prompts, _prompts_trained, _wait_for_steps
from test_trainer_e2e import ROOT, env, run_train, train_cmd

pytestmark = pytest.mark.slow
FAST_HEALTH = {"rollout.server_health_interval_s": 0.5, "rollout.server_health_timeout_s": 10}


def _popen(run_dir: Path, url: str | None, **extra) -> subprocess.Popen:
    args = train_args(run_dir, url or "http://unused", **{
        "checkpoint.interval": 100, "logging.rollout_records": str(run_dir / "records.jsonl"),
        **FAST_HEALTH, **extra})
    if url is None:  # the run launches its own servers
        args += ["--set", "rollout.server_urls=[]"]
    return subprocess.Popen(train_cmd(1) + args, cwd=ROOT, env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_a_prefill(log: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until the server's log holds one more prefill than now: a rollout is under way."""
    start, deadline = log.read_text(errors="replace").count("Prefill batch"), time.monotonic() + timeout_s
    while log.read_text(errors="replace").count("Prefill batch") <= start:
        assert proc.poll() is None and time.monotonic() < deadline, f"no prefill in {log} within {timeout_s} s"
        time.sleep(0.02)


def _wait_for_records_of_step(path: Path, step: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until the rollout records hold a row of `step`: its rollout is done, its training next."""
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and f'"step": {step},' in path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"no records of step {step} within {timeout_s} s"
        time.sleep(0.01)


def _launched_servers(trainer: subprocess.Popen) -> list[psutil.Process]:
    """The SGLang servers the trainer launched: its children leading their own process group."""
    return [p for p in psutil.Process(trainer.pid).children(recursive=True)
            if "sglang.launch_server" in " ".join(p.cmdline()) and os.getpgid(p.pid) == p.pid]


def _steps(run_dir: Path) -> list[dict]:
    from gspo_megatron.run.metrics import read_jsonl
    return read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_a_killed_server_the_run_launched_is_restarted_resynced_and_serves_again(tmp_path, max_staleness):
    proc = _popen(tmp_path, None, **{"rollout.num_servers": 2, "train.steps": 1000,
                                     "train.max_staleness": max_staleness})
    out: list[str] = []
    errs: list[str] = []
    readers = [threading.Thread(target=lambda f=f, into=into: into.extend(f), daemon=True)
               for f, into in ((proc.stdout, out), (proc.stderr, errs))]
    for r in readers:
        r.start()
    try:
        _wait_for_steps(tmp_path, proc, 2)
        servers = _launched_servers(proc)
        assert len(servers) == 2, servers
        os.killpg(servers[0].pid, signal.SIGKILL)
        killed_at, deadline = len(_steps(tmp_path)), time.monotonic() + 300
        while not any("back in service at weight version" in ln for ln in out):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out)[-3000:]
            time.sleep(0.2)
        _wait_for_steps(tmp_path, proc, len(_steps(tmp_path)) + 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        for r in readers:
            r.join(timeout=10)
    text, err = "".join(out), "".join(errs)
    assert proc.returncode == 143, err[-3000:]
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == list(range(len(steps)))  # every step once, in order
    assert sum(s["rollout/server_failures"] for s in steps) == 1
    assert sum(s["rollout/server_restarts"] for s in steps) == 1
    assert min(s["rollout/servers_live"] for s in steps[killed_at:]) == 1, steps[killed_at:]
    assert steps[-1]["rollout/servers_live"] == 2  # the restarted one generates again
    # it took requests only after the sync that gave it the trainer's version
    url = next(ln for ln in text.splitlines() if "back in service" in ln).split()[3]
    version = int(text.split("back in service at weight version ")[1].split()[0])
    assert f"SGLang server {url} taken out of service" in text and "restarting it (1 of 3)" in text
    assert killed_at < version <= len(steps), (version, killed_at)  # a version trained after the kill
    assert "Traceback" not in err


@pytest.mark.parametrize("lost_in", ["rollout", "sync"])
def test_the_only_server_killed_saves_waits_its_bound_exits_75_and_resume_trains_every_prompt_once(
        tmp_path, server_url, lost_in):
    """Killed while a rollout runs, the step is abandoned and the last one saved; killed once the
    step's rollout is done (its records written: the kill lands in its training or its weight sync),
    the step is trained but no server takes its weights: saved as trained (its sync deferred, the
    resumed run syncs its servers at start), not redone. Either way the line names the checkpoint."""
    steps = 5
    with launch_tiny_server("qwen3_moe") as group:
        url = group.server_urls[0]
        proc = _popen(tmp_path, url, **{"train.steps": steps, "rollout.server_wait_s": 3})
        _wait_for_steps(tmp_path, proc, 2)
        if lost_in == "rollout":
            _wait_for_a_prefill(group.servers[0].log_path, proc)
        else:
            _wait_for_records_of_step(tmp_path / "records.jsonl", 2, proc)
        group.servers[0].kill()
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=300)
        seconds = time.monotonic() - t0
    done = len(_steps(tmp_path))
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error")]
    assert proc.returncode == 75 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].count(url) == 1 and f"{url}: out (" in lines[0], lines[0]  # never an empty reason
    assert "rollout.server_wait_s=3 s" in lines[0] and f"the checkpoint of step {done} resumes it" in lines[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{done:08d}"
    if lost_in == "sync":  # the step after the kill was trained and saved, its sync deferred
        assert done == 3 and "sync/bytes" not in _steps(tmp_path)[-1], (done, _steps(tmp_path)[-1])
    assert url in (tmp_path / "ckpt" / "NO_SERVER_LEFT").read_text()  # launch/slurm/job.sh requeues on it
    assert seconds < 60, seconds  # the bound: the retries on the lost connection, the save, 3 s
    # a server is back (the session's: a third server start would add ~45 s): the run resumes
    resumed = run_train(train_args(tmp_path, server_url, **{
        "train.steps": steps, "checkpoint.interval": 100,
        "logging.rollout_records": str(tmp_path / "records.jsonl")}))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert [s["step"] for s in _steps(tmp_path)] == list(range(steps))
    per_step = 2  # rollout.prompts_per_step
    expected = _expected_prompts(steps * per_step)
    assert _prompts_trained(tmp_path) == [sorted(expected[k * per_step:(k + 1) * per_step])
                                          for k in range(steps)]
