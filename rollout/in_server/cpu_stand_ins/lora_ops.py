"""SGLang's LoRA serving on a CPU: what sglang 0.5.23 runs on a GPU only, in torch.

sitecustomize.py installs these when SGLang imports its LoRA modules (`--enable-lora`), in CPU
server children only:
- `unpin_memory`: the LoRA layers, the memory pool and the torch_native backend allocate their
  host tensors with `pin_memory=True` or call `.pin_memory()` (sglang/srt/lora/layers.py
  ColumnParallelLinearWithLoRA.__init__, lora.py LoRAAdapter.pin_weights_in_cpu,
  backend/torch_backend.py prepare_lora_batch), which needs the CUDA driver: the server died at
  start ("Found no NVIDIA driver"). Pinning only speeds up copies to a GPU; without CUDA the
  tensor is returned as it is.
- `token_lora_mapping`: each token's adapter slot (-1: none), computed by a Triton kernel
  (backend/base_backend.py _compute_token_lora_mapping); here from the segments in torch.
- `moe_lora_forward`: the routed experts with their adapters (layers.py FusedMoEWithLoRA.forward
  runs a Triton MoE runner). The base part is SGLang's own CPU path, moe_forward_native
  (layers/moe/fused_moe_native.py), step for step: each expert on its sorted rows, the gate/up
  delta added before the activation and the down delta after the down projection, then the
  routing weights; with every adapter at zero it is that function's output bit for bit.
"""
from __future__ import annotations

import functools


def unpin_memory(torch) -> None:
    """Make pinning a no-op in this (CUDA-less) process: `.pin_memory()` returns the tensor, and
    the factories drop `pin_memory=True`."""
    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_unpinned", False):
        return

    def same(self, *args, **kwargs):
        return self
    setattr(same, "_unpinned", True)   # the marker the check above reads
    torch.Tensor.pin_memory = same
    for name in ("tensor", "empty", "zeros", "ones", "arange", "full"):
        make = getattr(torch, name)

        @functools.wraps(make)
        def unpinned(*args, _make=make, **kwargs):
            kwargs.pop("pin_memory", None)
            return _make(*args, **kwargs)
        setattr(torch, name, unpinned)


def token_lora_mapping(num_tokens, seg_indptr, lora_ranks, weight_indices, token_lora_mapping,
                       max_len, bucket_len=None, adapter_enabled=None):
    """Each token's adapter slot, -1 where its adapter has rank 0 (the base), and the slots in use
    marked in `adapter_enabled`: _compute_token_lora_mapping's contract."""
    import torch
    bounds = seg_indptr.tolist()
    slots = weight_indices[:len(bounds) - 1].tolist()
    ranks = lora_ranks.tolist()
    out = torch.full((num_tokens if token_lora_mapping is None else token_lora_mapping.shape[0],),
                     -1, dtype=torch.int32, device=seg_indptr.device)
    for start, end, slot in zip(bounds, bounds[1:], slots):
        if ranks[slot] > 0:
            out[start:min(end, num_tokens)] = slot
            if adapter_enabled is not None:
                adapter_enabled[slot] = 1
    if token_lora_mapping is None:
        return out
    token_lora_mapping.copy_(out)
    return token_lora_mapping


def _delta(x, a, b, slots, rows_slot, shared_a: bool, shared_b: bool, expert: int, num_slices: int):
    """Rows x [n, in] of one expert, rows_slot [n] their adapter slots: the delta B_slice (A_slice x)
    for each of `num_slices` output slices (gate and up: 2). The memory pool holds the routed
    experts' B already multiplied by alpha / r (mem_pool.py LoRAMemoryPool.load_lora_weight_to_buffer,
    `w * lora_adapter.scaling`), unlike the dense modules' B, scaled at compute time."""
    import torch
    out = None
    for slot in slots:
        pick = rows_slot == slot
        if not bool(pick.any()):
            continue
        a_s = a[slot, 0 if shared_a else expert]                 # [slices * r, in]
        b_s = b[slot, 0 if shared_b else expert]                 # [slices * out_slice, r]
        r, o = a_s.shape[0] // num_slices, b_s.shape[0] // num_slices
        xs = x[pick]
        parts = [torch.nn.functional.linear(torch.nn.functional.linear(xs, a_s[i * r:(i + 1) * r]),
                                            b_s[i * o:(i + 1) * o]) for i in range(num_slices)]
        d = torch.cat(parts, dim=-1)
        if out is None:
            out = torch.zeros(x.shape[0], d.shape[-1], dtype=x.dtype, device=x.device)
        out[pick] = d.to(x.dtype)
    return out


def moe_lora_forward(self, hidden_states, topk_output, **kwargs):
    """FusedMoEWithLoRA.forward in torch (module docstring): SGLang's moe_forward_native with the
    adapters of each token's slot (shared_outer: one gate/up A and one down B per layer)."""
    import torch
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.runtime_context import LoRABatchLayout

    layer = self.base_layer
    batch_info = self.lora_backend.get_batch_info(LoRABatchLayout.TP_GLOBAL)
    if batch_info is None or not self.set_lora:
        return layer.forward(hidden_states, topk_output, **kwargs)
    if layer.moe_runner_config.activation != "silu" or layer.moe_runner_config.gemm1_alpha is not None:
        raise NotImplementedError("the CPU stand-in's MoE LoRA forward runs SwiGLU experts only")
    x = hidden_states
    topk_weights, topk_ids, _ = topk_output
    mapping = batch_info.moe_lora_info.token_lora_mapping[:x.shape[0]].long()       # [t]
    slots = sorted({int(s) for s in mapping.tolist() if s >= 0})
    shared = bool(self.experts_shared_outer_loras)
    cnts = topk_ids.new_zeros((topk_ids.shape[0], layer.num_experts))
    cnts.scatter_(1, topk_ids.to(torch.int64), 1)
    tokens_per_expert = cnts.sum(dim=0).tolist()
    idxs = topk_ids.reshape(-1).argsort()
    sorted_tokens = x[idxs // topk_ids.shape[1]]
    sorted_slots = mapping[idxs // topk_ids.shape[1]]
    act = SiluAndMul()
    outputs, start = [], 0
    for e, n in enumerate(tokens_per_expert):
        end = start + n
        if n == 0:
            continue
        rows, rows_slot = sorted_tokens[start:end], sorted_slots[start:end]
        gate_up = torch.nn.functional.linear(rows, layer.w13_weight[e])
        d = _delta(rows, self.gate_up_lora_a_weights, self.gate_up_lora_b_weights, slots, rows_slot,
                   shared, False, e, 2)
        if d is not None:
            gate_up = gate_up + d
        inter = act(gate_up)
        out = torch.nn.functional.linear(inter, layer.w2_weight[e])
        d = _delta(inter, self.down_lora_a_weights, self.down_lora_b_weights, slots, rows_slot,
                   False, shared, e, 1)
        if d is not None:
            out = out + d
        outputs.append(out)
        start = end
    outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
    new_x = torch.empty_like(outs)
    new_x[idxs] = outs
    return (new_x.view(*topk_ids.shape, -1).type(topk_weights.dtype)
            .mul_(topk_weights.unsqueeze(dim=-1)).sum(dim=1).type(new_x.dtype))
