"""CPU replacements for two CUDA-only pieces of SGLang, for SGLang server children on CPU.

Python imports `sitecustomize` at start-up from the PYTHONPATH that rollout.servers.launch gives CPU server
children (this directory); it patches a module when SGLang imports it. GPU servers never see this
directory. The four patches:
- Qwen2-MoE's shared-expert gate runs `fused_gate_sigmoid_mul(_add)` from
  sglang.kernels.ops.elementwise.elementwise, a Triton kernel; Triton has no CPU backend, so the
  first /generate crashes. Replaced by the same math in torch: sigmoid(x @ gate_weight) * shared
  (+ added into the routed output).
- `--enable-return-routed-experts` (the engine's routing, for routing replay) allocates its host
  buffer with pin_memory=True, and sglang/srt/mem_cache/pool_host/common.py
  (_cuda_host_register) then calls torch.cuda.cudart(): the server dies at start without a GPU.
  Pinning (cudaHostRegister) only speeds up device copies; without CUDA it is skipped.
- DeepSeek-V2/V3's multi-latent attention takes the MHA path at a prefill without a cached prefix
  (sglang/srt/models/deepseek_common/attention_backend_handler.py handle_attention_triton, the handler that
  an unregistered backend falls back to): it writes the latents into the KV cache and hands the
  backend keys and values expanded per head, which flash backends attend over directly; the
  torch_native backend attends over the KV cache instead (layers/attention/torch_native_backend.py
  forward_extend), where it finds the latents, and fails ("Expected size ... batch2 tensor").
  torch_native is sent to the absorbed MLA path at every step, which reads the cache as it is
  written (the log-probs equal transformers' to 2e-6: tests/model_specs/test_deepseek_v3_serving.py).
- SGLang starts its scheduler and detokenizer processes with the "spawn" start method
  (entrypoints/engine.py _set_envs_and_config, `mp.set_start_method("spawn", force=True)`), which CUDA
  needs; each child then imports torch and SGLang again, and on 2 CPU cores the three processes'
  imports made a server start take 45 s (82 s next to a busy test suite). A CPU server has no CUDA
  context to protect, so here the children are forked from the server process, which has imported
  everything already: 39 s next to the same busy suite, 28-33 s alone (43-49 s spawned). The
  forks happen before the server starts its own threads: engine.py (Engine._launch_subprocesses)
  launches the schedulers, then the detokenizer, then makes the tokenizer manager and the HTTP server.
Qwen3-Next (Gated DeltaNet; the kernels themselves: gdn_ops.py, reached through sgl_kernel/mamba.py)
needs five more, each explained where it is defined: the gated RMSNorm in torch, the Mamba radix
cache resolved to no_buffer, the full-attention interval read from transformers 5's layer_types,
torch.get_device_module() answering the CPU, and float32 conv states (SGLANG_MAMBA_CONV_DTYPE).
"""
import multiprocessing
import os
import types
from typing import Any, Callable

from rollout.in_server.patch_on_import import install


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    import torch
    return torch.sigmoid(hidden_states @ gate_weight)[:, None] * shared_output


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    final_hidden_states.add_(fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output))


def _no_host_register(buffer, registration_granularity_bytes=None):
    return None


def _mla_absorbed_on_torch_native(module):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod)
    module.AttentionBackendRegistry.register("torch_native", lambda attn, batch: AttnForwardMethod.MLA)


# --- Qwen3-Next (Gated DeltaNet) on CPU; the ops themselves are in gdn_ops.py and sgl_kernel/mamba.py.
def _gdn_norm_in_torch(module):
    """FusedRMSNormGated (the norm after the GDN core) runs Triton's rms_norm_gated unless AMX."""
    from gdn_ops import rms_norm_gated
    module.rms_norm_gated = rms_norm_gated


def _no_mamba_extra_buffer_on_cpu(module):
    """--mamba-radix-cache-strategy auto picks extra_buffer without asking the platform
    (arg_groups/overrides.py _mamba_radix_cache_resolution), then its validator refuses CPU
    (arg_groups/mamba_hook.py validate_mamba_extra_buffer): auto resolves to no_buffer instead."""
    module.supports_mamba_cache_extra_buffer = lambda view, hf_config: False


def _qwen3_next_interval_from_layer_types(module):
    """SGLang's Qwen3NextConfig places full-attention layers by `full_attention_interval` alone
    (configs/qwen3_next.py layers_block_type) and drops `layer_types`, while transformers 5
    consumes full_attention_interval into layer_types and saves only those: a config.json that
    transformers wrote failed at model construction (AttributeError). The interval is derived
    from layer_types when they follow that pattern."""
    cls = module.Qwen3NextConfig
    init = cls.__init__

    def __init__(self, *args, layer_types=None, **kwargs):
        if layer_types and "full_attention_interval" not in kwargs:
            n = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else 0
            if not n or layer_types != [
                    "full_attention" if (i + 1) % n == 0 else "linear_attention"
                    for i in range(len(layer_types))]:
                raise ValueError(f"Qwen3-Next layer_types {layer_types} are not 'full attention "
                                 "every n-th layer', the only layout SGLang's config can express")
            kwargs["full_attention_interval"] = n
        init(self, *args, layer_types=layer_types, **kwargs)
    cls.__init__ = __init__


def _cpu_device_module(module):
    """Qwen3GatedDeltaNet.__init__ places the gated norm on `torch.get_device_module().current_device()`;
    with no argument torch answers the build's accelerator (torch.cuda for a CUDA wheel, GPU or
    not), whose current_device() then fails on a CPU host. While a Qwen3GatedDeltaNet is built
    (and only then: torch.compile traces torch.get_device_module, and a replacement left in place
    broke every other model's compiled code at start) the CPU module is answered."""
    import torch
    cls = module.Qwen3GatedDeltaNet
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        get = torch.get_device_module
        if not torch.cuda.is_available():
            torch.get_device_module = lambda device=None: torch.cpu if device is None else get(device)
        try:
            init(self, *args, **kwargs)
        finally:
            torch.get_device_module = get
    cls.__init__ = __init__


# --- LoRA (--enable-lora) on CPU; the torch forms themselves are in lora_ops.py.
def _lora_layers_on_cpu(module):
    """Pinned host tensors without CUDA, and the routed experts' adapters in torch (lora_ops.py)."""
    import torch
    from lora_ops import moe_lora_forward, unpin_memory
    unpin_memory(torch)
    module.FusedMoEWithLoRA.forward = moe_lora_forward


def _lora_token_slots_in_torch(module):
    """Each token's adapter slot, a Triton kernel in SGLang (lora_ops.token_lora_mapping)."""
    from lora_ops import token_lora_mapping
    module._compute_token_lora_mapping = token_lora_mapping


# module -> the attributes to set on it once imported, or a function that patches it
PATCHES: dict[str, dict[str, Any] | Callable[[types.ModuleType], None]] = {
    "sglang.kernels.ops.elementwise.elementwise": {
        "fused_gate_sigmoid_mul": fused_gate_sigmoid_mul,
        "fused_gate_sigmoid_mul_add": fused_gate_sigmoid_mul_add},
    "sglang.srt.mem_cache.pool_host.common": {"_cuda_host_register": _no_host_register},
    "sglang.srt.models.deepseek_common.attention_backend_handler": _mla_absorbed_on_torch_native,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _gdn_norm_in_torch,
    "sglang.srt.arg_groups.overrides": _no_mamba_extra_buffer_on_cpu,
    "sglang.srt.configs.qwen3_next": _qwen3_next_interval_from_layer_types,
    "sglang.srt.models.qwen3_next": _cpu_device_module,
    "sglang.srt.lora.layers": _lora_layers_on_cpu,
    "sglang.srt.lora.backend.base_backend": _lora_token_slots_in_torch,
}


def _setting(attrs: dict[str, Any]) -> Callable[[types.ModuleType], None]:
    """A patch that sets `attrs` on its module."""
    def patch(module: types.ModuleType) -> None:
        for attr, value in attrs.items():
            setattr(module, attr, value)
    return patch


install({name: patch if callable(patch) else _setting(patch) for name, patch in PATCHES.items()})

# Linear-attention (Qwen3-Next) conv states are kept in bfloat16 unless this says otherwise
# (sglang/srt/configs/mamba_utils.py mamba2_state_dtype): each decode step then convolves over
# rounded inputs, and an fp32 server's output log-probs moved 8.7e-5 from transformers' (prompt
# log-probs, one prefill, 1e-6). float32 keeps the CPU server's fp32 parity; an explicit setting wins.
os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")


_set_start_method = multiprocessing.set_start_method


def _fork_on_cpu(method, force=False):
    """multiprocessing.set_start_method with "spawn" turned into "fork" (the docstring's third patch)."""
    return _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = _fork_on_cpu
