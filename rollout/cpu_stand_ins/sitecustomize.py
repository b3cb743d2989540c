"""CPU replacements for two CUDA-only pieces of SGLang, for SGLang server children on CPU.

Python imports `sitecustomize` at start-up from the PYTHONPATH that rollout.server gives CPU server
children (this directory); it patches a module when SGLang imports it. GPU servers never see this
directory. The four patches:
- Qwen2-MoE's shared-expert gate runs `fused_gate_sigmoid_mul(_add)` from
  sglang.kernels.ops.elementwise.elementwise, a Triton kernel; Triton has no CPU backend, so the
  first /generate crashes. Replaced by the same math in torch: sigmoid(x @ gate_weight) * shared
  (+ added into the routed output).
- `--enable-return-routed-experts` (the engine's routing, for routing replay) allocates its host
  buffer with pin_memory=True, and sglang/srt/mem_cache/pool_host/common.py:147
  (_cuda_host_register) then calls torch.cuda.cudart(): the server dies at start without a GPU.
  Pinning (cudaHostRegister) only speeds up device copies; without CUDA it is skipped.
- DeepSeek-V2/V3's multi-latent attention takes the MHA path at a prefill without a cached prefix
  (sglang/srt/models/deepseek_common/attention_backend_handler.py:98-102, the triton handler that
  an unregistered backend falls back to): it writes the latents into the KV cache and hands the
  backend keys and values expanded per head, which flash backends attend over directly; the
  torch_native backend attends over the KV cache instead (layers/attention/torch_native_backend.py
  forward_extend), where it finds the latents, and fails ("Expected size ... batch2 tensor").
  torch_native is sent to the absorbed MLA path at every step, which reads the cache as it is
  written (the log-probs equal transformers' to 2e-6: tests/model_specs/test_deepseek_v3_serving.py).
- SGLang starts its scheduler and detokenizer processes with the "spawn" start method
  (sglang/srt/entrypoints/engine.py:1995, `mp.set_start_method("spawn", force=True)`), which CUDA
  needs; each child then imports torch and SGLang again, and on 2 CPU cores the three processes'
  imports made a server start take 45 s (82 s next to a busy test suite). A CPU server has no CUDA
  context to protect, so here the children are forked from the server process, which has imported
  everything already: 39 s next to the same busy suite, 28-33 s alone (43-49 s spawned). The
  forks happen before the server starts its own threads: engine.py launches the schedulers, then
  the detokenizer (:1329), then makes the tokenizer manager (:1339) and the HTTP server.
"""
import importlib.abc
import importlib.machinery
import multiprocessing
import sys



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


PATCHES = {
    "sglang.kernels.ops.elementwise.elementwise": {
        "fused_gate_sigmoid_mul": fused_gate_sigmoid_mul,
        "fused_gate_sigmoid_mul_add": fused_gate_sigmoid_mul_add},
    "sglang.srt.mem_cache.pool_host.common": {"_cuda_host_register": _no_host_register},
    "sglang.srt.models.deepseek_common.attention_backend_handler": _mla_absorbed_on_torch_native,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending = dict(PATCHES)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        attrs = self.pending.pop(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            if callable(attrs):
                attrs(module)
                return
            for attr, value in attrs.items():
                setattr(module, attr, value)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())


_set_start_method = multiprocessing.set_start_method


def _fork_on_cpu(method, force=False):
    """multiprocessing.set_start_method with "spawn" turned into "fork" (the docstring's third patch)."""
    return _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = _fork_on_cpu
