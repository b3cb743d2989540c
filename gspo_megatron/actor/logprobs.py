"""Per-token log-probs (and entropies) of given targets from a vocab-parallel output layer.

Two paths with the same results (tests/actor/test_logprobs*.py hold them to 1e-5 of a dense log_softmax):

- `vocab_parallel_token_logprobs(logits, targets)`: the straightforward one, from logits that exist
  as a tensor `[t, v/tp]`; plain autograd.
- `fused_token_logprobs(hidden, output_weight, targets)`: never materialises more than one chunk of
  `[chunk_tokens, v/tp]` logits. Forward keeps only per-token scalars (log-sum-exp), backward
  recomputes each chunk's logits. The peak extra memory is O(chunk_tokens * v/tp + t), independent
  of the number of tokens `t` (benchmarks/logprobs_memory.py measures it).

Vocab sharding is megatron's: TP rank r holds vocab ids [r * v/tp, (r + 1) * v/tp) (the padded
vocab divides evenly). Targets are global ids; a target outside [0, v) (a pad id such as -100) gets
a finite, meaningless log-prob: mask it in the loss, which then gives it zero gradient.

Temperature divides the logits before the softmax: SGLang reports log-probs of the distribution it
sampled from, i.e. of softmax(logits / T), and the trainer must compare at the same T.

`tp_group=None` means no tensor parallelism (nothing is communicated), not the default group.
All softmax arithmetic is fp32 whatever the input dtype (fp64 inputs stay fp64, for tests); the logits GEMM runs in the input dtype
(fp32 accumulation inside the GEMM, as megatron's output layer does) and is cast to fp32 at once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_size_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _local_targets(targets: torch.Tensor, tp_rank: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global target ids -> (index into this rank's shard, clamped to a valid one; whether it is here)."""
    local = targets.long() - tp_rank * vocab_local
    in_shard = (local >= 0) & (local < vocab_local)
    return torch.where(in_shard, local, 0), in_shard


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs; fp64 stays fp64 (finite-difference tests)."""
    return torch.promote_types(dtype, torch.float32)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group in forward; identity in backward.

    Every TP rank goes on to compute the same (replicated) loss from the sum, so the gradient each
    rank receives for the sum is already the full one: passing it through unchanged is exact (the
    same as megatron's reduce_from_tensor_model_parallel_region). torch.distributed.nn's all_reduce
    would sum the gradients too and scale them by the TP size.
    """

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                                  tp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T), per token.

    logits: `[t, v/tp]`, this rank's vocab shard; targets: `[t]` global ids. Returns fp32 `[t]`
    log-probs (differentiable; the gradient to `logits` is exact on every TP rank) and fp32 `[t]`
    entropies, which are DETACHED (a metric).
    """
    _check_temperature(temperature)
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"need logits [t, v/tp] and targets [t], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    tp_size, tp_rank = _tp_size_rank(tp_group)

    def tp_sum(x):
        return _AllReduceSum.apply(x, tp_group) if tp_size > 1 else x

    z = logits.to(_acc_dtype(logits.dtype))  # [t, v/tp]
    if temperature != 1.0:
        z = z / temperature
    # The max only shifts for stability: any constant gives the same value and gradient, so it
    # is detached.
    z_max = z.detach().max(dim=-1).values  # [t]
    if tp_size > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - z_max[:, None]  # [t, v/tp]
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))  # [t]
    local_t, in_shard = _local_targets(targets, tp_rank, z.shape[-1])
    target = tp_sum(torch.where(in_shard, shifted.gather(-1, local_t[:, None]).squeeze(-1), 0))  # [t]
    log_sum_exp = sum_exp.log()
    log_probs = target - log_sum_exp
    with torch.no_grad():
        # H = log S - sum_v e^(z - M) (z - M) / S
        weighted = (exp * shifted).sum(dim=-1)
        if tp_size > 1:
            dist.all_reduce(weighted, group=tp_group)
        entropy = log_sum_exp - weighted / sum_exp
    return log_probs, entropy


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = torch.mm(hidden, weight.t())  # [c, v/tp], input dtype, fp32 accumulation in the GEMM
    z = z.to(_acc_dtype(z.dtype))
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens, tp_group, with_entropy):
        tp_size, tp_rank = _tp_size_rank(tp_group)
        t = hidden.shape[0]
        local_t, in_shard = _local_targets(targets, tp_rank, weight.shape[0])
        # Per token, over this rank's shard: max m, S = sum e^(z-m), Q = sum e^(z-m) (z-m), z_target.
        stats = torch.empty(4, t, dtype=_acc_dtype(hidden.dtype), device=hidden.device)
        for start in range(0, t, chunk_tokens):
            sl = slice(start, min(start + chunk_tokens, t))
            z = _chunk_logits(hidden[sl], weight, temperature)  # [c, v/tp] fp32
            m, S, Q, z_target = stats[:, sl]
            z_target.copy_(z.gather(1, local_t[sl, None]).squeeze(1))
            torch.amax(z, dim=1, out=m)
            z.sub_(m[:, None])
            e = torch.exp(z)
            torch.sum(e, dim=1, out=S)
            if with_entropy:  # one more pass over the chunk; skipped when nobody reads it
                torch.sum(e.mul_(z), dim=1, out=Q)
            del z, e
        if not with_entropy:
            stats[2].zero_()
        m, S, Q, z_target = stats
        z_target = torch.where(in_shard, z_target, 0)
        if tp_size > 1:
            # Combine the shards: M = max_r m_r, then rescale each rank's sums by e^(m_r - M).
            M = m.clone()
            dist.all_reduce(M, op=dist.ReduceOp.MAX, group=tp_group)
            a = torch.exp(m - M)
            sums = torch.stack([a * S, a * (Q + (m - M) * S), z_target])  # [3, t]
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
            S, Q, z_target = sums
            m = M
        log_S = S.log()
        log_sum_exp = m + log_S  # [t]
        log_probs = z_target - log_sum_exp
        entropy = log_S - Q / S if with_entropy else torch.zeros_like(log_S)
        ctx.save_for_backward(hidden, weight, local_t, in_shard, log_sum_exp)
        ctx.temperature, ctx.chunk_tokens, ctx.tp_group, ctx.tp_size = temperature, chunk_tokens, tp_group, tp_size
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        hidden, weight, local_t, in_shard, log_sum_exp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        t, chunk, temperature = hidden.shape[0], ctx.chunk_tokens, ctx.temperature
        acc = _acc_dtype(hidden.dtype)
        grad_log_probs = grad_log_probs.to(acc)
        grad = torch.where(in_shard, grad_log_probs, 0)  # [t], the one-hot part lives on one rank
        # fp32 accumulators: hidden's gradient is all-reduced over TP, weight's summed over chunks.
        grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        for start in range(0, t, chunk):
            sl = slice(start, min(start + chunk, t))
            z = _chunk_logits(hidden[sl], weight, temperature)  # [c, v/tp]
            # d log p_target / d z = onehot(target) - softmax(z): dz = g (onehot - p), then / T.
            dz = z.sub_(log_sum_exp[sl, None]).exp_().mul_(-grad_log_probs[sl, None])
            dz.scatter_add_(1, local_t[sl, None], grad[sl, None])
            if temperature != 1.0:
                dz.div_(temperature)
            dz = dz.to(weight.dtype)
            if grad_hidden is not None:
                if hidden.dtype == acc:
                    torch.mm(dz, weight, out=grad_hidden[sl])
                else:
                    grad_hidden[sl] = torch.mm(dz, weight)
            if grad_weight is not None:
                if weight.dtype == acc:
                    grad_weight.addmm_(dz.t(), hidden[sl])
                else:
                    grad_weight += torch.mm(dz.t(), hidden[sl])
            del z, dz
        if grad_hidden is not None:
            if ctx.tp_size > 1:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def default_chunk_tokens(vocab_local: int, memory_mb: int) -> int:
    """Tokens per chunk such that a chunk's fp32 logits and their exp ([c, v/tp] twice) fit in
    `memory_mb`: the larger the chunk, the fewer (and larger, faster) GEMMs; the memory stays flat
    in the number of tokens."""
    return max(64, (memory_mb << 20) // (vocab_local * 4 * 2))


def fused_token_logprobs(hidden: torch.Tensor, output_weight: torch.Tensor, targets: torch.Tensor, *,
                         temperature: float = 1.0, chunk_tokens: int | None = 1024,
                         chunk_memory_mb: int = 1024, tp_group: dist.ProcessGroup | None = None,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs and entropies from hidden states and the vocab-parallel output weight.

    hidden: `[t, h]`, the same on every rank of `tp_group` (gathered first under sequence
    parallelism); output_weight: `[v/tp, h]`, this rank's shard; targets: `[t]` global ids.
    Returns fp32 `[t]` log-probs of `softmax(hidden @ W^T / T)` at the targets and fp32 `[t]`
    entropies (DETACHED: a metric, not differentiable; zeros with with_entropy=False, which saves a
    pass over each chunk). Logits are computed `chunk_tokens` tokens at a time (None: as many as
    fit in `chunk_memory_mb`, default_chunk_tokens) in forward and again in backward; only O(t)
    scalars are kept in between.

    Gradient contract: the gradient returned for `hidden` is already ALL-REDUCED over `tp_group`
    (the full gradient, as megatron's copy_to_tensor_model_parallel_region would produce). So do
    not wrap `hidden` in copy_to_tensor_model_parallel_region; under sequence parallelism gather it
    with gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False), whose
    backward only takes this rank's slice. The gradient for `output_weight` is this rank's shard's.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or output_weight.dim() != 2 or hidden.shape[1] != output_weight.shape[1]:
        raise ValueError(f"need hidden [t, h] and output_weight [v/tp, h], got {tuple(hidden.shape)} "
                         f"and {tuple(output_weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected ({hidden.shape[0]},)")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(output_weight.shape[0], chunk_memory_mb)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dtype != output_weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but output_weight is {output_weight.dtype}")
    return _FusedTokenLogProbs.apply(hidden, output_weight, targets, float(temperature), int(chunk_tokens),
                                     tp_group, bool(with_entropy))
