"""Torch versions of SGLang's Triton gated-shared-expert kernels, for SGLang server children on CPU.

Qwen2-MoE's shared expert gate runs `fused_gate_sigmoid_mul(_add)` from
sglang.kernels.ops.elementwise.elementwise, a Triton kernel; Triton has no CPU backend, so the
first /generate crashes. Python imports `sitecustomize` at start-up from the PYTHONPATH that
rollout.server gives CPU server children (this directory); it patches the two functions into that
module when SGLang imports it, with the same math in torch: sigmoid(x @ gate_weight) * shared
(+ added into the routed output). Nothing else is touched; GPU servers never see this directory.
"""
import importlib.abc
import importlib.machinery
import sys

_MODULE = "sglang.kernels.ops.elementwise.elementwise"


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    import torch
    return torch.sigmoid(hidden_states @ gate_weight)[:, None] * shared_output


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    final_hidden_states.add_(fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
            module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
