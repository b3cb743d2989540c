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
])
def test_converter_wrong_paths_are_one_line(tmp_path, mcore, tool, args, needle):
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(tiny_model_dir("qwen3", 0)), str(model)], check=True)
    args = [a.format(tmp=tmp_path, mcore=mcore, model=model) for a in args]
    line = _one_line(_tool(tool, *args), tool)
    assert needle in line, line
    assert not (tmp_path / "o").exists()


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
