"""Fault injection: damaged inputs and faults, each with its exact behaviour: the exit code, one line
naming the file or field, nothing written, and a clean resume afterwards where one applies.

The fast cases fail in the trainer's input checks, before torch.distributed, a conversion or a
server starts, so they run in-process. The slow ones run `gspo-megatron train` as a user does,
against the session's shared SGLang server (attached by URL, as test_trainer_e2e does).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults_common import CONFIG, copy_run, dead_url, in_process_error, train_args
from fixtures_models import tiny_model_dir
from test_trainer_e2e import ROOT, _error_line, env, run_train, server_url, train_cmd  # noqa: F401


# --- fast: caught by the input checks -----------------------------------------------------------
def test_config_error_comes_before_torch_without_warnings(tmp_path):
    """Item 7: a config error is one line, with no Transformer Engine / Apex warnings, because
    torch and megatron-core are not imported before the config is valid."""
    code = ("import sys, time; t = time.perf_counter(); from gspo_megatron.cli import main; "
            f"rc = main(['train', {CONFIG!r}, '--set', 'train.stepz=3']); "
            "print(rc, 'torch' in sys.modules, 'megatron' in sys.modules, time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)
    rc, torch_loaded, megatron_loaded, seconds = proc.stdout.split()
    assert (rc, torch_loaded, megatron_loaded) == ("2", "False", "False"), proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "gspo-megatron: error: unknown key 'train.stepz' (did you mean 'steps'?); known: "
        + ", ".join(_train_keys())]
    print(f"config error in {float(seconds):.2f} s")


def _train_keys() -> list[str]:
    import dataclasses
    from gspo_megatron.config import TrainConfig
    return [f.name for f in dataclasses.fields(TrainConfig)]


def test_layout_and_prompt_errors_write_nothing(tmp_path, capsys):
    """Item 7 (and item 1's precondition): layout and prompt-file errors come before anything is
    converted or written; a malformed JSON line is shown where it breaks."""
    ck = tmp_path / "ck"
    hf = str(tiny_model_dir("qwen3_moe", 0))
    base = [CONFIG, "--set", f"model.hf_path={hf}", "--set", f"checkpoint.dir={ck}",
            "--set", f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    line = in_process_error(capsys, base + ["--set", "parallel.tensor=3"])
    assert "num_attention_heads 4 is not divisible by tensor 3" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "answer": "1"}\n{"prompt": "h\u00e9llo", "answer": }\n')
    line = in_process_error(capsys, base + ["--set", f"rollout.prompts={bad}"])
    assert f"{bad}:2: not valid JSON: Expecting value at character 31 of the line" in line
    assert "'mpt\": \"h\u00e9llo\", \"answer\": >>>}'" in line
    bad.write_bytes(b'{"prompt": "hi", "answer": "1"}\n{"prompt": "\xff"}\n')
    line = in_process_error(capsys, base + ["--set", f"rollout.prompts={bad}"])
    assert f"{bad}: not UTF-8 text (invalid start byte at byte offset 44)" in line
    assert not ck.exists() and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("damage,needle", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1000]), "is truncated: 564424 bytes, its header describes 565424"),
    (lambda f: f.write_bytes(f.read_bytes()[:4]), "too short for a safetensors header"),
    (lambda f: f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"), "unreadable safetensors header"),
])
def test_damaged_model_safetensors_is_named(tmp_path, capsys, damage, needle):
    """Item 4: a truncated or garbled model.safetensors gets one line with its path, before
    anything is written (safetensors' own error names no file)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3_moe", 0), model)
    damage(model / "model.safetensors")
    line = in_process_error(capsys, [CONFIG, "--set", f"model.hf_path={model}",
                                      "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert f"{model / 'model.safetensors'}" in line and needle in line, line
    assert not (tmp_path / "ck").exists()


def test_undecodable_latest_pointer_is_one_line(tmp_path, capsys):
    """Item 5: non-UTF-8 bytes in checkpoint.dir/latest get the same kind of line as ASCII garbage."""
    ck = tmp_path / "ck"
    ck.mkdir()
    args = [CONFIG, "--set", f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}",
            "--set", f"checkpoint.dir={ck}"]
    (ck / "latest").write_bytes(b"\xff\xfe\x00step")
    line = in_process_error(capsys, args)
    assert f"{ck / 'latest'} holds non-text bytes, expected a step name like step_00000010" in line
    (ck / "latest").write_text("garbage\n")
    assert f"{ck / 'latest'} names 'garbage', expected step_NNNNNNNN" in in_process_error(capsys, args)


# --- slow: real runs ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_checkpoint_shard_is_named_before_start_then_resumes(tmp_path, capsys, trained,
                                                                     server_url, damage):  # noqa: F811
    """Item 3: a missing or truncated shard of the latest checkpoint is named (from the manifest)
    before any server or process group starts; restored, the run resumes."""
    run_dir = copy_run(trained, tmp_path / "run")
    shard = sorted((run_dir / "ckpt" / "step_00000001" / "model").glob("*.distcp"))[0]
    original = shard.read_bytes()
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(original[: len(original) // 2])
    t0 = time.perf_counter()
    line = in_process_error(capsys, train_args(run_dir, server_url, **{"train.steps": 2}))
    seconds = time.perf_counter() - t0
    if damage == "missing":  # both messages name the file by its full path
        assert f"is damaged: {shard} is missing (the manifest lists {len(original)} bytes)" in line
    else:
        assert f"is damaged: {shard} has {len(original) // 2} bytes, the manifest says " \
               f"{len(original)} (truncated)" in line
    assert seconds < 5, seconds  # no server was started (that takes 20-50 s)
    shard.write_bytes(original)
    proc = run_train(train_args(run_dir, server_url, **{"train.steps": 2}))
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert (run_dir / "ckpt" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.slow
def test_missing_rng_state_resumes_with_one_warning(tmp_path, trained, server_url):  # noqa: F811
    """Item 6: a resume without a rank's RNG state (a changed world size) says so in one line."""
    run_dir = copy_run(trained, tmp_path / "run")
    rng = run_dir / "ckpt" / "step_00000001" / "rng"
    (rng / "rank_0.pt").unlink()
    proc = run_train(train_args(run_dir, server_url, **{"train.steps": 2}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("gspo-megatron: warning")]
    assert warnings == [f"gspo-megatron: warning: {rng} has no RNG state for rank(s) [0] (the "
                        "checkpoint was saved by 1 rank(s)); they continue with freshly seeded RNG"], \
        proc.stderr[-3000:]


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, capsys, trained, server_url):  # noqa: F811
    run_dir = copy_run(trained, tmp_path / "run")
    other = tiny_model_dir("qwen3_moe", 1)
    line = in_process_error(capsys, train_args(run_dir, server_url, **{"model.hf_path": str(other)}))
    assert f"checkpoint.dir='{run_dir / 'ckpt'}' holds a run of another model than " \
           f"model.hf_path='{other}' (model.safetensors differs (contents)); resume with that model, " \
           "or start over in a new checkpoint.dir" in line


@pytest.mark.slow
def test_stale_initial_conversion_of_another_model_is_redone(tmp_path, server_url):  # noqa: F811
    """Item 1: a run that fails after converting model A leaves CK/initial_megatron; a run of
    model B in the same checkpoint.dir converts B again and trains B (exported at lr=0: B's weights)."""
    from safetensors.torch import load_file
    ck = tmp_path / "ckpt"
    model_a, model_b = tiny_model_dir("qwen3_moe", 0), tiny_model_dir("qwen3_moe", 1)
    first = run_train(train_args(tmp_path, dead_url(), **{"model.hf_path": str(model_a),
                                                      "rollout.server_startup_timeout_s": 2}))
    assert "no healthy SGLang server" in _error_line(first, code=3)
    assert (ck / "initial_megatron" / "metadata.json").is_file()
    out = tmp_path / "exported"
    second = run_train(train_args(tmp_path, server_url, **{
        "model.hf_path": str(model_b), "train.lr": 0.0, "train.steps": 1, "train.warm_start_steps": 0,
        "checkpoint.export_hf": str(out)}))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"{ck / 'initial_megatron'} is not a conversion of {model_b}" in second.stdout
    want, got = load_file(str(model_b / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(want) == sorted(got)
    assert all((want[k] == got[k]).all() for k in want)


@pytest.mark.slow
def test_sigkill_during_initial_conversion_leaves_nothing_complete_and_rerun_converts(tmp_path):
    """A conversion killed half-way leaves only its temporary folder (.initial_megatron.tmp.gspo-tmp-PID,
    output_dirs.publish_dir); the rerun removes it, converts again, and its result equals the HF
    weights. (Both runs stop at the unreachable server, after converting.)"""
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from safetensors.torch import load_file
    from tools.make_tiny_model import make_tiny_model
    model = make_tiny_model("qwen3_moe", tmp_path / "model", seed=3, num_hidden_layers=8,
                            num_experts=16)  # ~400 tensors: a conversion that takes a moment
    args = train_args(tmp_path, dead_url(), **{"model.hf_path": str(model),
                                           "rollout.server_startup_timeout_s": 2})
    ck = tmp_path / "ckpt"
    proc = subprocess.Popen(train_cmd(1) + args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    tmp = ck / f".initial_megatron.tmp.gspo-tmp-{proc.pid}"
    while not (tmp.is_dir() and len(list(tmp.glob("*"))) > 3) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before its conversion was caught"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert tmp.is_dir() and not (ck / "initial_megatron").exists()
    rerun = run_train(args)
    assert "no healthy SGLang server" in _error_line(rerun, code=3)
    assert not tmp.exists() and (ck / "initial_megatron" / "source.json").is_file()
    assert not [p for p in ck.iterdir() if ".gspo-" in p.name or p.name.endswith(".tmp")]
    convert_megatron_to_hf(ck / "initial_megatron", tmp_path / "back")
    want, got = load_file(str(model / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(want) == sorted(got) and all((want[k] == got[k]).all() for k in want)


@pytest.mark.slow
def test_disk_full_during_checkpoint_save_is_one_line_and_resumes(tmp_path, small_disk, server_url):  # noqa: F811
    """Item 2: the second checkpoint does not fit: one line with the path and "no space left on
    device", nothing published (latest still names step 1); with more space the run resumes."""
    ck = small_disk / "ck"
    args = train_args(tmp_path, server_url, **{
        "checkpoint.dir": str(ck), "checkpoint.keep": 2, "train.steps": 2,
        "model.megatron_checkpoint": str(_initial_conversion(tmp_path)),
        "sync.dir": str(tmp_path / "sync")})
    proc = run_train(args)
    line = _error_line(proc, code=3)  # a runtime stop: the inputs passed
    assert f"saving checkpoint step_00000002 under {ck} failed: no space left on device (" in line
    assert "bytes needed (the previous checkpoint's size)" in line
    assert (ck / "latest").read_text().strip() == "step_00000001"
    assert not (ck / "step_00000002.tmp").exists() and not (ck / "step_00000002").exists()
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)
    proc = run_train(args)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert (ck / "latest").read_text().strip() == "step_00000002"


@pytest.mark.slow
def test_no_room_for_the_initial_conversion_stops_before_it(tmp_path, small_disk):
    """A model whose conversion and first checkpoint cannot fit (a 3 MiB tmpfs, a model of 64
    experts) is refused by the free-space check, before anything is converted or started."""
    from rollout.servers.launch import free_port
    model = _big_model(tmp_path)
    ck = small_disk / "ck"
    proc = run_train([CONFIG, "--set", f"model.hf_path={model}", "--set", f"checkpoint.dir={ck}",
                      "--set", f"logging.tensorboard_dir={tmp_path / 'tb'}",
                      "--set", f"rollout.server_urls=[http://127.0.0.1:{free_port()}]",
                      "--set", "rollout.server_startup_timeout_s=2"])
    line = _error_line(proc)
    assert f"checkpoint.dir='{ck}': 3.0 MiB free, the initial conversion and one checkpoint " \
           "(parameters + optimizer state, estimated from the model) (" in line, line
    # the weight sync's copies share the disk: both needs, added up
    assert "and the disk transport (2 copies of the model's weights) (" in line and "sync.dir) needs about " in line
    assert not ck.exists()


def test_disk_full_during_the_initial_conversion_is_one_line(tmp_path, small_disk):
    """The initial HF -> megatron conversion runs out of space (the disk filled after the start-up
    check, here by calling the conversion step directly): one line naming the folder, "no space
    left on device" and the bytes the weights need; nothing half-written stays."""
    model = _big_model(tmp_path)
    ck = small_disk / "ck"
    code = ("import sys; from gspo_megatron.config import load_config; "
            "from gspo_megatron.checkpoint.fingerprint import model_fingerprint; "
            "from gspo_megatron.run.model_files import initial_megatron_checkpoint; "
            f"cfg = load_config({CONFIG!r}, ['model.hf_path={model}', 'checkpoint.dir={ck}']); "
            "initial_megatron_checkpoint(cfg, 0, model_fingerprint(cfg.model.hf_path))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "CheckpointError" in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"converting model.hf_path='{model}' into {ck / 'initial_megatron'} failed: no space left " \
           "on device (" in line and "bytes needed: the model's weight files); free space and rerun" in line
    assert not list(ck.iterdir()), sorted(ck.iterdir())


def _big_model(tmp_path: Path) -> Path:
    model = tmp_path / "big"
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--arch", "qwen3_moe", "--out",
                    str(model), "--override", "num_experts=64", "--override", "num_hidden_layers=4"],
                   cwd=ROOT, env=env(), check=True, capture_output=True)
    return model


def _initial_conversion(tmp_path: Path) -> Path:
    out = tmp_path / "initial"
    subprocess.run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf",
                    str(tiny_model_dir("qwen3_moe", 0)), "--out", str(out)], cwd=ROOT, env=env(),
                   check=True, capture_output=True)
    return out


def test_missing_tokenizer_is_one_line_before_anything(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3_moe", 0), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
        (model / name).unlink(missing_ok=True)
    line = in_process_error(capsys, [CONFIG, "--set", f"model.hf_path={model}",
                                     "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert f"model.hf_path='{model}': no tokenizer there" in line
    assert not (tmp_path / "ck").exists()
