"""The weight sync's report means the same on every transport (weight_sync.Totals): bytes are what
every server gets, changed_fraction is measured on a delta pass and 1 on a whole one (a disk sync
or a first sync read 0 before, rank 0's path 1), and a repair pass leaves it as its sync's first
pass measured it."""
from __future__ import annotations

from gspo_megatron.sync.sender_pass import Outcome, PassPlan
from gspo_megatron.sync.transport_base import Sender
from gspo_megatron.sync.weight_sync import Totals


def _plan(targets: dict[str, str]) -> PassPlan:
    return PassPlan("v1", targets, check_all=True, dtype="bfloat16", keep_base=True, sender=Sender())


def test_a_whole_sync_reads_1_whatever_its_sender_measured():
    totals = Totals()
    outcomes = [Outcome(0, sent_bytes=200, elements=100, changed=0), Outcome(1, sent_bytes=600, elements=300)]
    totals.add(_plan({"http://a": "full", "http://b": "full"}), outcomes, first=True)
    report = totals.report(seconds=2.0, attempts=1)
    assert report["changed_fraction"] == 1.0 and report["full_syncs"] == 2.0
    assert report["bytes"] == 800.0 and report["rank0_bytes"] == 200.0 and report["senders"] == 2.0


def test_a_delta_sync_reads_what_changed_and_a_repair_keeps_it():
    totals = Totals()
    totals.add(_plan({"http://a": "delta", "http://b": "delta"}),
               [Outcome(0, sent_bytes=10, elements=100, changed=4, mismatched={"http://b": ["w"]}),
                Outcome(1, sent_bytes=30, elements=300, changed=12)], first=True)
    totals.add(_plan({"http://b": "full"}), [Outcome(0, sent_bytes=100, elements=100),
                                              Outcome(1, sent_bytes=300, elements=300)], first=False)
    report = totals.report(seconds=1.0, attempts=2)
    assert report["changed_fraction"] == 16 / 400 and report["full_syncs"] == 1.0
    assert report["bytes"] == 440.0 and report["checksum_mismatches"] == 1.0 and report["attempts"] == 2.0
