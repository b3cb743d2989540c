"""On-policy distillation's teacher fails like a policy server (rollout/servers/health.py, run/recovery.py):
one victim run whose teacher server (launched by the run) is SIGKILLed after step 2, restarted and
scoring again, then SIGSTOPped: out within its health timeout, past its restart bound, so no
teacher is left and the run saves its last finished step and exits 75 with one line naming the
teacher. The student's server is the module's (attached), never touched.

Before: the killed teacher ended the run with exit 2, not restarted, the last step not saved; a
stopped one stalled the run with no line for minutes (docs/faults.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from faults_common import train_args
from fixtures_models import tiny_model_dir
from test_faults_servers import _launched_servers, _steps
from test_faults_signal import _wait_for_steps
from test_trainer_e2e import ROOT, env, train_cmd

pytestmark = pytest.mark.slow
HEALTH_TIMEOUT_S = 10


def _read(stream, into: list[tuple[float, str]]) -> None:
    for line in stream:
        into.append((time.monotonic(), line))


def _wait_for_line(out: list[tuple[float, str]], proc: subprocess.Popen, text: str, timeout: float,
                   after: float = 0.0) -> float:
    """When the first line with `text` said after `after` came (monotonic seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        hit = next((t for t, ln in list(out) if text in ln and t >= after), None)
        if hit is not None:
            return hit
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"no line with {text!r}:\n" + "".join(ln for _, ln in out)[-4000:]
        time.sleep(0.2)


def test_a_killed_teacher_is_restarted_and_scores_again_a_stalled_one_is_out_and_none_left_exits_75(
        tmp_path: Path, server_url):  # noqa: F811
    args = train_args(tmp_path, server_url, **{
        "loss.name": "gspo_token", "distill.teacher": str(tiny_model_dir("qwen3", 0)),
        "distill.reward_coef": 0, "train.steps": 1000, "checkpoint.interval": 100,
        "rollout.server_health_interval_s": 0.5, "rollout.server_health_timeout_s": HEALTH_TIMEOUT_S,
        "rollout.server_max_restarts": 1, "rollout.server_wait_s": 240})
    proc = subprocess.Popen(train_cmd(1) + args, cwd=ROOT, env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out: list[tuple[float, str]] = []
    errs: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read, args=(f, into), daemon=True)
               for f, into in ((proc.stdout, out), (proc.stderr, errs))]
    for r in readers:
        r.start()
    try:
        _wait_for_steps(tmp_path, proc, 2)
        (teacher,) = _launched_servers(proc)  # the student's server is attached: the teacher alone
        os.killpg(teacher.pid, signal.SIGKILL)
        killed_at = len(_steps(tmp_path))
        _wait_for_line(out, proc, "back in service", 300)
        _wait_for_steps(tmp_path, proc, len(_steps(tmp_path)) + 2)  # it scores again
        (teacher,) = _launched_servers(proc)
        os.killpg(teacher.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out_at = _wait_for_line(out, proc, "taken out of service: health probe", 60, after=stopped)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        for r in readers:
            r.join(timeout=10)
    text, err = "".join(ln for _, ln in out), "".join(ln for _, ln in errs)
    url = next(ln for ln in text.splitlines() if "back in service" in ln).split()[3]
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error")]
    # none left: the last finished step saved, one line naming the teacher, exit 75 (requeued)
    assert proc.returncode == 75 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    done = len(_steps(tmp_path))
    assert lines[0].startswith("gspo-megatron: error: no teacher server in service and none can come back "), lines[0]
    assert f"{url}: gone (" in lines[0] and "rollout.server_max_restarts=1 reached" in lines[0], lines[0]
    assert f"the checkpoint of step {done} resumes it" in lines[0], lines[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{done:08d}"
    assert url in (tmp_path / "ckpt" / "NO_SERVER_LEFT").read_text()
    # the stalled teacher was out within its health timeout
    assert out_at - stopped < HEALTH_TIMEOUT_S + 5, out_at - stopped
    # the killed one was restarted and scored every later step; nothing said the policy's server failed
    assert f"teacher server {url} is out (" in text and "restarting it (1 of 1)" in text, text[-3000:]
    assert f"SGLang server {url}" not in text and "restart failed" not in text
    steps = _steps(tmp_path)
    assert [s["step"] for s in steps] == list(range(done))  # every step once, in order
    assert sum(s["distill/teacher_restarts"] for s in steps) == 1
    assert sum(s["distill/teacher_failures"] for s in steps) == 1
    assert sum(s["rollout/server_failures"] for s in steps) == 0
    assert all(s["distill/teacher_tokens_per_s"] > 0 and s["distill/teachers_live"] == 1
               for s in steps[killed_at:]), steps[killed_at:]
    print(f"steps {done}, killed after {killed_at}; out {out_at - stopped:.1f} s after SIGSTOP")
    print("\n".join(ln for ln in text.splitlines() if "teacher" in ln) + "\n" + lines[0])
