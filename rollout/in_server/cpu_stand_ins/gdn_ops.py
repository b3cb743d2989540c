"""Torch implementations of the Gated DeltaNet (Qwen3-Next) ops that SGLang calls on CPU.

On CPU SGLang's GDN linear-attention backend takes its kernels from sgl-kernel's CPU build (AMX /
AVX-512 only, docs/cpu.md), not from its Triton kernels (Triton has no CPU backend):
- sglang/srt/layers/attention/linear/gdn_backend.py (the `elif is_cpu():` branch):
  `from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu` and
  `torch.ops.sgl_kernel.fused_gdn_gating_cpu`;
- sglang/srt/layers/attention/linear/kernels/gdn_triton.py (the `elif is_cpu():` branch):
  `from sgl_kernel.mamba import chunk_gated_delta_rule_cpu` and
  `torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu`;
- the gated RMSNorm after the GDN core (FusedRMSNormGated in
  sglang/kernels/ops/attention/fla/fused_norm_gate.py) takes the sgl-kernel op only with AMX, and
  otherwise the Triton `rms_norm_gated`: sitecustomize replaces that with `rms_norm_gated` below.

Each function here has the calling convention of the SGLang call site and the math of SGLang's own
Triton versions (kernels/ops/mamba/causal_conv1d_triton.py, kernels/ops/attention/linear/
fused_gdn_gating.py, kernels/ops/attention/fla/chunk.py, kernels/ops/attention/linear/
fused_sigmoid_gating_recurrent.py, kernels/ops/attention/fla/fused_norm_gate.py), which match
transformers' modeling_qwen3_next torch paths. Layouts (SGLang's Mamba pool, configs/mamba_utils.py):
conv state [slots, conv_dim, width - 1], SSM state [slots, HV, V, K] (value dim before key dim);
slot index < 0 (PAD_SLOT_ID) marks padding: no state read or written. Computation is in float32.
Speculative decoding (target verify, intermediate states) and multi-item scoring are not supported.

Only SGLang server children on CPU import this (as top-level `gdn_ops`, via the stand-in
`sgl_kernel.mamba` and sitecustomize); `install_torch_ops` puts the two torch.ops entries on
`torch.ops.sgl_kernel` as plain Python attributes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

_EPS_L2 = 1e-6
_CHUNK = 64


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(x)
    if activation in (None, False, "identity"):
        return x
    raise ValueError(f"gdn_ops: unsupported conv activation {activation!r}")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _EPS_L2)


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)


def _lengths(cu_seqlens: torch.Tensor, seq_lens_cpu: Optional[Sequence[int]] = None) -> list[int]:
    if seq_lens_cpu is not None:
        return [int(n) for n in seq_lens_cpu]
    cu = cu_seqlens.tolist()
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


# --- causal conv1d ------------------------------------------------------------------------------

def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         conv_states: Optional[torch.Tensor] = None,
                         query_start_loc: Optional[torch.Tensor] = None,
                         seq_lens_cpu: Optional[Sequence[int]] = None,
                         cache_indices: Optional[torch.Tensor] = None,
                         has_initial_state: Optional[torch.Tensor] = None,
                         activation="silu", pad_slot_id: int = -1, **_unused) -> torch.Tensor:
    """Prefill depthwise causal conv over concatenated sequences. x: [dim, total_tokens] (a view is
    fine); weight [dim, width]; per sequence i the left context is conv_states[cache_indices[i]]
    when has_initial_state[i], else zeros; afterwards conv_states[cache_indices[i]] holds the last
    width - 1 inputs (state included). Returns [dim, total_tokens] in x's dtype."""
    dim, total = x.shape
    width = weight.shape[1]
    lens = _lengths(query_start_loc, seq_lens_cpu) if query_start_loc is not None else [total]
    out = torch.empty_like(x)
    w = weight.float()
    start = 0
    for i, n in enumerate(lens):
        xi = x[:, start:start + n].float()
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if conv_states is not None and slot != pad_slot_id and slot >= 0 and (
                has_initial_state is not None and bool(has_initial_state[i])):
            left = conv_states[slot, :, -(width - 1):].float()
        else:
            left = xi.new_zeros(dim, width - 1)
        padded = torch.cat([left, xi], dim=1)                        # [dim, width-1+n]
        y = F.conv1d(padded.unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(),
                     groups=dim).squeeze(0)                           # [dim, n]
        out[:, start:start + n] = _activate(y, activation).to(x.dtype)
        if conv_states is not None and slot != pad_slot_id and slot >= 0:
            state_len = conv_states.shape[-1]
            tail = padded[:, -state_len:] if padded.shape[1] >= state_len else F.pad(
                padded, (state_len - padded.shape[1], 0))
            conv_states[slot] = tail.to(conv_states.dtype)
        start += n
    return out


def causal_conv1d_update_cpu(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: Optional[torch.Tensor] = None, activation=None,
                             cache_seqlens: Optional[torch.Tensor] = None,
                             conv_state_indices: Optional[torch.Tensor] = None,
                             pad_slot_id: int = -1, **kwargs) -> torch.Tensor:
    """Decode step of the causal conv: x [batch, dim] or [batch, dim, seqlen]; conv_state
    [slots, dim, state_len] is shifted left by seqlen and takes x (in place). Returns x's shape."""
    if cache_seqlens is not None or any(kwargs.get(k) is not None for k in (
            "intermediate_conv_window", "num_accept_tokens", "retrieve_parent_token")):
        raise NotImplementedError("gdn_ops.causal_conv1d_update_cpu: speculative decoding / "
                                  "circular conv states are not supported by the CPU stand-in")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    batch, dim, seqlen = xs.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    slots = (conv_state_indices[:batch].long() if conv_state_indices is not None
             else torch.arange(batch, device=x.device))
    valid = (slots != pad_slot_id) & (slots >= 0)
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    state = conv_state[safe].float() * valid[:, None, None]          # [batch, dim, state_len]
    padded = torch.cat([state, xs.float()], dim=-1)                    # [batch, dim, state_len+seqlen]
    window = padded[..., state_len - (width - 1):]                     # [batch, dim, width-1+seqlen]
    y = F.conv1d(window.reshape(1, batch * dim, -1), weight.float().repeat(batch, 1).unsqueeze(1),
                 None if bias is None else bias.float().repeat(batch), groups=batch * dim)
    y = _activate(y.reshape(batch, dim, seqlen), activation).to(x.dtype)
    if bool(valid.any()):
        conv_state[slots[valid]] = padded[valid][..., -state_len:].to(conv_state.dtype)
    return y.squeeze(-1) if squeeze else y


# --- gating -------------------------------------------------------------------------------------

def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         dt_bias: torch.Tensor, beta: float = 1.0, threshold: float = 20.0):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b: [tokens, HV].
    Returns (g, beta), each float32 [1, tokens, HV] like SGLang's Triton fused_gdn_gating."""
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), beta, threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


# --- gated delta rule ---------------------------------------------------------------------------

def _chunk_one(q, k, v, g, beta, h, chunk: int = _CHUNK):
    """One sequence, all heads, float32. q, k: [HV, T, K] (already l2-normed, q scaled); v [HV, T, V];
    g, beta [HV, T]; h: [HV, K, V] initial state. Returns (o [HV, T, V], final h [HV, K, V]).
    Chunked form of the recurrence h_t = exp(g_t) h_{t-1} + k_t beta_t (v_t - exp(g_t) h_{t-1}^T k_t)^T,
    o_t = h_t^T q_t (as fla's chunk_gated_delta_rule and transformers' torch_chunk_gated_delta_rule)."""
    HV, T, K = k.shape
    pad = (chunk - T % chunk) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(HV, n, chunk, t.shape[-1]) for t in (q, k, v))
    g = g.reshape(HV, n, chunk).cumsum(-1)
    beta = beta.reshape(HV, n, chunk, 1)
    k_beta, v_beta = k * beta, v * beta
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().tril()     # [HV, n, C, C]
    strict = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool), -1)
    lower = ((k_beta @ k.transpose(-1, -2)) * decay) * strict
    eye = torch.eye(chunk, dtype=k.dtype)
    # (I + L)^-1 with L strictly lower: the WY representation of the chunk's delta-rule updates
    inv = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False,
                                        unitriangular=True)
    u = inv @ v_beta                                                   # [HV, n, C, V]
    w = inv @ (k_beta * g.exp().unsqueeze(-1))                         # [HV, n, C, K]
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool))
    o = torch.empty_like(u)
    for i in range(n):
        qi, ki, gi = q[:, i], k[:, i], g[:, i]
        v_new = u[:, i] - w[:, i] @ h                                  # [HV, C, V]
        attn = (qi @ ki.transpose(-1, -2)) * decay[:, i] * causal
        o[:, i] = (qi * gi.exp().unsqueeze(-1)) @ h + attn @ v_new
        h = h * gi[:, -1, None, None].exp() + (
            ki * (gi[:, -1:] - gi).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    return o.reshape(HV, n * chunk, -1)[:, :T], h


def _heads(q, k, hv):
    rep = hv // q.shape[-2]
    return (q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)) if rep > 1 else (q, k)


def _queries_and_keys(q, k, v, scale, l2norm: bool):
    """(B, T, HV, K, V, q, k): q scaled (by K^-1/2 unless `scale`), both l2-normed if asked, in
    float32 and repeated to the value heads."""
    B, T, H, K = k.shape
    HV, V = v.shape[-2], v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf, kf = _heads(qf * scale, kf, HV)
    return B, T, HV, K, V, qf, kf


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: Optional[float] = None,
                               initial_state: Optional[torch.Tensor] = None,
                               initial_state_indices: Optional[torch.Tensor] = None,
                               cu_seqlens: Optional[torch.Tensor] = None, head_first: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, inplace_update: bool = True,
                               **_unused):
    """Prefill of the gated delta rule over concatenated sequences (varlen: batch 1 + cu_seqlens).
    q, k: [1, T, H, K]; v: [1, T, HV, V]; g (log decay), beta: [1, T, HV]; initial_state: the pool
    [slots, HV, V, K], read at initial_state_indices[i] and (inplace_update) overwritten with each
    sequence's final state. Returns (o [1, T, HV, V] in q's dtype, None, None) like SGLang's
    chunk_gated_delta_rule (whose third value, per-chunk states, is only read for Mamba
    prefix-cache tracking, which the CPU server does not use)."""
    if head_first:
        raise NotImplementedError("gdn_ops.chunk_gated_delta_rule_cpu: head_first")
    B, T, HV, K, V, qf, kf = _queries_and_keys(q, k, v, scale, use_qk_l2norm_in_kernel)
    vf, gf, bf = v.float(), g.float().reshape(B, T, HV), beta.float().reshape(B, T, HV)
    if cu_seqlens is not None:
        bounds = [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    else:
        bounds = [(b, 0, T) for b in range(B)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float32)
    for i, (bi, s, e) in enumerate(bounds):
        slot = int(initial_state_indices[i]) if initial_state_indices is not None else i
        if initial_state is not None and slot >= 0:
            h = initial_state[slot].float().transpose(-1, -2)          # [HV, K, V]
        else:
            h = torch.zeros(HV, K, V)
        if e > s:
            oi, h = _chunk_one(qf[bi, s:e].transpose(0, 1), kf[bi, s:e].transpose(0, 1),
                               vf[bi, s:e].transpose(0, 1), gf[bi, s:e].transpose(0, 1),
                               bf[bi, s:e].transpose(0, 1), h)
            o[bi, s:e] = oi.transpose(0, 1)
        if initial_state is not None and slot >= 0 and inplace_update:
            initial_state[slot] = h.transpose(-1, -2).to(initial_state.dtype)
    return o.to(q.dtype), None, None


def fused_sigmoid_gating_delta_rule_update_cpu(
        A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, initial_state_source: torch.Tensor,
        initial_state_indices: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
        scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
        softplus_beta: float = 1.0, softplus_threshold: float = 20.0, is_kda: bool = False,
        disable_state_update: bool = False, intermediate_states_buffer=None, **_unused):
    """Decode: gates from (A_log, a, dt_bias, b) fused with the token-by-token delta rule.
    q, k: [B, T, H, K] (decode: [1, tokens, H, K] with cu_seqlens); v [B, T, HV, V]; a, b: [tokens, HV];
    initial_state_source: the pool [slots, HV, V, K], updated in place unless disable_state_update.
    Returns o [B, T, HV, V] in q's dtype (SGLang's Triton version: [NK=1, *v.shape].squeeze(0))."""
    if is_kda or intermediate_states_buffer is not None:
        raise NotImplementedError("gdn_ops.fused_sigmoid_gating_delta_rule_update_cpu: KDA and "
                                  "speculative target-verify are not supported by the CPU stand-in")
    B, T, HV, K, V, qf, kf = _queries_and_keys(q, k, v, scale, use_qk_l2norm_in_kernel)
    qf, kf, vf = (t.reshape(B * T, HV, -1) for t in (qf, kf, v.float()))
    a2, b2 = a.float().reshape(B * T, HV), b.float().reshape(B * T, HV)
    g_all = -torch.exp(A_log.float()) * _softplus(a2 + dt_bias.float(), softplus_beta, softplus_threshold)
    beta_all = torch.sigmoid(b2)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    else:
        starts = torch.arange(B) * T
        lens = torch.full((B,), T, dtype=torch.long)
    N = starts.numel()
    slots = initial_state_indices[:N].long()
    valid = slots >= 0
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    h = initial_state_source[safe].float() * valid[:, None, None, None]   # [N, HV, V, K]
    o = torch.zeros(B * T, HV, V, dtype=torch.float32)
    for step in range(int(lens.max()) if N else 0):
        live = lens > step
        idx = (starts + step)[live]
        hs = h[live]
        hs = hs * g_all[idx].exp()[:, :, None, None]
        kv = (hs @ kf[idx].unsqueeze(-1)).squeeze(-1)                      # [n, HV, V]
        dv = (vf[idx] - kv) * beta_all[idx].unsqueeze(-1)
        hs = hs + dv.unsqueeze(-1) * kf[idx].unsqueeze(-2)
        o[idx] = (hs @ qf[idx].unsqueeze(-1)).squeeze(-1)
        h[live] = hs
    if not disable_state_update and bool(valid.any()):
        initial_state_source[slots[valid]] = h[valid].to(initial_state_source.dtype)
    return o.reshape(B, T, HV, V).to(q.dtype)


# --- gated RMSNorm ------------------------------------------------------------------------------

def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], activation: str = "swish",
                   residual: Optional[torch.Tensor] = None, prenorm: bool = False,
                   residual_in_fp32: bool = False, eps: float = 1e-6):
    """sglang.kernels.ops.attention.fla.fused_norm_gate.rms_norm_gated in torch:
    y = rmsnorm(x (+ residual)) * weight (+ bias), times silu(g) ("swish"/"silu") or sigmoid(g)."""
    shape, dtype = x.shape, x.dtype
    xf = x.reshape(-1, shape[-1]).float()
    if residual is not None:
        xf = xf + residual.reshape(-1, shape[-1]).float()
    residual_out = xf
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    gf = g.reshape(-1, shape[-1]).float()
    if activation in ("swish", "silu"):
        y = y * F.silu(gf)
    elif activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    else:
        raise ValueError(f"gdn_ops.rms_norm_gated: unsupported activation {activation!r}")
    y = y.to(dtype).reshape(shape)
    if not prenorm:
        return y
    return y, residual_out.to(torch.float32 if residual_in_fp32 else dtype).reshape(shape)


def install_torch_ops() -> None:
    """Make torch.ops.sgl_kernel.{fused_gdn_gating_cpu, fused_sigmoid_gating_delta_rule_update_cpu}
    resolve (SGLang looks them up at import, gdn_backend.py / gdn_triton.py)."""
    ns = torch.ops.sgl_kernel
    for fn in (fused_gdn_gating_cpu, fused_sigmoid_gating_delta_rule_update_cpu):
        setattr(ns, fn.__name__, fn)
