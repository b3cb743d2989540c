"""PEFT export and import (gspo_megatron/lora/peft.py) on the tiny Qwen3-MoE's weight map: names,
shapes, the round trip bit for bit for both expert layouts, and the refusals."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.lora.lora_settings import LoraSettings
from gspo_megatron.lora.peft import (PREFIX, PeftError, from_peft, load_peft, peft_config, save_peft,
                                     to_peft)
from model_specs.hf.tiny import qwen3_moe
from model_specs.weights.maps import weight_map_for

R = 4


def adapters(experts: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One-process adapter tensors of the tiny Qwen3-MoE (4 layers, 4 experts, hidden 64, 4/2
    heads of 16, experts' ffn 32), shaped as actor/weights/adapter_state.py gathers them."""
    g = torch.Generator().manual_seed(seed)
    out, outer = {}, 1 if experts == "shared_outer" else 4
    for layer in range(4):
        p = f"decoder.layers.{layer}"
        shapes = {f"{p}.self_attention.linear_qkv.lora.a": (R, 64),
                  f"{p}.self_attention.linear_qkv.lora.b": (128, R),
                  f"{p}.self_attention.linear_proj.lora.a": (R, 64),
                  f"{p}.self_attention.linear_proj.lora.b": (64, R),
                  f"{p}.mlp.experts.lora.fc1_a": (outer, R, 64), f"{p}.mlp.experts.lora.fc1_b": (4, 64, R),
                  f"{p}.mlp.experts.lora.fc2_a": (4, R, 32), f"{p}.mlp.experts.lora.fc2_b": (outer, 64, R)}
        out.update({k: torch.randn(s, generator=g) for k, s in shapes.items()})
    return out


@pytest.mark.parametrize("experts", ["per_expert", "shared_outer"])
def test_round_trip_is_bit_exact(experts, tmp_path):
    wmap = weight_map_for(qwen3_moe())
    settings = LoraSettings(rank=R, alpha=8, experts=experts)
    full = adapters(experts)
    tensors = to_peft(full, wmap)
    q = f"{PREFIX}model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (R, 64) and tensors[f"{q}.lora_B.weight"].shape == (64, R)
    assert torch.equal(tensors[f"{q}.lora_A.weight"], tensors[q.replace("q_proj", "v_proj") + ".lora_A.weight"])
    if experts == "per_expert":
        assert tensors[f"{PREFIX}model.layers.1.mlp.experts.3.gate_proj.lora_B.weight"].shape == (32, R)
        assert len(tensors) == 4 * (4 + 4 * 3) * 2
    else:
        e = f"{PREFIX}model.layers.1.mlp.experts"
        assert tensors[f"{e}.gate_proj.lora_A.weight"].shape == (1, R, 64)
        assert tensors[f"{e}.up_proj.lora_B.weight"].shape == (4, 32, R)
        assert tensors[f"{e}.down_proj.lora_B.weight"].shape == (1, 64, R)
        assert not any(".experts.0." in k for k in tensors)
    config = peft_config(settings, tensors)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    back = from_peft(*load_peft(save_peft(tmp_path / "adapter", tensors, config)), wmap, full, settings)
    assert list(back) == list(full) and all(torch.equal(back[k], full[k]) for k in full)


def test_refusals_name_the_tensor(tmp_path):
    wmap = weight_map_for(qwen3_moe())
    settings = LoraSettings(rank=R, alpha=8)
    full = adapters("per_expert")
    tensors = to_peft(full, wmap)
    config = peft_config(settings, tensors)
    k = f"{PREFIX}model.layers.2.self_attn.k_proj.lora_A.weight"
    with pytest.raises(PeftError, match="share one A"):
        from_peft({**tensors, k: tensors[k] + 1}, config, wmap, full, settings)
    with pytest.raises(PeftError, match="lora_B.weight is missing"):
        from_peft({n: t for n, t in tensors.items() if "layers.3.mlp.experts.2.up_proj.lora_B" not in n},
                  config, wmap, full, settings)
    with pytest.raises(PeftError, match="r=4 lora_alpha=8, but the run's lora.rank=8"):
        from_peft(tensors, config, wmap, full, LoraSettings(rank=8))
    with pytest.raises(PeftError, match="adapt layers this run does not"):
        from_peft({**tensors, f"{PREFIX}model.layers.0.mlp.gate.lora_A.weight": torch.zeros(R, 64)},
                  config, wmap, full, settings)
    with pytest.raises(PeftError, match="other layout than lora.experts=per_expert"):
        from_peft(to_peft(adapters("shared_outer"), wmap), config, wmap, full, settings)
    with pytest.raises(PeftError, match="no adapter_config.json"):
        load_peft(tmp_path)


@pytest.mark.parametrize("experts", ["per_expert", "shared_outer"])
def test_fused_form_sends_each_a_once(experts):
    """What the sync sends: q/k/v and gate/up as SGLang's stacked modules, A once, B's rows in the
    parts' order; as many elements as the trainer's adapters."""
    wmap = weight_map_for(qwen3_moe())
    full = adapters(experts)
    plain, fused = to_peft(full, wmap), to_peft(full, wmap, fused=True)
    assert sum(t.numel() for t in fused.values()) == sum(t.numel() for t in full.values())
    assert sum(t.numel() for t in plain.values()) > sum(t.numel() for t in fused.values())
    q = f"{PREFIX}model.layers.1.self_attn"
    assert torch.equal(fused[f"{q}.qkv_proj.lora_A.weight"], plain[f"{q}.q_proj.lora_A.weight"])
    assert torch.equal(fused[f"{q}.qkv_proj.lora_B.weight"],
                       torch.cat([plain[f"{q}.{p}_proj.lora_B.weight"] for p in "qkv"]))
    e = f"{PREFIX}model.layers.1.mlp.experts" + (".2" if experts == "per_expert" else "")
    assert torch.equal(fused[f"{e}.gate_up_proj.lora_B.weight"],
                       torch.cat([plain[f"{e}.gate_proj.lora_B.weight"], plain[f"{e}.up_proj.lora_B.weight"]], dim=-2))
    assert f"{e}.down_proj.lora_A.weight" in fused and not any("gate_proj" in k for k in fused)
