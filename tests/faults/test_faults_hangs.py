"""SIGTERM while a rollout request or a reward hangs, in the synchronous and the asynchronous loop:
the run exits 143 within 30 s (launch scripts give GSPO_STOP_GRACE=60 s before
SIGKILL), with a checkpoint of its last finished step and one line.

A hung request: an SGLang server of the test's own, stopped with SIGSTOP (and killed after).
rollout.server_health_timeout_s is 120 s, longer than the bound: the exit must not wait for the
health probe to take the server out. A hung reward: reward_functions:hangs_when_flagged on the
session's server, with rollout.reward_timeout_s 600 s.

Before: the exit waited for the probe of the stopped server (121.6 s: HealthMonitor.close joined
its thread for the health timeout), and the abandoned step's drain for its stalled requests.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from fixtures_servers import launch_tiny_server
from test_faults_signal import _start, _wait_for_steps
from test_trainer_e2e import server_url  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow
BOUND_S = 30


@pytest.mark.parametrize("hang", ["request", "reward"])
@pytest.mark.parametrize("max_staleness", [0, 1], ids=["sync", "async"])
def test_sigterm_while_a_request_or_a_reward_hangs_exits_143_with_the_last_step_saved(
        tmp_path, server_url, monkeypatch, hang, max_staleness):  # noqa: F811
    from gspo_megatron.run.metrics import read_jsonl
    flag = tmp_path / "hang"
    monkeypatch.setenv("GSPO_TEST_HANG_FLAG", str(flag))
    extra = {"train.steps": 100, "train.max_staleness": max_staleness,
             "rollout.server_health_timeout_s": 120, "rollout.reward_timeout_s": 600}
    if hang == "reward":
        extra["rollout.reward"] = "reward_functions:hangs_when_flagged"
    with launch_tiny_server("qwen3_moe") if hang == "request" else contextlib.nullcontext() as own:
        proc = _start(tmp_path, own.server_urls[0] if own else server_url, **extra)
        try:
            _wait_for_steps(tmp_path, proc, 1)
            if own:
                os.killpg(own.servers[0].proc.pid, signal.SIGSTOP)  # it leads its process group
                time.sleep(3)  # the next rollout's requests (or the sync's calls) reach a stopped server
            else:
                flag.touch()
                deadline = time.monotonic() + 120
                while not (tmp_path / "hang.hanging").exists():  # a reward call hangs now
                    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                    time.sleep(0.1)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=300)
            seconds = time.monotonic() - t0
        finally:
            proc.kill()
            if own:
                own.servers[0].kill()  # SIGKILL reaches a stopped process (SIGTERM would wait)
    done = len(read_jsonl(tmp_path / "tb" / "metrics.jsonl", steps_only=True))
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron:")]
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert seconds < BOUND_S, (seconds, lines, err[-1500:])
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{done:08d}"
    assert lines == [f"gspo-megatron: SIGTERM (rank 0): saved a checkpoint of step {done} in "
                     f"{tmp_path / 'ckpt'}; exiting with 143 (the same command resumes)"], err[-3000:]
    if hang == "reward":  # the hung reward workers went with the run: no process left behind
        import psutil
        pids = [int(p) for p in (tmp_path / "hang.hanging").read_text().split()]
        gone = lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE  # noqa: E731
                               for p in pids)
        deadline = time.monotonic() + 10
        while not gone():
            assert time.monotonic() < deadline, f"reward workers {pids} outlived the run"
            time.sleep(0.1)
    print(f"{hang} hangs, {'async' if max_staleness else 'sync'} loop: exit 143 {seconds:.1f} s "
          f"after SIGTERM, checkpoint of step {done}")
