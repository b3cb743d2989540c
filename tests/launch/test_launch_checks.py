"""The launchers reject bad inputs before anything is allocated or started (fast: no Slurm needed).

submit.sh --dry-run runs every check and prints the sbatch command instead of running it, so a
failing check is seen as exit 2 + a message naming the offending value, with no command printed.
The slow tests (test_slurm.py) check the same against a real Slurm: nothing is queued.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "launch" / "slurm" / "submit.sh"
LOCAL = ROOT / "launch" / "local.sh"
check_config = load_script("launch/check_config.py")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GSPO_", "SLURM_"))}
    return {**env, **extra}


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  tensor: 1\n")
    return {"model": model, "config": config, "run_dir": tmp_path / "run"}


def submit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUBMIT), "--dry-run", *args], capture_output=True, text=True,
                          timeout=60, env=env or clean_env())


def test_valid_inputs_print_the_sbatch_command_with_the_real_trainer_by_default(inputs):
    p = submit("--mode", "disaggregated", "--nodes", "3", "--server-nodes", "1", "--gpus-per-node", "8",
               "--model-path", str(inputs["model"]), "--run-dir", str(inputs["run_dir"]),
               "--time", "01:00:00", str(inputs["config"]), "--set", "parallel.tensor=4")
    assert p.returncode == 0, p.stderr
    cmd = p.stdout
    for part in ("sbatch", "--nodes=3", "--gpus-per-node=8", "--requeue", "--signal=B:USR1@300",
                 "--open-mode=append", "--time=01:00:00", f"--output={inputs['run_dir']}/logs/slurm-%j.out",
                 str(ROOT / "launch/slurm/disaggregated.sbatch"), str(inputs["config"]),
                 "--set parallel.tensor=4"):
        assert part in cmd, (part, cmd)
    assert "--wait" not in cmd
    assert (inputs["run_dir"] / "logs").is_dir()  # sbatch --output needs it before the job starts


def test_cpu_run_asks_for_no_gpus(inputs):
    p = submit("--mode", "colocated", "--nodes", "2", "--gpus-per-node", "0", "--wait",
               "--model-path", str(inputs["model"]), "--run-dir", str(inputs["run_dir"]), str(inputs["config"]))
    assert p.returncode == 0, p.stderr
    assert "--gpus-per-node" not in p.stdout and "colocated.sbatch" in p.stdout and "--wait" in p.stdout


def test_env_vars_are_the_same_parameters_as_options(inputs):
    env = clean_env(GSPO_MODE="colocated", GSPO_NODES="4", GSPO_GPUS_PER_NODE="0",
                    GSPO_MODEL_PATH=str(inputs["model"]), GSPO_RUN_DIR=str(inputs["run_dir"]))
    p = submit(str(inputs["config"]), env=env)
    assert p.returncode == 0, p.stderr
    assert "--nodes=4" in p.stdout and "colocated.sbatch" in p.stdout


BAD = {
    "missing config": ([], "{config}.nope", "does not exist"),
    "bad mode": (["--mode", "split"], "{config}", "GSPO_MODE must be 'disaggregated' or 'colocated'"),
    "nodes not a number": (["--nodes", "two"], "{config}", "GSPO_NODES must be a whole number"),
    "no trainer node left": (["--nodes", "2", "--server-nodes", "2"], "{config}", "node counts do not add up"),
    "zero server nodes": (["--server-nodes", "0"], "{config}", "needs GSPO_SERVER_NODES >= 1"),
    "more ranks than GPUs": (["--gpus-per-node", "4", "--procs-per-node", "8"], "{config}",
                             "trainer ranks per node exceed GSPO_GPUS_PER_NODE=4"),
    "GPUs not split evenly": (["--gpus-per-node", "8", "--servers-per-node", "3"], "{config}",
                              "not divisible by GSPO_SERVERS_PER_NODE=3"),
    "layout does not fit": (["--nodes", "2", "--gpus-per-node", "2"], "{config}",
                            "trainer world size 2 (trainer nodes x ranks per node) is not divisible by "
                            "parallel.tensor x parallel.pipeline = 4 x 1 = 4", "parallel.tensor=4"),
    "malformed override": ([], "{config}", "override 'tensor4': expected --set dotted.key=value", "tensor4"),
    "launcher-owned override": ([], "{config}", "the launcher sets it; use GSPO_CHECKPOINT_DIR",
                                "checkpoint.dir=/x"),
    "urls and server nodes": (["--server-urls", "http://h:1"], "{config}", "set GSPO_SERVER_NODES=0"),
    "malformed url": (["--server-urls", "h:1", "--server-nodes", "0"], "{config}", "is not of the form http://HOST:PORT"),
    "unknown option": (["--nodez", "2"], "{config}", "unknown option '--nodez'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_before_submitting(inputs, case):
    opts, config, message, *override = BAD[case]
    args = ["--gpus-per-node", "0", "--model-path", str(inputs["model"]), "--run-dir", str(inputs["run_dir"]),
            *opts, config.format(config=inputs["config"])]
    if override:
        args += ["--set", override[0]]
    p = submit(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert message in p.stderr, p.stderr
    assert "sbatch" not in p.stdout


def test_model_path_is_required_and_checked(inputs, tmp_path):
    base = ["--gpus-per-node", "0", "--run-dir", str(inputs["run_dir"]), str(inputs["config"])]
    p = submit(*base)
    assert p.returncode == 2 and "GSPO_MODEL_PATH is not set" in p.stderr
    p = submit("--model-path", str(tmp_path / "absent"), *base)
    assert p.returncode == 2 and "absent is not a directory" in p.stderr
    p = submit("--model-path", str(tmp_path), *base)
    assert p.returncode == 2 and "has no readable config.json" in p.stderr


def test_config_must_be_a_yaml_mapping(inputs, tmp_path):
    base = ["--gpus-per-node", "0", "--model-path", str(inputs["model"]), "--run-dir", str(inputs["run_dir"])]
    broken = tmp_path / "broken.yaml"
    broken.write_text("parallel: [1, 2\n")
    p = submit(*base, str(broken))
    assert p.returncode == 2 and "not valid YAML" in p.stderr
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    p = submit(*base, str(listed))
    assert p.returncode == 2 and "expected a YAML mapping at the top, got list" in p.stderr


def test_commands_and_env_file_must_exist(inputs, tmp_path):
    args = ["--gpus-per-node", "0", "--model-path", str(inputs["model"]), "--run-dir", str(inputs["run_dir"]),
            str(inputs["config"])]
    p = submit(*args, env=clean_env(GSPO_TRAIN_CMD=f"{tmp_path}/no-trainer train"))
    assert p.returncode == 2 and "GSPO_TRAIN_CMD: " in p.stderr and "no-trainer" in p.stderr
    p = submit(*args, env=clean_env(GSPO_ENV_FILE=str(tmp_path / "site.env")))
    assert p.returncode == 2 and "site.env is not a readable file" in p.stderr


@pytest.mark.parametrize("script", ["disaggregated.sbatch", "colocated.sbatch"])
def test_batch_scripts_refuse_to_run_outside_slurm(script):
    p = subprocess.run(["bash", str(ROOT / "launch/slurm" / script), "x.yaml"], capture_output=True,
                       text=True, timeout=30, env=clean_env(), cwd=ROOT)
    assert p.returncode == 2 and "submit it with sbatch" in p.stderr


def test_local_launcher_checks_before_starting_anything(inputs):
    p = subprocess.run(["bash", str(LOCAL), "--gpus", "2", "--procs", "4", "--model-path", str(inputs["model"]),
                        "--run-dir", str(inputs["run_dir"]), str(inputs["config"])],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert p.returncode == 2 and "trainer ranks per node exceed GSPO_GPUS_PER_NODE=2" in p.stderr
    assert not (inputs["run_dir"] / "checkpoints").exists()


@pytest.mark.parametrize("world,overrides,problem", [
    (8, ["parallel.tensor=2", "parallel.pipeline=2"], None),
    (6, ["parallel.tensor=4"], "not divisible by parallel.tensor x parallel.pipeline = 4 x 1 = 4"),
    (8, ["parallel.tensor=2", "parallel.expert=8"],
     "not divisible by parallel.expert_tensor x parallel.expert x parallel.pipeline = 2 x 8 x 1 = 16"),
    (8, ["parallel.tensor=2", "parallel.expert=8", "parallel.expert_tensor=1"], None),
    (4, ["parallel.tensor=0"], "parallel.tensor must be an integer >= 1, got 0"),
    (4, ["rollout.server_urls=[http://a:1]"], "the launcher sets it; use GSPO_SERVER_URLS"),
])
def test_check_config_world_size_rules(tmp_path, world, overrides, problem):
    config = tmp_path / "c.yaml"
    config.write_text("parallel:\n  pipeline: 1\n")
    reserved = {"checkpoint.dir": "GSPO_CHECKPOINT_DIR", "rollout.server_urls": "GSPO_SERVER_URLS"}
    problems = check_config.check(config, world, overrides, reserved)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems
