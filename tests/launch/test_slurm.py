"""The SLURM launch scripts, submitted for real (`sbatch --wait`) to a two-node Slurm on this host.

The cluster is tests/slurm_cluster.py's (slurmctld + slurmd n1, n2; 2 CPUs each). Every job runs the
same scripts users run, with GPUs=0 (gloo).

- The real run: `gspo-megatron train` (TP2 on one node) against a real SGLang server on the other
  node (`python -m rollout.servers.launch`, the scripts' defaults), signalled mid-run as the time limit
  does (`scancel --signal=USR1 --batch`): it saves on the signal, the job requeues itself and the
  next attempt resumes from that checkpoint with no step lost or repeated. Two real jobs on one
  run folder: the second trainer stops at the run lock.
- The launcher's edge cases (colocated and disaggregated shapes, the two preemption paths, a failing
  trainer, bad input) run with stand-ins that take seconds instead of minutes: tests/
  launch_toy_trainer.py (a real all-reduce across ranks and nodes, atomic per-step checkpoints,
  resume from `latest`) and tests/launch_toy_server.py (/health).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures_models import tiny_model_dir
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TOY = {
    "GSPO_TRAIN_CMD": f"{PY} {ROOT}/tests/launch_toy_trainer.py train",
    "GSPO_SERVER_CMD": f"{PY} {ROOT}/tests/launch_toy_server.py",
    "GSPO_PYTHON": PY,
}
JOB_TIMEOUT = 120


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GSPO_", "SLURM_"))}
    return {**env, **TOY, **extra}


@pytest.fixture
def run(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "toy.yaml"
    config.write_text("toy:\n  steps: 3\n")
    return {"model": model, "config": config, "dir": tmp_path / "run"}


def submit(cluster, run, *opts: str, env=None, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    args = [str(ROOT / "launch/slurm/submit.sh"), "--wait", "--gpus-per-node", "0",
            "--model-path", str(run["model"]), "--run-dir", str(run["dir"]), *opts]
    try:
        return cluster.run(args, timeout=timeout, check=False, env=env or job_env(), cwd=ROOT)
    except Exception:
        cluster.cancel_all()
        raise


def history(run) -> list[dict]:
    ckpt = run["dir"] / "checkpoints"
    return json.loads((ckpt / (ckpt / "latest").read_text().strip()).read_text())["history"]


def batch_log(run) -> str:
    return "\n".join(p.read_text() for p in sorted((run["dir"] / "logs").glob("slurm-*.out")))


def step_logs(run) -> list[str]:
    return sorted(str(p.relative_to(run["dir"] / "logs")) for p in (run["dir"] / "logs").glob("*/*.log"))


def explain(proc, run) -> str:
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((run["dir"] / "logs").rglob("*"))
                     if p.is_file())
    return f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{logs}"


def test_torch_distributed_over_srun_across_two_nodes(slurm_cluster, tmp_path):  # noqa: F811  (the fixture imported above)
    """The infrastructure itself: srun-started ranks on n1 and n2 rendezvous on the first hostname."""
    script = tmp_path / "allreduce.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output={tmp_path}/out.txt
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=29511
srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec {PY} -c "
import os, torch, torch.distributed as d
d.init_process_group(\\"gloo\\")
t = torch.tensor([d.get_rank() + 1.0]); d.all_reduce(t)
print(\\"RESULT\\", d.get_rank(), os.environ[\\"SLURMD_NODENAME\\"], t.item(), flush=True)
d.destroy_process_group()"'
""")
    proc = slurm_cluster.sbatch_wait([str(script)], timeout=JOB_TIMEOUT, cwd=tmp_path)
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, out
    results = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT"))
    assert results == [["0", "n1", "3.0"], ["1", "n2", "3.0"]], out


def _real_job(tmp_path: Path, run_dir: Path, mode: str, nodes: int, steps: int, **extra) -> list[str]:
    sets = {"model.hf_path": tiny_model_dir("qwen3_moe", 0), "parallel.tensor": 2 if mode == "disaggregated" else 1,
            "rollout.group_size": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
            "train.steps": steps, "train.mini_batches": 2, "train.micro_batch_size": 4,
            "train.warm_start_steps": 0, "checkpoint.interval": 100, "checkpoint.export_hf": "null",
            "logging.tensorboard_dir": run_dir / "tb", "eval.interval": 0, **extra}
    return [str(ROOT / "launch/slurm/submit.sh"), "--wait", "--mode", mode, "--nodes", str(nodes),
            *(["--server-nodes", "1", "--procs-per-node", "2"] if mode == "disaggregated" else []),
            "--gpus-per-node", "0", "--model-path", str(sets["model.hf_path"]), "--run-dir", str(run_dir),
            str(ROOT / "examples/tiny_moe_larger_digit.yaml"),
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


def _real_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GSPO_", "SLURM_"))}
    env["GSPO_PYTHON"] = PY  # the trainer command stays the default, .venv/bin/gspo-megatron train
    return env


def test_real_trainer_and_sglang_preempted_mid_run_save_on_the_signal_and_resume(slurm_cluster, tmp_path):  # noqa: F811  (the fixture imported above)
    """The tiny MoE job as users submit it: trainer ranks (TP2) on n1, a real SGLang server on n2,
    checkpoints only every 100 steps. Mid-run, `scancel --signal=USR1 --batch` (what the time limit
    sends, `#SBATCH --signal=B:USR1@300`): the batch script SIGTERMs the trainer step, every rank
    finishes or abandons its step, saves it (checkpoint.save_on_signal) and exits 143; the script
    requeues the job; the second attempt resumes from that checkpoint and the run ends with each
    step's metrics exactly once."""
    from gspo_megatron.run.metrics import read_jsonl, read_scalars
    steps, run_dir = 6, tmp_path / "run"
    proc = slurm_cluster.popen(_real_job(tmp_path, run_dir, "disaggregated", 2, steps), env=_real_env(),
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    jsonl = run_dir / "tb" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (jsonl.is_file() and len(read_jsonl(jsonl, live=True, steps_only=True)) >= 2) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert jsonl.is_file() and len(read_jsonl(jsonl, live=True, steps_only=True)) >= 2, "no step 1:\n" + explain(proc, {"dir": run_dir})
        job_id = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()[0]
        slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
        proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            slurm_cluster.cancel_all()
    run = {"dir": run_dir}
    assert proc.returncode == 0, explain(proc, run)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    records = read_jsonl(jsonl, steps_only=True)
    assert [r["step"] for r in records] == list(range(steps)), explain(proc, run)
    assert [s for s, _ in read_scalars(run_dir / "tb")["rollout/reward_mean"]] == list(range(steps))
    log = batch_log(run)
    assert "USR1 (time limit near or preemption notice)" in log and "requeued: the next attempt resumes" in log
    assert log.count("has 'latest': the trainer resumes from it") == 1, log
    logs = step_logs(run)
    attempts = sorted({p.split("/")[0] for p in logs})
    assert [a.split(".")[1] for a in attempts] == ["0", "1"], logs
    first = {r: (run_dir / "logs" / attempts[0] / f"trainer-n1-r{r}.log").read_text() for r in (0, 1)}
    saved = [ln for ln in first[0].splitlines() if "saved a checkpoint of step" in ln]
    assert len(saved) == 1 and saved[0].startswith("gspo-megatron: SIGTERM (rank 0): saved a checkpoint of "
                                                   "step ") and "exiting with 143" in saved[0], first[0][-3000:]
    k = int(saved[0].split("of step ")[1].split()[0])
    assert 2 <= k < steps and "SIGTERM (rank 1): saved a checkpoint of step" in first[1], first[1][-3000:]
    resumed = (run_dir / "logs" / attempts[1] / "trainer-n1-r0.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{k:08d}'} (step {k})" in resumed, resumed[-3000:]
    assert "layout TP2" in resumed and "servers: http://n2:30000" in log


def test_two_jobs_on_one_run_folder_one_trains_the_other_stops_at_the_lock(slurm_cluster, tmp_path):  # noqa: F811  (the fixture imported above)
    """Two jobs submitted with the same run folder, one node each (colocated: its own SGLang
    server): whichever trainer starts second stops at once with the lock line naming the other's
    host, pid and Slurm job; the first trains to the end; metrics hold every step once."""
    from gspo_megatron.run.metrics import read_jsonl
    run_dir, steps = tmp_path / "run", 3
    procs = []
    for port in (31000, 32000):  # both "nodes" share this host's ports
        env = {**_real_env(), "GSPO_SERVER_PORT": str(port)}
        procs.append(slurm_cluster.popen(_real_job(tmp_path, run_dir, "colocated", 1, steps), env=env,
                                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.communicate(timeout=600)
    finally:
        if any(p.poll() is None for p in procs):
            for p in procs:
                p.kill()
            slurm_cluster.cancel_all()
    run = {"dir": run_dir}
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, explain(procs[0], run) + explain(procs[1], run)
    trainer_logs = {p: p.read_text() for p in (run_dir / "logs").glob("*/trainer-*.log")}
    refused = [t for t in trainer_logs.values() if "is in use by another run" in t]
    assert len(refused) == 1, trainer_logs
    line = [ln for ln in refused[0].splitlines() if ln.startswith("gspo-megatron: error")]
    assert len(line) == 1 and f"checkpoint.dir='{run_dir / 'checkpoints'}' is in use by another run (host " in line[0]
    assert ", Slurm job " in line[0] and "Traceback" not in refused[0]
    assert [r["step"] for r in read_jsonl(run_dir / "tb" / "metrics.jsonl", steps_only=True)] == list(range(steps))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"


def test_colocated_servers_and_ranks_on_both_nodes(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    proc = submit(slurm_cluster, run, "--mode", "colocated", "--nodes", "2", str(run["config"]))
    assert proc.returncode == 0, explain(proc, run)
    steps = history(run)
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert [h["value"] for h in steps] == [3.0, 6.0, 9.0]  # sum over ranks of (rank + 1) * step
    assert steps[0]["hosts"] == ["n1", "n2"] and steps[0]["world_size"] == 2
    assert steps[0]["servers"] == ["http://n1:30000", "http://n2:30001"]
    logs = step_logs(run)
    attempt = logs[0].split("/")[0]  # <job id>.0
    assert attempt.endswith(".0") and logs == [f"{attempt}/server-n1-s0.log", f"{attempt}/server-n2-s1.log",
                                               f"{attempt}/trainer-n1-r0.log", f"{attempt}/trainer-n2-r1.log"]
    log = batch_log(run)
    assert "has no 'latest': the trainer starts fresh" in log and "trainer finished" in log
    server_log = (run["dir"] / "logs" / attempt / "server-n2-s1.log").read_text()
    assert "listening on 0.0.0.0:30001 for n2" in server_log and "SIGTERM, stopping" in server_log


def test_disaggregated_server_node_and_trainer_node(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    proc = submit(slurm_cluster, run, "--mode", "disaggregated", "--nodes", "2", "--server-nodes", "1",
                  "--procs-per-node", "2", str(run["config"]), "--set", "toy.steps=2")
    assert proc.returncode == 0, explain(proc, run)
    steps = history(run)
    assert [h["step"] for h in steps] == [1, 2]
    assert steps[0]["hosts"] == ["n1", "n1"] and steps[0]["servers"] == ["http://n2:30000"]
    logs = step_logs(run)
    job = logs[0].split("/")[0]
    assert logs == [f"{job}/server-n2-s0.log", f"{job}/trainer-n1-r0.log", f"{job}/trainer-n1-r1.log"]


def wait_for_step(run, step: int, proc, timeout: float = 60) -> None:
    latest = run["dir"] / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if latest.exists() and latest.read_text().strip() >= f"step_{step:06d}.json":
            return
        assert proc.poll() is None, f"sbatch ended early: {proc.returncode}"
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint of step {step} within {timeout} s")


def test_preemption_requeue_resumes_without_losing_or_repeating_a_step(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    """Requeued twice mid-run: by `scontrol requeue` (Slurm's own preemption path: SIGTERM) and by
    the USR1 the time limit sends (the script requeues itself). Every step is committed once."""
    steps = 10  # after step 4, the USR1 must land before the last step: 6 s of margin, not 3 s
    proc = slurm_cluster.popen(
        [str(ROOT / "launch/slurm/submit.sh"), "--wait", "--mode", "colocated", "--nodes", "2",
         "--gpus-per-node", "0", "--model-path", str(run["model"]), "--run-dir", str(run["dir"]),
         str(run["config"]), "--set", f"toy.steps={steps}", "--set", "toy.step_seconds=1"],
        env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_step(run, 2, proc)
        job_id = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()[0]
        slurm_cluster.run(["scontrol", "requeue", job_id])
        wait_for_step(run, 4, proc, timeout=180)  # a requeue: cred expiry, reschedule, restart
        slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            slurm_cluster.cancel_all()
    assert proc.returncode == 0, explain(proc, run)
    done = history(run)
    assert [h["step"] for h in done] == list(range(1, steps + 1)), done
    assert [h["value"] for h in done] == [3.0 * s for s in range(1, steps + 1)]
    restarts = [h["restart"] for h in done]
    assert restarts == sorted(restarts) and set(restarts) == {0, 1, 2}, restarts
    log = batch_log(run)
    assert "SIGTERM (cancel, preemption or requeue)" in log
    assert "USR1 (time limit near or preemption notice)" in log and "requeued: the next attempt resumes" in log
    assert log.count("has 'latest': the trainer resumes from it") == 2
    attempts = sorted({p.split("/")[0] for p in step_logs(run)})
    assert [a.split(".")[1] for a in attempts] == ["0", "1", "2"]


def test_trainer_failure_fails_the_job_and_stops_the_servers(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    proc = submit(slurm_cluster, run, "--mode", "colocated", "--nodes", "2", str(run["config"]),
                  "--set", "toy.fail_at_step=2")
    assert proc.returncode != 0, explain(proc, run)
    assert [h["step"] for h in history(run)] == [1]
    log = batch_log(run)
    assert "trainer exited" in log
    for server_log in (run["dir"] / "logs").glob("*/server-*.log"):
        assert "SIGTERM, stopping" in server_log.read_text()
    assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == ""


def test_direct_sbatch_with_wrong_node_count_stops_before_any_step(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    env = job_env(GSPO_NODES="3", GSPO_GPUS_PER_NODE="0", GSPO_MODEL_PATH=str(run["model"]),
                  GSPO_RUN_DIR=str(run["dir"]))
    out = run["dir"].parent / "direct.out"
    proc = slurm_cluster.sbatch_wait(["--nodes=2", f"--output={out}", str(ROOT / "launch/slurm/colocated.sbatch"),
                                      str(run["config"])], timeout=JOB_TIMEOUT, env=env, cwd=ROOT)
    text = out.read_text()
    assert proc.returncode != 0, text
    assert "node counts do not add up: the allocation has 2 nodes (n[1-2]) but GSPO_NODES=3" in text
    assert not (run["dir"] / "checkpoints").exists() and step_logs(run) == []


def test_submit_with_bad_input_queues_nothing(slurm_cluster, run):  # noqa: F811  (the fixture imported above)
    args = [str(ROOT / "launch/slurm/submit.sh"), "--gpus-per-node", "0", "--run-dir", str(run["dir"]),
            "--mode", "disaggregated", "--nodes", "2", "--server-nodes", "2", "--model-path", str(run["model"]),
            str(run["config"])]
    proc = slurm_cluster.run(args, check=False, env=job_env(), cwd=ROOT)
    assert proc.returncode == 2 and "node counts do not add up" in proc.stderr
    assert "Submitted" not in proc.stdout
    assert slurm_cluster.run(["squeue", "-h"]).stdout.strip() == ""
