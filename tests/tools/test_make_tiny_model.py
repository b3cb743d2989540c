"""tools/make_tiny_model.py: offline, deterministic, loadable by transformers, the promised shapes."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from fixtures_models import tiny_model_dir
from tools.make_tiny_model import ARCHS, VOCAB_SIZE, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model("qwen3_moe", tmp_path / "a", seed=3)
    b = make_tiny_model("qwen3_moe", tmp_path / "b", seed=3)
    c = make_tiny_model("qwen3_moe", tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]
    assert _digest(a)["tokenizer.json"] == _digest(c)["tokenizer.json"]


def test_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model("qwen3", tmp_path, seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_runs(arch):
    path = tiny_model_dir(arch, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert next(model.parameters()).dtype == torch.float32
    layers = 4 if arch == "qwen3_next" else 2  # three DeltaNet layers, then full attention
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (VOCAB_SIZE, 64, layers)
    if arch == "deepseek_v3":  # multi-latent attention: a key and value per head, YaRN x4 over 8
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 4)
        assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                cfg.v_head_dim) == (24, 32, 12, 8, 16)
        assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.max_position_embeddings == 32
        assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0  # drawn
    elif arch == "gpt_oss":  # sinks, a window of 8, YaRN x4 over 8, every bias drawn
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.sliding_window) == (4, 2, 8)
        assert cfg.layer_types == ["sliding_attention", "full_attention"]
        assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.max_position_embeddings == 32
        assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.swiglu_limit) == (8, 4, 0.5)
        assert model.model.layers[0].self_attn.sinks.abs().max() > 0.1
        assert model.model.layers[0].mlp.experts.down_proj_bias.abs().max() > 0
    else:
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
        assert cfg.max_position_embeddings >= 2048
    if arch == "qwen3_next":
        assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert model.model.layers[3].self_attn.q_norm.weight.abs().max() > 0  # drawn (0 at init)
        assert model.model.layers[0].linear_attn.in_proj_qkvz.weight.shape == (192, 64)
    elif arch.startswith("qwen3"):
        assert model.model.layers[0].self_attn.q_norm is not None  # QK-norm
    if arch == "qwen3_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
        assert cfg.norm_topk_prob
    if arch == "qwen2_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
        assert cfg.shared_expert_intermediate_size == 64 and not cfg.norm_topk_prob
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if arch == "glm4_moe":
        assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (8, 2)
        assert (cfg.n_group, cfg.topk_group) == (2, 1)
        assert cfg.first_k_dense_replace == 1 and cfg.routed_scaling_factor == 2.5
        assert model.model.layers[0].self_attn.q_norm is not None  # use_qk_norm
        assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0  # drawn
    logits = model(torch.tensor([[1, 5, 300, 511]])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_tokenizer_chat_template_and_eos():
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir("qwen3", seed=0))
    assert len(tok) == VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    # byte-level: any text round-trips
    s = "Grüße 12 + 7 = 19 \\boxed{x} 😀"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_tied_embeddings_and_overrides(tmp_path):
    path = make_tiny_model("qwen3", tmp_path, seed=0, tie_word_embeddings=True, num_hidden_layers=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 3
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_new_archs_are_deterministic(tmp_path):
    for arch in ("qwen2_moe", "glm4_moe", "deepseek_v3"):
        a = make_tiny_model(arch, tmp_path / f"{arch}-a", seed=7)
        b = make_tiny_model(arch, tmp_path / f"{arch}-b", seed=7)
        assert _digest(a) == _digest(b), arch


def test_cli(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "qwen2",
                          "--out", str(tmp_path / "m"), "--seed", "2", "--override", "num_hidden_layers=1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 1
