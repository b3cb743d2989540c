"""Exports never destroy or mix with what was there (gspo_megatron/checkpoint/output_dirs.py).

Before: `checkpoint.export_hf` at an existing folder deleted it (with export_hf = model.hf_path, the
input model), and tools/convert_megatron_to_hf.py into a non-empty folder exited 0 with old shards
and their index left beside the new model.safetensors (SGLang then loaded the old shards). Both
converters refused wrong paths with 22-28 line tracebacks. Now a target is refused in one line
unless it is new, empty or an earlier export (marked); an export is written beside the target and
renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures_models import tiny_model_dir
from gspo_megatron.checkpoint.output_dirs import (EXPORT_MARKER, OutputDirError, check_export_target,
                                                  publish_dir)
from test_trainer_e2e import ROOT, env

CONFIG = "examples/tiny_moe_larger_digit.yaml"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"tools/{name}.py", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and lines[-1].startswith(f"{prog}: error: "), proc.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def mcore(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "mcore"
    proc = _tool("convert_hf_to_megatron", "--hf", str(tiny_model_dir("qwen3_moe", 0)), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# --- the rules ---------------------------------------------------------------------------------
def test_target_rules(tmp_path):
    model, ck = tmp_path / "model", tmp_path / "ck"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rules = dict(protected={"model.hf_path": model}, may_hold={"checkpoint.dir": ck})
    for target, needle in [(model, "is model.hf_path"), (model / "sub", "is inside model.hf_path"),
                           (tmp_path, "contains model.hf_path"), (ck, "is checkpoint.dir")]:
        with pytest.raises(OutputDirError, match=needle):
            check_export_target("checkpoint.export_hf", target, **rules)
    check_export_target("checkpoint.export_hf", ck / "export", **rules)  # the run's folder may hold it
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="non-empty folder that gspo-megatron did not write"):
        check_export_target("checkpoint.export_hf", foreign)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputDirError, match="is a file, not a directory"):
        check_export_target("checkpoint.export_hf", tmp_path / "file")
    (tmp_path / "empty").mkdir()
    check_export_target("checkpoint.export_hf", tmp_path / "empty")


def test_a_failed_export_leaves_the_target_and_no_temporary_folder(tmp_path):
    target = publish_dir(tmp_path / "out", lambda d: (d / "a.txt").write_text("old"))
    before = _tree(target)

    def fail(d: Path) -> None:
        (d / "half.safetensors").write_text("x")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        publish_dir(target, fail)
    assert _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_leftovers_of_a_killed_publish_are_cleaned(tmp_path):
    dead = tmp_path / ".out.gspo-tmp-999999999"
    dead.mkdir()
    publish_dir(tmp_path / "out", lambda d: (d / "a.txt").write_text("new"))
    assert not dead.exists() and (tmp_path / "out" / EXPORT_MARKER).is_file()


# --- the converters ----------------------------------------------------------------------------
def test_export_over_an_earlier_sharded_export_replaces_it_whole(tmp_path, mcore):
    out = tmp_path / "hf"
    proc = _tool("convert_megatron_to_hf", "--megatron", str(mcore), "--out", str(out), "--max-shard-gb", "0.0005")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    proc = _tool("convert_megatron_to_hf", "--megatron", str(mcore), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["made_by"] == "gspo-megatron" and marker["source"] == str(mcore)
    original = load_file(str(tiny_model_dir("qwen3_moe", 0) / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert not [p for p in tmp_path.iterdir() if ".gspo-" in p.name]


def test_converter_into_a_foreign_folder_is_one_line_and_touches_nothing(tmp_path, mcore):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (busy / "model.safetensors.index.json").write_text("{}")
    before = _tree(busy)
    line = _one_line(_tool("convert_megatron_to_hf", "--megatron", str(mcore), "--out", str(busy)),
                     "convert_megatron_to_hf")
    assert f"--out='{busy}' is a non-empty folder that gspo-megatron did not write" in line
    assert _tree(busy) == before
    line = _one_line(_tool("convert_hf_to_megatron", "--hf", str(tiny_model_dir("qwen3", 0)), "--out", str(busy)),
                     "convert_hf_to_megatron")
    assert "is a non-empty folder that gspo-megatron did not write" in line and _tree(busy) == before


@pytest.mark.parametrize("tool,args,needle", [
    ("convert_megatron_to_hf", ["--megatron", "/nonexistent/ck", "--out", "{tmp}/o"],
     "/nonexistent/ck is not a megatron dist_checkpointing checkpoint"),
    ("convert_hf_to_megatron", ["--hf", "/nonexistent/model", "--out", "{tmp}/o"], "/nonexistent/model"),
    ("convert_megatron_to_hf", ["--megatron", "{mcore}", "--out", "{mcore}/hf"], "is inside the checkpoint"),
    ("convert_hf_to_megatron", ["--hf", "{model}", "--out", "{model}"], "is the HF model"),
    # a file for the folder; a folder of the kernel's (creating a file there says "No such file")
    ("convert_hf_to_megatron", ["--hf", "{model}/config.json", "--out", "{tmp}/o"],
     "--hf='{model}/config.json' is a file, not a folder: give the Hugging Face model folder"),
    ("convert_hf_to_megatron", ["--hf", "{model}", "--out", "/proc/o"],
     "--out='/proc/o' cannot be written: /proc is on the kernel's proc file system"),
    ("convert_megatron_to_hf", ["--megatron", "{mcore}/metadata.json", "--out", "{tmp}/o"],
     "{mcore}/metadata.json is a file, not a folder"),
])
def test_converter_wrong_paths_are_one_line(tmp_path, mcore, tool, args, needle):
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(tiny_model_dir("qwen3", 0)), str(model)], check=True)
    args = [a.format(tmp=tmp_path, mcore=mcore, model=model) for a in args]
    line = _one_line(_tool(tool, *args), tool)
    assert needle.format(tmp=tmp_path, mcore=mcore, model=model) in line, line
    assert not (tmp_path / "o").exists()


def _in_process(capsys, tool: str, *args: str) -> str:
    """The converter's main() in this process (the refusals come before any conversion): exit 2
    and one line `TOOL: error: ...`, returned."""
    import importlib
    assert importlib.import_module(f"tools.{tool}").main(list(args)) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), err[-3000:]
    return lines[0]


def _training_step(mcore: Path, root: Path) -> Path:
    """A run's checkpoint.dir with one step whose model/ is `mcore`, its MANIFEST.json and `latest`,
    as checkpoint/manager.py writes them."""
    from gspo_megatron.checkpoint.manager import write_manifest
    step = root / "step_00000001"
    shutil.copytree(mcore, step / "model")
    write_manifest(step)
    (root / "latest").write_text("step_00000001\n")
    return step


def test_a_damaged_or_misnamed_checkpoint_is_one_line_naming_the_file(tmp_path, mcore, capsys):
    """Before: no common.pt was a 50-line traceback ending in "'str' object has no attribute
    'iterdir'"; a missing or truncated shard a per-rank traceback naming no file; a training
    checkpoint's step folder "not a checkpoint" without where its model is. Now one line each,
    before anything is written: the file, and what the manifest or torch's .metadata index says."""
    tool = "convert_megatron_to_hf"

    def damaged(name: str, damage) -> Path:
        ck = tmp_path / name
        shutil.copytree(mcore, ck)
        damage(ck)
        return ck

    ck = damaged("no_common", lambda d: (d / "common.pt").unlink())
    line = _in_process(capsys, tool, "--megatron", str(ck), "--out", str(tmp_path / "o"))
    assert f"checkpoint {ck} is incomplete: {ck / 'common.pt'} (megatron's common state" in line, line
    ck = damaged("no_index", lambda d: (d / ".metadata").unlink())
    assert f"{ck / '.metadata'} (torch's index of the shards" in _in_process(
        capsys, tool, "--megatron", str(ck), "--out", str(tmp_path / "o"))
    shard = "__0_5.distcp"
    size = (mcore / shard).stat().st_size
    ck = damaged("missing", lambda d: (d / shard).unlink())
    line = _in_process(capsys, tool, "--megatron", str(ck), "--out", str(tmp_path / "o"))
    assert line.endswith(f"checkpoint {ck} is damaged: {ck / shard} is missing ({ck / '.metadata'} "
                         f"places data up to byte {size})"), line
    ck = damaged("truncated", lambda d: os.truncate(d / shard, 10))
    line = _in_process(capsys, tool, "--megatron", str(ck), "--out", str(tmp_path / "o"))
    assert f"{ck / shard} is truncated (10 bytes; {ck / '.metadata'} places data up to byte {size})" in line
    # a training checkpoint: its step folder and its checkpoint.dir point at the model; the
    # manifest's sizes name a shard cut short
    step = _training_step(mcore, tmp_path / "ck")
    line = _in_process(capsys, tool, "--megatron", str(step), "--out", str(tmp_path / "o"))
    assert line.endswith(f"{step} is not a megatron dist_checkpointing checkpoint (no metadata.json); this is "
                         f"a training checkpoint's step folder: its model is {step / 'model'}"), line
    line = _in_process(capsys, tool, "--megatron", str(tmp_path / "ck"), "--out", str(tmp_path / "o"))
    assert line.endswith(f"this is a run's checkpoint.dir: the model of its latest step is {step / 'model'}")
    os.truncate(step / "model" / shard, size - 1)
    line = _in_process(capsys, tool, "--megatron", str(step / "model"), "--out", str(tmp_path / "o"))
    assert line.endswith(f"{step / 'model' / shard} is truncated ({size - 1} bytes; "
                         f"{step / 'MANIFEST.json'} says {size} bytes)"), line
    assert not (tmp_path / "o").exists()


def test_converters_print_no_warnings_and_answer_help_in_under_a_second(tmp_path, mcore):
    """Before: 12-17 Transformer Engine / Apex / FutureWarning lines on every run on a CPU, and
    --help took 3-9 s (torch and megatron-core imported first). Now the trainer's silenced
    warnings (run/expected_warnings.py) are silenced here too: a conversion prints its progress
    bar and the output folder, nothing else; --help imports neither."""
    proc = _tool("convert_megatron_to_hf", "--megatron", str(mcore), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "hf"), proc.stderr[-3000:]
    others = [ln for ln in proc.stderr.replace("\r", "\n").splitlines()
              if ln.strip() and not ln.startswith("exporting to HF:")]
    assert not others, others
    proc = _tool("convert_hf_to_megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    others = [ln for ln in proc.stderr.replace("\r", "\n").splitlines()
              if ln.strip() and not ln.startswith("writing megatron checkpoint:")]
    assert not others, others
    for tool in ("convert_hf_to_megatron", "convert_megatron_to_hf"):
        code = (f"import sys, time; sys.argv = ['{tool}', '--help']; t = time.perf_counter()\n"
                f"try:\n    import runpy; runpy.run_path('tools/{tool}.py', run_name='__main__')\n"
                "except SystemExit:\n    pass\n"
                "print('SECONDS', time.perf_counter() - t, 'torch' in sys.modules, file=sys.stderr)")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=60)
        _, seconds, torch_loaded = proc.stderr.split()
        assert "--dtype {bfloat16,float16,float32}" in proc.stdout and torch_loaded == "False", proc.stderr
        assert float(seconds) < 1.0, (tool, seconds)


def test_the_converters_dtype_names_are_the_libraries():
    from gspo_megatron.checkpoint.hf_files import DTYPES
    from tools.convert_hf_to_megatron import DTYPE_NAMES as to_megatron
    from tools.convert_megatron_to_hf import DTYPE_NAMES as to_hf
    assert set(to_megatron) == set(to_hf) == set(DTYPES)


# --- the trainer's export_hf: refused at start, before anything runs ----------------------------
@pytest.mark.parametrize("where", ["foreign", "model", "inside_model"])
def test_export_hf_that_would_destroy_is_refused_at_start(tmp_path, capsys, where):
    from gspo_megatron.cli import main
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(tiny_model_dir("qwen3_moe", 0)), str(model)], check=True)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("precious")
    target = {"foreign": foreign, "model": model, "inside_model": model / "export"}[where]
    before = {p: _tree(p) for p in (model, foreign)}
    assert main(["train", CONFIG, "--set", f"model.hf_path={model}", "--set",
                 f"checkpoint.dir={tmp_path / 'ck'}", "--set", f"logging.tensorboard_dir={tmp_path / 'tb'}",
                 "--set", f"checkpoint.export_hf={target}"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo-megatron: error")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"checkpoint.export_hf='{target}'" in lines[0]
    assert {p: _tree(p) for p in (model, foreign)} == before
    assert not (tmp_path / "ck").exists() and not (tmp_path / "tb").exists()
