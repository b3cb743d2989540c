"""tools/run_summary.py, the main job's closing lines: the folders of the config the run took (its
--set overrides included), as the user wrote them; a config without an HF export says so instead
of naming a folder that does not exist (the ROLL, verl and slime examples)."""
from __future__ import annotations

from pathlib import Path

from tools.run_summary import summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_peers_examples_name_no_export_and_paths_stay_relative(tmp_path, monkeypatch):
    from gspo_megatron.run.metrics import MetricsWriter
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter("runs/tiny_moe_roll_gspo/tensorboard")
    for step, (reward, acc) in enumerate([(0.1, 0.3), (0.5, None), (0.9, 0.8)]):
        writer.log(step, {"rollout/reward_mean": reward, **({"eval/accuracy": acc} if acc is not None else {})})
    writer.close()
    lines = summary(str(ROOT / "examples" / "tiny_moe_roll_gspo.yaml"), [])
    assert lines == [
        "[main_job] reward: step 0 0.100 -> step 2 0.900 (best 0.900, last 3 steps' mean 0.500)",
        "[main_job] held-out accuracy (greedy): step 0 0.300 -> step 2 0.800",
        f"[main_job] no HF export: checkpoint.export_hf is not set in {ROOT / 'examples' / 'tiny_moe_roll_gspo.yaml'} "
        "(--set checkpoint.export_hf=DIR for one; tools/convert_megatron_to_hf.py converts a checkpoint)",
        "[main_job] watch it: .venv/bin/tensorboard --logdir runs/tiny_moe_roll_gspo/tensorboard"]
    assert not any(str(tmp_path) in line for line in lines)


def test_the_export_and_the_overrides_of_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "examples" / "tiny_moe_larger_digit.yaml")
    sets = ["--set", "checkpoint.export_hf=out/hf", "--set", "logging.tensorboard_dir=out/tb"]
    assert summary(config, ["checkpoint.export_hf=out/hf", "logging.tensorboard_dir=out/tb"])[-2:] == [
        "[main_job] no final policy at out/hf (checkpoint.export_hf): the run did not finish",
        "[main_job] watch it: .venv/bin/tensorboard --logdir out/tb"]
    (tmp_path / "out" / "hf").mkdir(parents=True)
    (tmp_path / "out" / "hf" / "config.json").write_text("{}")
    from tools.run_summary import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([config, *sets, "--set", "train.steps=3"]) == 0
    assert "[main_job] final policy (HF format): out/hf\n" in buf.getvalue()
