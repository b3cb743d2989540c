"""The one place where megatron-core is adapted to run on CPU with gloo process groups.

megatron-core assumes CUDA throughout (device="cuda" literals, torch.cuda RNG, streams, type
checks). On a machine without CUDA, `apply()` makes the real megatron-core code paths run on the
CPU, so the CPU tests exercise the same schedules, dispatchers and optimizers as a GPU cluster.
It is applied only when CUDA is absent (`apply()` is a no-op otherwise) and is idempotent.

Each adaptation below names what in megatron-core (0.16.1) needs it; tests/parallel/test_cpu_compat.py has
one test per adaptation that fails if a megatron-core change makes it wrong or unnecessary
(docs/cpu.md, items 1-9).

Config-level adaptations (fusions off, CPU initialisation, batch_p2p_comm=False with VPP on gloo)
are not patches: `cpu_config_overrides()` returns them and model_specs applies them.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False

# Tensor.type() strings megatron's optimizers and grad clipping compare against
# (Float16OptimizerWithFloat16Params.__init__, clip_grads.clip_grad_by_total_norm_fp32 and
# DistributedOptimizer._build_model_and_main_param_groups).
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # an integer device means a CUDA ordinal in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in torch calls, and answers megatron's CUDA type checks.

    Needed for the `device="cuda"` literals in megatron-core (forward_backward_no_pipelining,
    clip_grads.get_grad_norm_fp32, MixedPrecisionOptimizer.__init__, _ParamAndGradBuffer.__init__,
    get_default_causal_mask, ...), `.to(<int>)`, and `param.type() == 'torch.cuda.FloatTensor'`
    checks in the optimizers. A TorchFunctionMode is not active inside autograd's backward threads,
    so functions called from backward (torch.cuda.current_device in tensor_parallel/mappings.py) are
    patched separately below.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        elif func is torch.Tensor.to and len(args) >= 2 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoOpStream:
    """Stands in for torch.cuda.Stream / Event on CPU: CPU ops are synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str):
        # record_event() must return something with .synchronize()
        # (MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize).
        return lambda *a, **k: _NOOP_STREAM

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoOpStream)

    def __hash__(self) -> int:
        return 0


_NOOP_STREAM = _NoOpStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # torch.cuda.current_device() is used as a device= argument everywhere (91 call sites, some in
    # autograd backward where the function mode is off): "cpu" is a valid device string.
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.current_stream = lambda *a, **k: _NOOP_STREAM
    cuda.default_stream = lambda *a, **k: _NOOP_STREAM
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # RNG: route CUDA's generator calls to the CPU generator (tensor_parallel/random.py
    # CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed).
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # Tensor.cuda() is called on CPU tensors by the optimizer's state loading
    # (MegatronOptimizer.restore_from_cpu) and data helpers: keep them where they are.
    torch.Tensor.cuda = lambda self, *a, **k: self


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # tensor_parallel/random.py _get_cuda_rng_state and _set_cuda_rng_state read/write
    # torch.cuda.default_generators[idx].
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron-core 0.16's moe_utils imports te_general_gemm only when TE imports and never defines
    # it otherwise (0.19 sets it to None); the router then raises NameError in
    # RouterGatingLinearFunction.forward (a megatron-core bug).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # moe_utils.maybe_move_tensor_to_cpu converts split sizes to numpy only for CUDA tensors; with
    # CPU tensors the alltoall dispatcher passes tensors to all_to_all_single, which raises
    # TypeError on gloo.
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


_gloo_all_gather = torch.distributed.all_gather


def _all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    """gloo's all_gather rejects unequal sizes; megatron's sequence-parallel gather with
    output_split_sizes (mappings._gather_along_first_dim, used by the alltoall dispatcher with
    expert-TP > 1) needs them. Pad every piece along dim 0 to the largest, gather, copy back."""
    sizes = [t.shape[0] for t in tensor_list]
    if len(set(sizes)) <= 1 or async_op:
        return _gloo_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(sizes)
    padded_in = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded_in[: tensor.shape[0]].copy_(tensor)
    padded_out = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
    _gloo_all_gather(padded_out, padded_in, group=group)
    for out, full, n in zip(tensor_list, padded_out, sizes):
        out.copy_(full[:n])
    return None


def _patch_all_gather() -> None:
    torch.distributed.all_gather = _all_gather_uneven


def _patch_backward_device_literals() -> None:
    """Recomputation (compute.recompute) runs layers' forward again inside autograd's backward,
    where CpuDeviceMode is not active: megatron's causal mask (utils.get_default_causal_mask, called
    by FusedScaleMaskSoftmax.forward_torch_softmax) is then built with device="cuda" and fails.
    Both names point at a CPU twin (its masks cached: clear_mask_cache); the sliding window's mask
    has one too, uncached."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        if sq not in _CAUSAL_MASKS:
            if len(_CAUSAL_MASKS) >= _CAUSAL_MASKS_KEPT:
                del _CAUSAL_MASKS[next(iter(_CAUSAL_MASKS))]
            _CAUSAL_MASKS[sq] = torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()
        return _CAUSAL_MASKS[sq]

    utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = get_default_causal_mask

    # the sliding window's mask (gpt-oss; utils.get_sliding_window_causal_mask) likewise
    def get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        band = torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]),
                          diagonal=skv - sq + window_size[1])
        return ~band

    utils.get_sliding_window_causal_mask = get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = get_sliding_window_causal_mask


# The CPU twin's causal masks by length, the oldest dropped past _CAUSAL_MASKS_KEPT (a dict rather
# than functools.lru_cache, so that a closed Actor can free them and say how many bytes they held).
_CAUSAL_MASKS: dict[int, torch.Tensor] = {}
_CAUSAL_MASKS_KEPT = 32


def clear_mask_cache() -> list[torch.Tensor]:
    """Empty the CPU twin's cache of causal masks (actor/release.py); the masks it held."""
    dropped = list(_CAUSAL_MASKS.values())
    _CAUSAL_MASKS.clear()
    return dropped


def _enter_device_mode() -> None:
    CpuDeviceMode().__enter__()  # active for the rest of the process, like the patches above


# Name -> adaptation. Tests apply all but one in a fresh process to prove each is still needed.
ADAPTATIONS = {
    "torch_cuda": _patch_torch_cuda,
    "megatron_rng": _patch_megatron_rng,
    "moe": _patch_moe,
    "uneven_all_gather": _patch_all_gather,
    "backward_device_literals": _patch_backward_device_literals,
    "device_mode": _enter_device_mode,
}


def apply(skip: frozenset[str] | set[str] = frozenset()) -> bool:
    """Apply every CPU adaptation (but those in `skip`, for tests) if CUDA is absent.

    Returns True if applied (now or before). Idempotent; a no-op when CUDA is available.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if not cuda_absent():
        return False
    unknown = set(skip) - set(ADAPTATIONS)
    if unknown:
        raise ValueError(f"unknown CPU adaptations {sorted(unknown)}; known: {sorted(ADAPTATIONS)}")
    for name, adapt in ADAPTATIONS.items():
        if name not in skip:
            adapt()
    _APPLIED = True
    return True


@contextlib.contextmanager
def current_device_is_cpu():
    """While megatron modules are built outside `apply()` (the checkpoint converters build a model
    on the meta device), torch.cuda.current_device() answers "cpu" when CUDA is absent, instead of
    raising. Multi-latent attention builds its RoPE / YaRN embedding there
    (RotaryEmbedding.__init__, YarnRotaryEmbedding.__init__ and .get_emb: MLA passes no
    use_cpu_initialization). A no-op with CUDA or after apply()."""
    if not cuda_absent() or _APPLIED:
        yield
        return
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = real


def cpu_config_overrides(virtual_pipeline: int | None = None) -> dict[str, Any]:
    """TransformerConfig fields that must be set for megatron-core to run on CPU (docs/cpu.md #9).

    All fusions are CUDA kernels; `use_cpu_initialization` avoids CUDA-side init; grouped GEMM and
    permute fusion need CUDA kernels. With an interleaved (virtual) pipeline on gloo,
    `batch_p2p_comm=True` gives silently wrong losses (with PP=2 the previous and next stage are the
    same rank and batched isend/irecv pair the messages the wrong way), so it is forced off. For
    the same reason `variable_seq_lengths` is forced off there: megatron's shape exchange
    (pipeline_parallel/p2p_communication.py P2PCommunicator._communicate_shapes) always uses
    batch_isend_irecv, whatever batch_p2p_comm says, and the ranks then crash on mismatched sizes;
    actor/forward.py pads every micro-batch to one [rows, seq] shape instead.
    """
    overrides: dict[str, Any] = dict(
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=True,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )
    if virtual_pipeline and virtual_pipeline > 1:
        overrides["batch_p2p_comm"] = False
        overrides["variable_seq_lengths"] = False
    return overrides
