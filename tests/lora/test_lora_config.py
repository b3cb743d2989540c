"""The `lora:` section in the run config (its refusals across sections), `migrate` carrying the
peers' LoRA keys, and the launch flags a LoRA run's servers get; torch-free."""
from __future__ import annotations

from pathlib import Path

import pytest

from gspo_megatron.config import ConfigError, config_from_dict
from gspo_megatron.config.peers import migrate
from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.lora.serving import server_args

BASE = {"model": {"hf_path": "m"}, "rollout": {"prompts": "p.jsonl"}}


def cfg(**sections):
    return config_from_dict({**BASE, **sections})


def test_the_section_and_its_refusals():
    c = cfg(lora={"rank": 8, "alpha": 16, "experts": "shared_outer"})
    assert c.lora.enabled and c.lora.scale == 2.0 and c.lora.expert_targets() == ("linear_fc1", "linear_fc2")
    assert not cfg().lora.enabled
    with pytest.raises(ConfigError, match=r"parallel.expert_tensor=None: expected 1 with lora.experts=per_expert"):
        cfg(lora={"rank": 8}, parallel={"tensor": 2})
    assert cfg(lora={"rank": 8}, parallel={"tensor": 2, "expert_tensor": 1}).parallel.etp == 1
    assert cfg(lora={"rank": 8, "experts": "none"}, parallel={"tensor": 2}).lora.expert_targets() == ()
    with pytest.raises(ConfigError, match="sync.delta=True: expected null or false with lora.rank=8"):
        cfg(lora={"rank": 8}, sync={"delta": True})
    with pytest.raises(ConfigError, match="lora.export_peft='out': expected null with lora.rank=0"):
        cfg(lora={"export_peft": "out"})
    with pytest.raises(ConfigError, match=r"lora.targets=\['router'\]: adapters on the router"):
        cfg(lora={"rank": 8, "targets": ["router"]})


@pytest.mark.parametrize("peer,text,rank,alpha,targets,says", [
    ("verl", "actor_rollout_ref:\n  model:\n    lora_rank: 32\n    lora_alpha: 64\n    target_modules: all-linear\n",
     32, 64.0, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "every linear layer"),
    ("roll", "actor_train:\n  model_args:\n    lora_rank: 16\n    lora_alpha: 32\n    lora_target: q_proj,v_proj,lm_head\n",
     16, 32.0, ["linear_qkv"], "linear_qkv adapts q_proj, k_proj, v_proj together; not offered: lm_head"),
    ("verl", "actor_rollout_ref:\n  model:\n    lora_rank: 0\n    target_modules: all-linear\n",
     0, None, None, "target_modules = 'all-linear': acts only with a LoRA rank > 0"),
])
def test_migrate_carries_the_peers_lora_keys(tmp_path: Path, peer, text, rank, alpha, targets, says):
    path = tmp_path / "peer.yaml"
    path.write_text(text)
    m = migrate(peer, path, [])
    assert says in m.report()
    lora = m.nested().get("lora", {})
    assert lora.get("rank", 0) == rank and lora.get("alpha") == alpha and lora.get("targets") == targets


def test_the_servers_flags():
    cpu = server_args(LoraSettings(rank=16, targets=["linear_qkv", "linear_fc2"]), cuda=False)
    assert cpu == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "k_proj",
                   "v_proj", "down_proj", "--max-loras-per-batch", "2", "--lora-backend", "torch_native"]
    gpu = server_args(LoraSettings(rank=8, experts="shared_outer"), cuda=True)
    assert gpu[-5:] == ["--lora-backend", "triton_v2", "--moe-runner-backend", "lora_triton",
                        "--experts-shared-outer-loras"]
    assert "--lora-backend" not in server_args(LoraSettings(rank=8, experts="none"), cuda=True)
