"""Packed micro-batches: a micro-batch's rows concatenated into one sequence without padding
(megatron's THD layout, Transformer Engine attention on CUDA).

    packed = pack(mb, multiple=tp)                     # the model's input: [1, T] tokens, cu_seqlens
    output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.seq_params())
    row_lp = rows_from_pack(pack_lp, packed, m, s)     # [1, T] -> the micro-batch's [m, s] layout

Only the model's inputs are packed. The last stage computes per-token log-probs of the pack as if
it were one row (column p: log p(token p | tokens before it in the pack)), then takes each row's
columns back out: row i's column t (1 <= t < L_i) is the pack's column start_i + t; column 0 and
the padding stay 0, and the pack's column start_i (a prediction across a row boundary) is never
used. The losses then see the same [m, s] tensors as unpacked, so per-sequence GSPO sums, masks
and metrics are unchanged. RoPE restarts at every row: position ids restart, and TE's attention
and fused RoPE use cu_seqlens (megatron packed_seq_params.py, qkv_format "thd").

The total is padded to a multiple of `multiple` (the TP size under sequence parallelism) with a
segment of its own, which no row reads. Context parallelism is not supported here yet.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gspo_megatron.parallel.layout import ParallelLayout

# Transformer Engine's unfused attention, its only backend for fp32, takes THD from TE 2.11: in
# 2.5-2.10 dot_product_attention/utils.py get_attention_backend disables it for qkv_format="thd",
# and DotProductAttention.forward then raises "No dot product attention backend is
# available". Flash and cuDNN attention take only 16-bit inputs.
FP32_PACKING_MIN_TE = (2, 11)
# megatron-core 0.16's GatedDeltaNet raises NotImplementedError for packed_seq_params
# (ssm/gated_delta_net.py GatedDeltaNet.forward); 0.19's takes THD (ssm/gated_delta_net/gdn.py)
GDN_PACKING_MIN_MCORE = (0, 19)


def _mcore_version() -> str:
    from importlib.metadata import version
    return version("megatron-core")


def resolve_packing(requested: bool | None, *, te_on_cuda: bool, context: int, half: bool,
                    te_version: str | None, linear_attention: bool = False) -> bool:
    """Whether micro-batches are packed: `requested` None means "whenever it runs here" (TE's
    attention on CUDA, no context parallelism, 16-bit parameters or a TE that takes fp32 THD);
    True where it cannot run is refused in one line, naming why."""
    why = None
    if not te_on_cuda:
        why = "needs the Transformer Engine layer spec on CUDA (megatron's local attention refuses packed sequences)"
    elif context > 1:
        why = "is not supported with parallel.context > 1"
    elif linear_attention and _version(_mcore_version()) < GDN_PACKING_MIN_MCORE:
        why = (f"is not supported for Gated DeltaNet layers (Qwen3-Next) by megatron-core "
               f"{_mcore_version()}: its layer refuses packed sequences before "
               f"{'.'.join(map(str, GDN_PACKING_MIN_MCORE))} (ssm/gated_delta_net.py)")
    elif not half and _version(te_version) < FP32_PACKING_MIN_TE:
        why = (f"with fp32 parameters needs Transformer Engine >= "
               f"{'.'.join(map(str, FP32_PACKING_MIN_TE))} (found {te_version}: no fp32 attention for "
               f"packed sequences); use model.dtype=bfloat16 or pack_sequences=false")
    if requested and why:
        raise ValueError(f"pack_sequences=True {why}")
    return bool(why is None if requested is None else requested)


def resolve_sequence_layout(layout: ParallelLayout, requested: bool | None, *, transformer_engine: bool, cuda: bool,
                            half: bool, te_version: str | None, linear_attention: bool = False) -> bool:
    """Context parallelism and packing on this machine, in one place (the run's preflight and the
    Actor, before any collective): LayoutError for context parallelism that cannot run here,
    ValueError for packing asked for where it cannot run; returns whether micro-batches are packed."""
    layout.check_context_parallel(transformer_engine=transformer_engine, cuda=cuda, half=half)
    return resolve_packing(requested, te_on_cuda=transformer_engine and cuda, context=layout.context,
                           half=half, te_version=te_version, linear_attention=linear_attention)


def _version(text: str | None) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@dataclasses.dataclass
class PackedInputs:
    tokens: torch.Tensor          # [1, T] the rows' real tokens, concatenated, then padding
    position_ids: torch.Tensor    # [1, T] 0..L_i-1 per row, 0.. for the padding segment
    cu_seqlens: torch.Tensor      # [n + 1] int32 segment boundaries (rows, then padding if any)
    starts: torch.Tensor          # [m] where each row starts in the pack
    lengths: torch.Tensor         # [m] real tokens per row
    max_seqlen: int
    real: int = 0                 # sum(lengths), known on the host (no device sync to read it)

    def to(self, device) -> "PackedInputs":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams
        cu = self.cu_seqlens.to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def pack(tokens: torch.Tensor, lengths: torch.Tensor, multiple: int = 1) -> PackedInputs:
    """Pack the rows of `tokens` [m, s] (row i's first lengths[i] tokens; a filler row of length
    0 contributes nothing) into one sequence padded to a multiple of `multiple`."""
    lengths = lengths.long()
    parts = [tokens[i, :int(n)] for i, n in enumerate(lengths.tolist())]
    real = int(lengths.sum())
    total = max(multiple, -(-real // multiple) * multiple)
    pad = total - real
    flat = torch.cat(parts + [tokens.new_zeros(pad)])
    positions = torch.cat([torch.arange(int(n)) for n in lengths.tolist()] + [torch.arange(pad)])
    bounds = [0] + torch.cumsum(lengths[lengths > 0], 0).tolist() + ([total] if pad else [])
    starts = torch.cumsum(lengths, 0) - lengths
    max_seqlen = max([int(n) for n in lengths.tolist()] + [pad])
    return PackedInputs(tokens=flat[None], position_ids=positions[None].to(tokens.device),
                        cu_seqlens=torch.tensor(bounds, dtype=torch.int32), starts=starts,
                        lengths=lengths, max_seqlen=max_seqlen, real=real)


def rows_from_pack(pack_values: torch.Tensor, packed: PackedInputs, m: int, s: int) -> torch.Tensor:
    """The pack's per-token values [T] (column p = the value for token p) as the micro-batch's
    target-aligned [m, s]: row i's column t (1 <= t < L_i) is pack column starts[i] + t; all other
    columns 0. Differentiable (a gather)."""
    t = torch.arange(s, device=pack_values.device)[None, :]                          # [1, s]
    valid = (t >= 1) & (t < packed.lengths.to(pack_values.device)[:, None])           # [m, s]
    index = (packed.starts.to(pack_values.device)[:, None] + t).clamp(max=pack_values.numel() - 1)
    return torch.where(valid, pack_values[index], pack_values.new_zeros(()))
