"""How SGLang serves a LoRA run: its launch flags and the adapter's name (torch-free).

    extra_args += server_args(settings, cuda=False)   # driver/servers.py, servers the run launches

SGLang sizes its adapter memory at start (--max-lora-rank, --lora-target-modules): an adapter
loaded later must fit them. Its target names are the HF modules the trainer's targets become
(lora/peft.py: linear_qkv is q_proj, k_proj and v_proj, linear_fc1 gate_proj and up_proj).
Routed-expert adapters on a GPU need SGLang's Triton MoE-LoRA runner (its layers.py
FusedMoEWithLoRA refuses another pairing); on a CPU the stand-in serves them with the
torch_native backend (rollout/in_server/cpu_stand_ins/lora_ops.py).
"""
from __future__ import annotations

from gspo_megatron.lora.lora_settings import LoraSettings

ADAPTER_NAME = "gspo"
"""The one adapter name of a run on its servers; each step is a new weight version of it."""
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
MAX_LORAS_PER_BATCH = 2
"""The run's adapter and the base (a request without it, such as a health probe's) in one batch."""


def server_args(settings: LoraSettings, *, cuda: bool) -> list[str]:
    """The sglang.launch_server flags that let a server hold the run's adapter."""
    targets = [m for t in settings.targets for m in HF_MODULES[t]]
    args = ["--enable-lora", "--max-lora-rank", str(settings.rank), "--lora-target-modules", *targets,
            "--max-loras-per-batch", str(MAX_LORAS_PER_BATCH)]
    experts = bool(settings.expert_targets())
    if not cuda:
        args += ["--lora-backend", "torch_native"]
    elif experts:
        args += ["--lora-backend", "triton_v2", "--moe-runner-backend", "lora_triton"]
    if settings.experts == "shared_outer" and experts:
        args.append("--experts-shared-outer-loras")
    return args
