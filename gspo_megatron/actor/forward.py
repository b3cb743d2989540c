"""Per-token log-probs on the last pipeline stage, and the driver of megatron's pipeline schedule.

Only activations cross pipeline stages: the last stage turns its output into per-token log-probs
of the given targets (vocab-parallel, never gathering the vocabulary) and hands them to a
`last_stage_fn(micro_batch, log_probs, entropy)` that reduces them there (to old log-probs kept on
that stage, or to the loss). Two ways to get the log-probs, chosen by `LogProbSettings.fused`:

- fused (default): the output layer is bypassed (`install_hidden_output`), the model
  returns the final-norm hidden states and `fused_token_logprobs` computes the log-probs chunk by
  chunk from them and the output weight: `[t, v/tp]` logits never exist in full.
- logits: the model's own output layer gives `[b, s, v/tp]` logits and
  `vocab_parallel_token_logprobs` reduces them.
Temperature divides the logits as SGLang does before its softmax.

Context parallelism (parallel.context > 1, TE attention on CUDA): run_schedule hands the model
each micro-batch's zig-zag chunks (batch.context_chunks); the last stage's log-probs are then of
the rank's chunks, at input positions (column p = log p(targets[p])), and the loss reduces its
per-sequence sums over the CP group (algorithms/rows.py; the scaling: steps.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from gspo_megatron.actor.batching.micro_batch import MicroBatch, context_chunks, pad_to_uniform_shape
from gspo_megatron.parallel.model_chunks import unwrap
from gspo_megatron.actor.logprobs import fused_token_logprobs, vocab_parallel_token_logprobs
from gspo_megatron.actor.batching.packing import rows_from_pack
from gspo_megatron.actor.settings import LogProbSettings


def install_hidden_output(chunks: list[torch.nn.Module]) -> None:
    """Let the last stage's output layer pass hidden states through while `return_hidden` is True.

    GPTModel then returns the final-norm hidden states `[b, s, h]` (`[b, s/tp, h]` under sequence
    parallelism) instead of logits. The parameters (and their names) stay untouched.
    """
    for chunk in chunks:
        model = unwrap(chunk)
        if not model.post_process or hasattr(model.output_layer, "return_hidden"):
            continue
        layer = model.output_layer
        original = layer.forward

        def forward(input_, weight=None, runtime_gather_output=None, _layer=layer, _orig=original):
            if _layer.return_hidden:
                return input_, None
            return _orig(input_, weight=weight, runtime_gather_output=runtime_gather_output)

        layer.return_hidden = True
        layer.forward = forward


def set_fused(chunks: list[torch.nn.Module], fused: bool) -> None:
    """Switch the last stage between the fused (hidden-state) and the logits path."""
    if fused:
        install_hidden_output(chunks)
    for chunk in chunks:
        model = unwrap(chunk)
        if model.post_process and hasattr(model.output_layer, "return_hidden"):
            model.output_layer.return_hidden = fused


def _tp_group():
    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def last_stage_log_probs(chunk: torch.nn.Module, output: torch.Tensor, mb: MicroBatch,
                         settings: LogProbSettings, with_entropy: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[m, s]` (differentiable) and entropies `[m, s]` (detached; zeros without
    with_entropy on the fused path) of the micro-batch's tokens, aligned to target positions
    (batch.py): column t is log p(tokens[:, t] | tokens[:, <t]), column 0 is 0. With
    `mb.targets` (a context-parallel rank's chunks) aligned to input positions instead: column p is
    log p(targets[:, p] | the row up to position p)."""
    model = unwrap(chunk)
    m, s = mb.tokens.shape
    targets = mb.targets if mb.targets is not None else torch.cat(
        [mb.tokens[:, 1:], torch.zeros_like(mb.tokens[:, :1])], dim=1)  # [m, s]
    if getattr(model.output_layer, "return_hidden", False):
        hidden = output  # [m, s, h] ([m, s/tp, h] under sequence parallelism)
        if model.config.sequence_parallel:
            # The fused function returns the TP-all-reduced gradient for `hidden`: the backward of
            # this gather must only take this rank's sequence slice (tensor_parallel_output_grad=False).
            hidden = gather_from_sequence_parallel_region(
                hidden.transpose(0, 1), tensor_parallel_output_grad=False).transpose(0, 1)  # [m, s, h]
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)  # [v/tp, h]
        # Float16Module hands the last stage's output back as fp32; the hidden states were computed
        # in the weight's dtype, so this cast is exact.
        hidden = hidden.to(weight.dtype)
        log_probs, entropy = fused_token_logprobs(
            hidden.reshape(m * s, -1), weight, targets.reshape(-1), temperature=settings.temperature,
            chunk_tokens=settings.chunk_tokens, chunk_memory_mb=settings.chunk_memory_mb,
            tp_group=_tp_group(), with_entropy=with_entropy)
    else:
        logits = output  # [m, s, v/tp]
        log_probs, entropy = vocab_parallel_token_logprobs(
            logits.reshape(m * s, -1), targets.reshape(-1), temperature=settings.temperature,
            tp_group=_tp_group())
    if mb.targets is not None:  # context parallel: stays at input positions (batch.context_chunks)
        return log_probs.view(m, s), entropy.view(m, s)
    # Position p predicts token p + 1: shift right so column t holds the log-prob of token t.
    zero = log_probs.new_zeros(m, 1)
    log_probs = torch.cat([zero, log_probs.view(m, s)[:, :-1]], dim=1)  # [m, s]
    entropy = torch.cat([zero, entropy.view(m, s)[:, :-1]], dim=1)  # [m, s]
    return log_probs, entropy


LastStageFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]
# Called on every stage right before a chunk runs a micro-batch (router_control.py: replay and records).
BeforeForward = Callable[[torch.nn.Module, MicroBatch], None]


def run_schedule(chunks: list[torch.nn.Module], mbs: list[MicroBatch], settings: LogProbSettings,
                 last_stage_fn: LastStageFn, *, forward_only: bool, with_entropy: bool = True,
                 before_forward: BeforeForward | None = None) -> list[dict]:
    """Run megatron's forward(-backward) schedule over the micro-batches of this rank.

    `last_stage_fn(mb, log_probs, entropy) -> (loss, report)` runs on the last stage per micro-batch;
    its loss follows the schedule's 2-tuple loss_func contract (see steps.py for the scaling).
    Returns the reports of the micro-batches this rank's last stage saw (empty on other stages).
    """
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def forward_step(data_iterator, model):
        mb = next(data_iterator).to(device)
        if before_forward is not None:
            before_forward(model, mb)
        if mb.packed is not None:  # one THD sequence (packing.py)
            output = model(mb.packed.tokens, mb.packed.position_ids, None,
                           packed_seq_params=mb.packed.seq_params())
        else:
            output = model(mb.tokens, mb.position_ids, None)

        def loss_func(output_tensor):
            if mb.packed is None:
                log_probs, entropy = last_stage_log_probs(model, output_tensor, mb, settings, with_entropy)
            else:  # the pack as one row, then each row's columns taken back out
                pack_view = dataclasses.replace(mb, tokens=mb.packed.tokens, packed=None)
                log_probs, entropy = last_stage_log_probs(model, output_tensor, pack_view, settings,
                                                          with_entropy)
                m, s = mb.tokens.shape
                log_probs = rows_from_pack(log_probs[0], mb.packed, m, s)
                entropy = rows_from_pack(entropy[0], mb.packed, m, s)
            return last_stage_fn(mb, log_probs, entropy)

        return output, loss_func

    config = unwrap(chunks[0]).config
    packed = any(mb.packed is not None for mb in mbs)
    if ps.get_pipeline_model_parallel_world_size() > 1 and not config.variable_seq_lengths:
        if packed:
            raise ValueError("packed sequences need variable_seq_lengths=True with pipeline parallelism")
        mbs = pad_to_uniform_shape(mbs)  # the schedule allocates one fixed shape (see build.py)
    # The schedule's seq_length is the full one (it divides by the CP size itself).
    seq_length = max((mb.packed or mb).tokens.shape[1] for mb in mbs)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        if packed:
            raise ValueError("packed sequences are not supported with context parallelism")
        mbs = [context_chunks(mb, ps.get_context_parallel_rank(), cp) for mb in mbs]
    vpp = len(chunks)
    data_iterator = [iter(mbs) for _ in chunks] if vpp > 1 else iter(mbs)
    if config.calculate_per_token_loss:
        raise ValueError("calculate_per_token_loss must be False (the actor scales the loss itself)")
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator,
        model=chunks if vpp > 1 else chunks[0], num_microbatches=len(mbs), seq_length=seq_length,
        micro_batch_size=max((mb.packed or mb).tokens.shape[0] for mb in mbs),
        forward_only=forward_only) or []


def seq_multiple() -> int:
    """Micro-batch sequence lengths must divide evenly between TP ranks under sequence parallelism,
    and into 2 x CP chunks whose CP share divides between the TP ranks under context parallelism."""
    cp = ps.get_context_parallel_world_size()
    return ps.get_tensor_model_parallel_world_size() * (2 * cp if cp > 1 else 1)


def is_last_stage_rank() -> bool:
    return ps.is_pipeline_last_stage(ignore_virtual=True)
