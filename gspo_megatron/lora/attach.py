"""Attach adapters to a built megatron model, before DDP and the optimizer see it.

    names = attach_lora(gpt_model, LoraSettings(rank=8), seed=1234)   # actor/build.py does this
    with adapters_off(models):                                        # the base policy (KL reference)
        ...

After attach_lora every base parameter has requires_grad=False, so megatron's DDP builds gradient
buffers for the adapters alone and its optimizer holds only them (both skip frozen parameters:
megatron-core distributed_data_parallel.py DistributedDataParallel.__init__, optimizer/__init__.py
_get_param_groups). Each adapter is the child `lora` of the module it adapts, called by a forward
hook that adds its delta to the module's output, so the base keeps its parameter names and its
checkpoint keys (checkpoint/model_io.py leaves `.lora.` keys out of the base's). B starts at zero:
the first policy is the base bit for bit. A is drawn from the seed and its tensor's global name, so
every layout starts from the same adapters.

Refused here, each in one line: routed-expert adapters with expert tensor parallelism > 1 (a rank
would hold a slice of an expert's fc1 rows and fc2 columns, and B and A would have to be cut the
same way across the expert-TP group: Megatron-Bridge shipped wrong deltas there),
shared experts overlapped with the dispatcher (their linears skip the TP communication the adapter
mirrors), and a target that matches no layer of the model.
"""
from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Iterable, Iterator

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from gspo_errors import InputError
from gspo_megatron.lora.adapters import ADAPTER, ExpertLora, LinearLora, init_a, is_adapter_key
from gspo_megatron.lora.lora_settings import LoraSettings


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


class LoraError(InputError, ValueError):
    """LoRA settings this model or layout cannot run (the message names the setting and why)."""


def _kind(module: torch.nn.Module) -> str | None:
    """"column" or "row" for a tensor-parallel linear layer of megatron or Transformer Engine, else None."""
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)   # TE's Linear / LayerNormLinear (megatron-core
    if mode in ("column", "row"):                   # extensions/transformer_engine.py TELinear)
        return mode
    return None


def _normed_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input a fused norm-linear layer (TE's LayerNormLinear, the TE spec's linear_qkv and
    linear_fc1) multiplies: its own norm of x, recomputed in torch (TE returns it only with
    return_layernorm_output, which megatron's wrapper does not pass through)."""
    weight: torch.Tensor = getattr(module, "layer_norm_weight")
    eps: float = getattr(module, "eps")
    if getattr(module, "zero_centered_gamma", False):
        weight = weight + 1
    xf = x.float()
    if getattr(module, "normalization", "RMSNorm") == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * weight.float()).to(x.dtype)
    bias: torch.Tensor | None = getattr(module, "layer_norm_bias", None)
    y = torch.nn.functional.layer_norm(xf, xf.shape[-1:], weight.float(),
                                       None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def _linear_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    adapter: LinearLora = getattr(module, ADAPTER)
    if not adapter.enabled:
        return output
    x = args[0] if args else next(iter(kwargs.values()))
    if getattr(module, "layer_norm_weight", None) is not None:
        x = _normed_input(module, x)
    out, bias = output
    return out + adapter(x), bias


def _expert_hook(lora: ExpertLora, which: str, expert: int, module: torch.nn.Module, args: tuple,
                 kwargs: dict, output: Any) -> Any:
    """SequentialMLP: local expert `expert`'s linear on its own rows."""
    if not lora.enabled:
        return output
    x = args[0] if args else next(iter(kwargs.values()))
    out, bias = output
    return out + lora.delta(which, expert, x), bias


def _grouped_hook(lora: ExpertLora, which: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                  output: Any) -> Any:
    """Grouped-GEMM experts (TEGroupedMLP): one call for every local expert's rows,
    `linear_fc1(x, tokens_per_expert)` (megatron-core transformer/moe/experts.py TEGroupedMLP.forward)."""
    if not lora.enabled:
        return output
    x, rows = (list(args) + list(kwargs.values()))[:2]
    out, bias = output
    return out + lora.grouped_delta(which, x, rows), bias


def _replicated(param: torch.nn.Parameter, sequence_parallel: bool) -> None:
    tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if sequence_parallel:  # each TP rank saw its own tokens: summed over TP by finalize_model_grads
        setattr(param, "sequence_parallel", True)   # megatron-core's attribute on a Parameter


def _attach_linear(module: torch.nn.Module, kind: str, global_name: str, settings: LoraSettings,
                   seed: int) -> None:
    weight: torch.Tensor = getattr(module, "weight")
    if getattr(module, "explicit_expert_comm", False):
        raise LoraError(f"lora.targets: {global_name} skips its tensor-parallel communication "
                        "(shared experts overlapped with the dispatcher, moe_shared_expert_overlap): "
                        "not supported with LoRA; drop linear_fc1/linear_fc2 from lora.targets or the overlap")
    tp_group = getattr(module, "tp_group", None) or ps.get_tensor_model_parallel_group()
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    sp = bool(getattr(module, "sequence_parallel", False)) and tp_size > 1
    out_local, in_local = weight.shape
    adapter = LinearLora(kind, rank=settings.rank, scale=settings.scale, in_local=in_local,
                         out_local=out_local, sequence_parallel=sp, tp_group=tp_group, tp_size=tp_size,
                         dtype=weight.dtype, device=weight.device)
    full_in = in_local * tp_size if kind == "row" else in_local
    a = init_a((settings.rank, full_in), seed, f"{global_name}.{ADAPTER}.a")
    with torch.no_grad():
        adapter.a.copy_(a.chunk(tp_size, dim=1)[tp_rank] if kind == "row" else a)
    if kind == "column":
        _replicated(adapter.a, sp)
        tensor_parallel.set_tensor_model_parallel_attributes(
            adapter.b, True, 0, getattr(weight, "partition_stride", 1))
    else:
        tensor_parallel.set_tensor_model_parallel_attributes(adapter.a, True, 1, 1)
        _replicated(adapter.b, sp)
    module.add_module(ADAPTER, adapter)
    module.register_forward_hook(_linear_hook, with_kwargs=True)


def _attach_experts(experts: torch.nn.Module, mlp: torch.nn.Module, global_prefix: str,
                    settings: LoraSettings, config: Any, seed: int) -> None:
    if ps.get_expert_tensor_parallel_world_size() > 1:
        raise LoraError(f"lora.experts={settings.experts} with parallel.expert_tensor="
                        f"{ps.get_expert_tensor_parallel_world_size()}: routed-expert adapters need "
                        "expert tensor parallelism 1 (each rank would hold a slice of every expert's "
                        "fc1 rows and fc2 columns); set parallel.expert_tensor=1 or lora.experts=none")
    targets = settings.expert_targets()
    local = list(getattr(mlp, "local_expert_indices"))
    gated = bool(config.gated_linear_unit)
    ffn = int(config.moe_ffn_hidden_size)
    ref = next(p for n, p in experts.named_parameters() if "linear_fc1" in n)
    lora = ExpertLora(layout=settings.experts, targets=targets, num_local_experts=len(local),
                      hidden=int(config.hidden_size), ffn=ffn, fc1_out=ffn * (2 if gated else 1),
                      rank=settings.rank, scale=settings.scale, dtype=ref.dtype, device=ref.device)
    with torch.no_grad():
        for which in ("fc1", "fc2"):
            if not lora.has(which):
                continue
            a = getattr(lora, f"{which}_a")
            name = f"{global_prefix}.{ADAPTER}.{which}_a"
            slots = ["shared"] if lora.shared(f"{which}_a") else local
            for i, slot in enumerate(slots):
                a[i].copy_(init_a(a.shape[1:], seed, f"{name}[{slot}]"))
    for name, param in lora.named_parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        # per expert: reduced over the expert data-parallel group, as the experts' own weights;
        # shared by every expert of the layer: over the dense one (and TP: each TP rank routed
        # its own tokens), whichever EP rank holds the experts that used it
        setattr(param, "allreduce", lora.shared(name))
        setattr(param, "expert_stacked", not lora.shared(name))  # dim 0: the local experts (joined over EP)
        if lora.shared(name) and ps.get_tensor_model_parallel_world_size() > 1:
            setattr(param, "sequence_parallel", True)
    experts.add_module(ADAPTER, lora)
    from megatron.core.transformer.moe.experts import SequentialMLP
    for which in ("fc1", "fc2"):
        if not lora.has(which):
            continue
        if isinstance(experts, SequentialMLP):
            for i, expert in enumerate(experts.local_experts):
                getattr(expert, f"linear_{which}").register_forward_hook(
                    functools.partial(_expert_hook, lora, which, i), with_kwargs=True)
        else:
            getattr(experts, f"linear_{which}").register_forward_hook(
                functools.partial(_grouped_hook, lora, which), with_kwargs=True)


def attach_lora(model: torch.nn.Module, settings: LoraSettings, *, seed: int) -> list[str]:
    """Freeze `model` (one unwrapped GPTModel chunk) and attach the adapters `settings` asks for;
    returns the global names of the adapted modules. Needs megatron's parallel state."""
    if not settings.enabled:
        raise ValueError("attach_lora: lora.rank is 0 (LoRA is off)")
    for param in model.parameters():
        param.requires_grad_(False)
    config = model.config
    attached: list[str] = []
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        prefix = f"decoder.layers.{layer.layer_number - 1}"
        for local_name, module in list(layer.named_modules()):
            short = local_name.rpartition(".")[2]
            if short not in settings.targets or ".experts." in f".{local_name}.":
                continue
            kind = _kind(module)
            if kind is None:
                continue
            _attach_linear(module, kind, f"{prefix}.{local_name}", settings, seed)
            attached.append(f"{prefix}.{local_name}")
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if mlp is not None and experts is not None and settings.expert_targets():
            _attach_experts(experts, mlp, f"{prefix}.mlp.experts", settings, config, seed)
            attached.append(f"{prefix}.mlp.experts")
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    if len(layers) and not attached:
        raise LoraError(f"lora.targets={settings.targets}: no layer of this model matches (its linear "
                        "layers are named otherwise, e.g. a multi-latent attention's or a Gated "
                        "DeltaNet's)")
    return attached


def named_adapters(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) of one unwrapped chunk's adapters; the global name
    has the layer's index in the whole model (a pipeline stage's layer 0 may be the model's 24)."""
    for local, param in model.named_parameters():
        if not is_adapter_key(local):
            continue
        m = _LAYER.match(local)
        name = local if m is None else \
            f"decoder.layers.{getattr(model, 'decoder').layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"
        yield local, name, param


def adapter_modules(models: Iterable[torch.nn.Module]) -> Iterator[LinearLora | ExpertLora]:
    for model in models:
        for module in model.modules():
            if isinstance(module, (LinearLora, ExpertLora)):
                yield module


def has_adapters(models: Iterable[torch.nn.Module]) -> bool:
    return next(adapter_modules(models), None) is not None


@contextlib.contextmanager
def adapters_off(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """The base policy while inside: every adapter's delta is skipped (the KL reference is the
    same model with its adapters off, no second copy)."""
    modules = list(adapter_modules(models))
    saved = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, on in zip(modules, saved):
            m.enabled = on
