"""The planner's weight-sync columns (gspo_megatron/planner/sync_time.py), on tiny-qwen3-moe where
every count is done by hand:

    h 64, vocab 512, 4 layers, 4 heads of 16 (2 KV heads), 4 experts of ffn 32 (gated), untied.
    a layer's dense parameters: qkv 64 x (64 + 2 x 32) + proj 64 x 64 + q/k norms 2 x 16
                                + 2 norms of 64 + router 4 x 64                     = 12704
    one expert: 3 x 64 x 32                                                        = 6144
    embedding = output layer = 512 x 64 = 32768; final norm 64

PP2 x EP2: 4 senders. Stage 1 (layers 2, 3, the output layer and the final norm) holds the most:
2 x 12704 + 32768 + 64 = 58240 dense, and on each EP rank 2 layers x 2 experts x 6144 = 24576.
The whole model: 4 x 12704 + 2 x 32768 + 64 + 4 x 4 x 6144 = 214720 parameters.
"""
from __future__ import annotations

import argparse

import pytest

LARGEST = 58240 + 24576
TOTAL = 4 * 12704 + 2 * 32768 + 64 + 4 * 4 * 6144


def _shape(**hf_overrides):
    from model_specs.shape import model_shape_for
    from model_specs.hf.tiny import qwen3_moe
    return model_shape_for({**qwen3_moe(), **hf_overrides})


@pytest.mark.parametrize("tensor, world", [(1, 4), (2, 8)])  # TP is gathered before sending
def test_senders_and_bytes_of_pp2_ep2_by_hand(tensor, world):
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.sync_time import SyncSettings, sync_time
    layout = ParallelLayout(tensor=tensor, pipeline=2, expert=2, expert_tensor=1)
    rate = 1000.0  # bytes/s: --sync-gbps 1e-6
    est = sync_time(_shape(), layout, world, SyncSettings(gbps=rate / 1e9, server_gpus=4))
    assert est.senders == 4
    assert est.sender_bytes == 2 * LARGEST and est.total_bytes == 2 * TOTAL
    # The busiest sender bounds it: 165632 B / 1000 B/s, more than 429440 B / (4 x 1000 B/s).
    assert est.sync_s == pytest.approx(2 * LARGEST / rate)
    assert est.rank0_s == pytest.approx(2 * TOTAL / rate)
    # 5% changed: 0.05 x 2 B + min(0.05 x 4 B, 1/8 B) = 0.225 B per element, 0.1125 of a full sync.
    assert est.delta_s == pytest.approx(est.sync_s * 0.1125)
    # One server GPU ingests everything: its bound, 429440 B / 1000 B/s, is the larger.
    one = sync_time(_shape(), layout, world, SyncSettings(gbps=rate / 1e9, server_gpus=1))
    assert one.sync_s == pytest.approx(2 * TOTAL / rate) == pytest.approx(one.rank0_s)


def test_defaults_server_gpus_to_the_world_and_leave_out_a_tied_output_copy():
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.sync_time import SyncSettings, sync_time
    layout = ParallelLayout(pipeline=4, expert=1)
    est = sync_time(_shape(), layout, 4, SyncSettings(gbps=1e-6))
    # PP4 x EP1: 4 senders; stage 3 holds layer 3, the output layer, the final norm and 4 experts.
    assert est.senders == 4 and est.sender_bytes == 2 * (12704 + 32768 + 64 + 4 * 6144)
    assert est.sync_s == pytest.approx(max(est.sender_bytes, 2 * TOTAL / 4) / 1000)
    tied = sync_time(_shape(tie_word_embeddings=True), layout, 4, SyncSettings(gbps=1e-6))
    assert tied.total_bytes == 2 * (TOTAL - 32768)


def test_delta_bytes_per_element():
    from gspo_megatron.planner.sync_time import delta_bytes_per_element as per
    assert per(0.0) == 0.0
    assert per(0.01) == pytest.approx(0.01 * 2 + 0.04)     # indices, cheaper than the bitmask
    assert per(0.05) == pytest.approx(0.05 * 2 + 0.125)    # the bitmask, past 1 in 32
    assert per(1.0) == 2.0                                 # never more than the whole tensor


def test_total_is_the_published_parameter_count():
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.planner.plan import load_model
    from gspo_megatron.planner.sync_time import SyncSettings, sync_time
    from model_specs.param_count import param_count
    from model_specs.shape import model_shape_for
    spec = model_shape_for(load_model("Qwen3-235B-A22B"))
    layout = ParallelLayout(tensor=4, pipeline=8, expert=8, expert_tensor=1, first_stage_layers=11,
                            last_stage_layers=11)
    est = sync_time(spec, layout, 64, SyncSettings())
    assert est.total_bytes == 2 * param_count(spec).total
    assert est.senders == 64


def _args(*argv: str) -> argparse.Namespace:
    from gspo_megatron.planner.arguments import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["config.yaml", "--gpus", "16", *argv])


def test_sync_flags_parse_and_default():
    from gspo_megatron.planner.command import sync_settings
    from gspo_megatron.planner.sync_time import SyncSettings
    assert sync_settings(_args()) == SyncSettings(gbps=25.0, server_gpus=16, changed=0.05)
    got = sync_settings(_args("--sync-gbps", "50", "--server-gpus", "8", "--sync-changed", "0.002"))
    assert got == SyncSettings(gbps=50.0, server_gpus=8, changed=0.002)
    from gspo_megatron.planner.plan import PlanError
    for bad, message in ((("--sync-gbps", "0"), "--sync-gbps 0: expected GB/s > 0"),
                         (("--server-gpus", "0"), "--server-gpus 0: expected >= 1"),
                         (("--sync-changed", "1.5"), "--sync-changed 1.5: expected a fraction")):
        with pytest.raises(PlanError, match=message):
            sync_settings(_args(*bad))


def test_table_shows_the_sync_columns_before_the_verdict():
    from gspo_megatron.planner.memory import GiB, MemorySettings
    from gspo_megatron.planner.plan import GPUS, plan, table
    from gspo_megatron.planner.sync_time import SyncSettings
    from model_specs.hf.tiny import qwen3_moe
    s = MemorySettings(max_tokens=1024)
    rows, _ = plan(qwen3_moe(), 4, GPUS["h100"], 80 * GiB, 4, s, step_tokens=4096, mean_len=256,
                   fixed=dict(tensor=1, pipeline=2, expert=2), sync=SyncSettings(gbps=1e-6, server_gpus=4))
    out = table(rows, 80 * GiB, s, show_all=True, top=10).splitlines()
    head = [c.strip() for c in out[0].split("|")[1:-1]]
    assert head[-5:] == ["senders", "sync s", "delta s", "rank0 s", "verdict"]
    body = [[c.strip() for c in line.split("|")[1:-1]] for line in out[2:]]
    assert {r[0] for r in body} == {"TP1xPP2xEP2xETP1xDP2", "TP1xPP2xVPP2xEP2xETP1xDP2"}
    for row in body:  # with VPP2 each stage still holds two layers
        assert len(row) == len(head)
        assert row[-5:-1] == ["4", f"{2 * LARGEST / 1000:.2f}", f"{2 * LARGEST / 1000 * 0.1125:.3f}",
                              f"{2 * TOTAL / 1000:.1f}"]
