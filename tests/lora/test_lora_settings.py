"""LoraSettings: the refusals of the `lora:` section and what it derives (torch-free)."""
from __future__ import annotations

import pytest

from gspo_megatron.lora.lora_settings import TARGETS, LoraSettings


@pytest.mark.parametrize("kwargs,says", [
    (dict(rank=-1), "rank=-1: expected an integer >= 0"),
    (dict(rank=True), "rank=True"),
    (dict(rank=8, alpha=0), "alpha=0: expected > 0"),
    (dict(rank=8, lr=0.0), "lr=0.0: expected > 0"),
    (dict(rank=8, experts="all"), "experts='all': expected one of none, per_expert, shared_outer"),
    (dict(rank=8, targets=["linear_qkv", "router"]), "adapters on the router (router) are refused"),
    (dict(rank=8, targets=["mlp.gate"]), "adapters on the router (mlp.gate) are refused"),
    (dict(rank=8, targets=["q_proj"]), "'q_proj' is not a target"),
    (dict(rank=8, targets=["linear_qkv", "linear_qkv"]), "named twice"),
    (dict(rank=8, targets=[]), "targets=[] with rank=8"),
])
def test_refusals_name_the_field_and_what_is_expected(kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        LoraSettings(**kwargs)


def test_what_it_derives():
    off = LoraSettings()
    assert not off.enabled and off.describe() == "LoRA off (every weight trains)"
    on = LoraSettings(rank=8, alpha=32, targets=["linear_qkv", "linear_fc2"], experts="shared_outer")
    assert on.enabled and on.scale == 4.0 and on.expert_targets() == ("linear_fc2",)
    assert LoraSettings(rank=8).scale == 1.0 and LoraSettings(rank=8).targets == list(TARGETS)
    assert LoraSettings(rank=8, experts="none").expert_targets() == ()
    assert "rank 8 alpha 32" in on.describe() and "shared_outer" in on.describe()
