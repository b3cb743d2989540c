"""Metrics: real TensorBoard event files read back with tensorboard's own EventAccumulator."""
from __future__ import annotations

from gspo_megatron.run.metrics import (TAGS, MetricsWriter, format_progress, read_jsonl,
                                   read_scalars)


def test_event_files_round_trip(tmp_path):
    w = MetricsWriter(str(tmp_path / "tb"))
    for step in range(3):
        w.log(step, {"rollout/reward_mean": 0.1 * step, "train/clip_fraction": 0.5,
                     "time/rollout": 1.0 + step, "train/kl": float("nan")})
    w.close()
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [0, 1, 2]
    assert abs(scalars["rollout/reward_mean"][2][1] - 0.2) < 1e-6
    assert scalars["time/rollout"][1] == (1, 2.0)
    assert "train/kl" not in scalars  # non-finite values are not written to TensorBoard
    recs = read_jsonl(tmp_path / "tb" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2] and recs[1]["train/clip_fraction"] == 0.5


def test_resume_purges_steps_of_the_interrupted_run(tmp_path):
    w = MetricsWriter(str(tmp_path / "tb"))
    for step in range(4):
        w.log(step, {"rollout/reward_mean": float(step)})
    w.close()
    # resumed from a checkpoint after step 1: steps 2.. are re-done with other values
    w = MetricsWriter(str(tmp_path / "tb"), purge_step=2)
    for step in (2, 3):
        w.log(step, {"rollout/reward_mean": 10.0 + step})
    w.close()
    assert read_scalars(tmp_path / "tb")["rollout/reward_mean"] == [(0, 0.0), (1, 1.0), (2, 12.0),
                                                                   (3, 13.0)]
    recs = read_jsonl(tmp_path / "tb" / "metrics.jsonl")
    assert [(r["step"], r["rollout/reward_mean"]) for r in recs] == [(0, 0.0), (1, 1.0), (2, 12.0),
                                                                    (3, 13.0)]


def test_live_read_leaves_a_line_being_written(tmp_path):
    """Tests poll a running trainer's metrics.jsonl: a line caught half-written is left for the next
    read (live=True); a finished file with a broken line is an error, not silently shortened."""
    import json

    import pytest
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps({"step": s, "rollout/reward_mean": 0.5}) for s in range(2)]
    path.write_text("\n".join(whole) + "\n" + whole[0][:9])
    assert [r["step"] for r in read_jsonl(path, live=True)] == [0, 1]
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)
    path.write_text("\n".join(whole) + "\n")
    assert [r["step"] for r in read_jsonl(path, live=True)] == [0, 1] == [r["step"] for r in read_jsonl(path)]


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(str(tmp_path / "tb"), enabled=False)
    w.log(0, {"a/b": 1.0})
    w.close()
    assert not (tmp_path / "tb").exists()


def test_progress_line_and_tag_docs():
    line = format_progress(3, 10, {"rollout/reward_mean": 0.25, "time/rollout": 1.5, "rollout/reward_errors": 0.0})
    assert "step    3/10" in line and "reward 0.250 acc" in line and "rollout 1.5s" in line
    # a step whose rewards failed says how many, not just "reward 0.000" (a judge that is down)
    line = format_progress(4, 10, {"rollout/reward_mean": 0.0, "rollout/reward_errors": 8.0})
    assert "reward 0.000 (8 reward errors) acc" in line
    assert "(1 reward error) " in format_progress(5, 10, {"rollout/reward_mean": 0.5, "rollout/reward_errors": 1.0})
    assert all(t.count("/") == 1 and doc for t, doc in TAGS.items())


def test_per_layer_routing_histograms(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    from gspo_megatron.run.metrics import documented, per_layer_histograms
    layers = {f"routing_layers/drift_layer_{i}": v for i, v in enumerate([0.1, 0.3, 0.0, 0.2])}
    assert per_layer_histograms(layers) == {"routing_layers/drift": [0.1, 0.3, 0.0, 0.2]}
    assert documented("routing_layers/drift_layer_12") and not documented("routing_layers/x_layer_1")
    w = MetricsWriter(str(tmp_path / "tb"))
    w.log(0, {"routing/drift": 0.15, **layers})
    w.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"),
                                             size_guidance={event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    (event,) = acc.Histograms("routing_layers/drift")
    assert event.step == 0 and event.histogram_value.num == 4
    assert abs(event.histogram_value.sum - 0.6) < 1e-6 and event.histogram_value.max == 0.3
    assert read_scalars(tmp_path / "tb")["routing_layers/drift_layer_1"] == [(0, 0.30000001192092896)]
