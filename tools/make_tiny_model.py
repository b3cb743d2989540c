"""Make a tiny, randomly initialised Hugging Face model + tokenizer, offline and deterministic.

    python tools/make_tiny_model.py --arch qwen3_moe --out /tmp/tiny-moe --seed 0
    python tools/make_tiny_model.py --arch qwen3 --out /tmp/tiny --seed 1 --tie-embeddings
    python tools/make_tiny_model.py --arch glm4_moe --out /tmp/tiny-glm --override num_hidden_layers=4
    python tools/make_tiny_model.py --arch deepseek_v3 --out /tmp/tiny-moonlight \
        --override q_lora_rank=null --override rope_parameters=null --override n_group=1 --override topk_group=1

or from Python (tests, examples, the checkpoint converter):

    from tools.make_tiny_model import make_tiny_model
    path = make_tiny_model("qwen3_moe", out_dir, seed=0, num_hidden_layers=4)

The directory holds config.json, generation_config.json, model.safetensors (fp32) and the tokenizer
files (tokenizer.json, tokenizer_config.json with a ChatML chat template). Nothing comes from a model
hub: the byte-level BPE tokenizer is trained here on a small corpus embedded in this file, so the
same (arch, seed, overrides) gives the same bytes on every machine.

Shapes (the defaults; any config field can be overridden): vocab 512, hidden 64, 2 layers, 4 query
heads / 2 KV heads of head_dim 16 (GQA), max_position_embeddings 4096; qwen3 and qwen3_moe have
QK-norm; qwen3_moe has 4 experts, top-2, norm_topk_prob, moe_intermediate_size 32.
qwen2_moe (q/k/v bias) has 4 experts, top-2, full-softmax weights (norm_topk_prob false, as
Qwen2-57B-A14B), moe_intermediate_size 32 and a gated shared expert of 64. glm4_moe (GLM-4.5
shaped: q/k/v bias, QK-norm, half-rotary heads) has its first layer dense, then 8 experts top-2 in
2 groups of which 1 is chosen, routed_scaling_factor 2.5, one shared expert; its
e_score_correction_bias (zeros in transformers' init) is drawn at random too, so that the
bias-shifted expert choice is exercised. deepseek_v3 (DeepSeek-V3 shaped, model_specs/hf/tiny.py's
deepseek_v3) has multi-latent attention (4 heads, q_lora_rank 24, kv_lora_rank 32, 12 + 8 rope
q/k channels, 16 v channels), YaRN x4 over 8 original positions with mscale 1.0 / mscale_all_dim
0.8 (max_position_embeddings 32), and glm4_moe's MoE (random expert bias too); `q_lora_rank=None`
and `rope_parameters=None` give Moonlight's attention. gpt_oss (model_specs/hf/tiny.py's gpt_oss) has
layers alternating a sliding window of 8 and full attention, YaRN x4 over 8 original positions
(truncate false), 8 experts top-4 of width 32 and a SwiGLU clamp of 0.5; its attention sinks and
every bias (q/k/v/o, router, experts: zeros in transformers' init) are drawn at random, so that the
weight map and the log-prob tests see them. qwen3_next (model_specs/hf/tiny.py's qwen3_next) has 4
layers, three Gated DeltaNet layers (2 key / 4 value heads of 16, conv width 4) then one of gated
full attention with a quarter of each head rotated, and qwen2_moe's MoE with top-2 of 4 experts;
its norms (zero-centred: 0 at init, the gated one 1) and dt_bias are drawn at random too.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, run as a script
from model_specs.families import FAMILIES  # noqa: E402 - torch-free

# The shapes below, then every other family with a tiny config (model_specs/families/): its
# transformers config class is the one of its model_type, filled from that config.
SHAPED = ("qwen3", "qwen3_moe", "qwen2", "llama", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss",
          "qwen3_next")


def archs() -> tuple[str, ...]:
    """The families a tiny model can be made of: the shaped ones, then every family with a tiny
    config (a plug-in's included, once its module is imported: --plugin)."""
    return SHAPED + tuple(n for n, f in FAMILIES.items() if n not in SHAPED and f.tiny)


ARCHS = archs()
"""The shipped families' (tests parametrize over them)."""
VOCAB_SIZE = 512
# ChatML, as Qwen models use. <|im_end|> ends a turn and is the EOS token.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or are what which how "
    "many much answer question solve compute number sum product difference total left right step "
    "first then next finally guess higher lower correct wrong tool call result calculator equals "
    "plus minus times divided user assistant system think reason because so therefore we have let "
    "apples oranges books cars train hours minutes price cost each every more less than half twice "
    "</think> <think> <answer> </answer> <tool_call> </tool_call> boxed frac sqrt x y z"
).split()


def tokenizer_corpus() -> list[str]:
    """The small deterministic text the BPE merges are learnt from (enough for a full 512 vocab)."""
    lines = []
    for i in range(400):
        a, b = (i * 37) % 97, (i * 53 + 11) % 89
        w = [_WORDS[(i * k + 3) % len(_WORDS)] for k in range(1, 9)]
        lines.append(f"{' '.join(w[:4])} {a} + {b} = {a + b}. {' '.join(w[4:])} {a} * {b} = {a * b}?")
        lines.append(f"<|im_start|>user\nWhat is {a} - {b}?<|im_end|>\n<|im_start|>assistant\n"
                     f"The answer is \\boxed{{{a - b}}}.<|im_end|>")
    return lines


def _train_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus ran out of merges: make it longer
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", unk_token=None,
                                     additional_special_tokens=["<|im_start|>"],
                                     model_max_length=4096, clean_up_tokenization_spaces=False)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out))
    return hf_tok


def _config(arch: str, tok: Any, tie: bool, overrides: dict[str, Any]) -> Any:
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.02,
                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                  bos_token_id=None)
    cls: type[transformers.PretrainedConfig]
    extra: dict[str, Any]
    if arch == "qwen3":
        cls, extra = transformers.Qwen3Config, dict(head_dim=16)
    elif arch == "qwen3_moe":
        cls, extra = transformers.Qwen3MoeConfig, dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "qwen2":
        cls, extra = transformers.Qwen2Config, dict()
    elif arch == "llama":
        cls, extra = transformers.LlamaConfig, dict(head_dim=16)
    elif arch == "qwen2_moe":
        cls, extra = transformers.Qwen2MoeConfig, dict(
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
            qkv_bias=True, use_sliding_window=False)
    elif arch == "glm4_moe":
        cls, extra = transformers.Glm4MoeConfig, dict(
            head_dim=16, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0)
    elif arch == "deepseek_v3":
        cls, extra = transformers.DeepseekV3Config, dict(
            # YaRN's context (factor x original), which transformers checks factor against
            max_position_embeddings=32,
            num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=16, attention_bias=False, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "mscale": 1.0,
                             "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0},
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
            # DeepSeek's own config class's fields, which transformers does not read and SGLang
            # does (deepseek_v2.py reads moe_layer_freq): as in the published configs
            moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc")
    elif arch == "gpt_oss":
        cls, extra = transformers.GptOssConfig, dict(
            max_position_embeddings=32, head_dim=16, intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=4, sliding_window=8,
            # layer_types: transformers' default, sliding and full attention alternating
            attention_bias=True, swiglu_limit=0.5, router_aux_loss_coef=0.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False})
    elif arch == "qwen3_next":
        cls, extra = transformers.Qwen3NextConfig, dict(
            # 4 layers: three Gated DeltaNet layers, then full attention (full_attention_interval)
            num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
    elif arch in archs():
        tiny = FAMILIES[arch].tiny_hf_config()
        tokens = {k: common[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id",
                                         "tie_word_embeddings")}
        fields = {**tiny, **tokens, **overrides}
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {archs()}")
    return cls(**{**common, **extra, **overrides})


def make_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, tie_word_embeddings: bool = False,
                    **overrides: Any) -> Path:
    """Write a tiny random fp32 `arch` model with its tokenizer to `out_dir`; returns the path.

    `overrides` replace config fields (e.g. num_hidden_layers=4, num_experts=8). The weights depend
    only on (arch, seed, overrides): torch's global RNG is seeded and restored afterwards.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(out)
    config = _config(arch, tok, tie_word_embeddings, overrides)
    config.dtype = "float32"
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # GLM-4.5's expert bias: zeros at init, drawn here (docstring)
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.05)
            if arch == "gpt_oss":  # its biases (zeros at init) and sinks (docstring)
                for name, param in model.named_parameters():
                    if name.endswith(("bias", "sinks")):
                        param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
            if arch == "qwen3_next":  # its norms (0, or 1 for the gated one, at init) and dt_bias
                for name, param in model.named_parameters():
                    if "norm" in name or name.endswith("dt_bias"):
                        param.add_(torch.randn_like(param), alpha=0.1)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id], pad_token_id=config.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    from tools.plugins import add_plugin_argument, import_plugin_args
    argv = import_plugin_args(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plugin_argument(p)
    p.add_argument("--arch", required=True, choices=archs())
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-embeddings", action="store_true", help="tie input and output embeddings")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=JSON",
                   help="config field override, value parsed as JSON, e.g. num_hidden_layers=4")
    args = p.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--override expects FIELD=JSON, got {item!r}")
        overrides[key] = json.loads(value)
    path = make_tiny_model(args.arch, args.out, args.seed, args.tie_embeddings, **overrides)
    print(path)


if __name__ == "__main__":
    main()
