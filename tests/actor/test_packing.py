"""Packed micro-batches (actor/batching/packing.py): the pack's per-token values taken back into the rows'
target-aligned layout equal what the rows compute unpacked. A causal toy model that sees only its
own segment (what THD attention does with cu_seqlens) stands in for the transformer: megatron's
local attention (the only one on CPU) refuses packed sequences, so the model side is checked on a
GPU by tools/gpu_check.py (packed vs unpacked log-probs, TE spec)."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.actor.batching.packing import pack, rows_from_pack

V = 50


def _toy_logits(tokens: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """[T, V] logits of a causal toy model: position p sees the tokens of its own segment up to p
    (a running sum of one-hots, restarted per segment), and its position within the segment."""
    emb = torch.nn.functional.one_hot(tokens, V).double()
    out = torch.zeros_like(emb)
    for a, b in segments:
        out[a:b] = emb[a:b].cumsum(0) * (1 + torch.arange(b - a, dtype=torch.double)[:, None] / 7)
    return out.sin() * 3


def _target_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Column t: log p(token t | before it), column 0: 0 (the actor's alignment)."""
    lp = torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])


def test_pack_layout_and_segments():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    p = pack(tokens, torch.tensor([3, 2, 4]), multiple=4)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9, 12] and p.starts.tolist() == [0, 3, 5]
    assert p.max_seqlen == 4
    filler = pack(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), multiple=2)
    assert filler.tokens.shape == (1, 2) and filler.cu_seqlens.tolist() == [0, 2]


def test_rows_from_pack_equals_the_unpacked_rows():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 1, 14, 5, 0])  # a one-token row and a filler
    m, s = len(lengths), 16
    tokens = torch.randint(1, V, (m, s), generator=g)
    p = pack(tokens, lengths, multiple=8)
    bounds = p.cu_seqlens.tolist()
    segments = list(zip(bounds[:-1], bounds[1:]))
    packed_lp = _target_log_probs(_toy_logits(p.tokens[0], segments), p.tokens[0])
    rows = rows_from_pack(packed_lp, p, m, s)
    for i, n in enumerate(lengths.tolist()):
        want = torch.zeros(s, dtype=torch.double)
        if n:
            want[:n] = _target_log_probs(_toy_logits(tokens[i, :n], [(0, n)]), tokens[i, :n])
        assert torch.allclose(rows[i], want, atol=1e-12), i
    # Gradients flow back to the pack's columns each row uses, and only those.
    values = packed_lp.clone().requires_grad_(True)
    rows_from_pack(values, p, m, s).sum().backward()
    used = torch.zeros_like(values)
    for start, n in zip(p.starts.tolist(), lengths.tolist()):
        used[start + 1:start + n] = 1
    assert torch.equal(values.grad, used)


def test_resolve_packing_packs_where_it_runs_and_refuses_where_it_does_not():
    from gspo_megatron.actor.batching.packing import resolve_packing
    gpu = dict(te_on_cuda=True, context=1, half=True, te_version="2.20.2+cu13")
    assert resolve_packing(None, **gpu) and resolve_packing(True, **gpu)
    assert not resolve_packing(False, **gpu)
    # fp32: only a TE whose unfused attention takes THD (2.11+); older ones silently pad by default
    assert resolve_packing(None, **{**gpu, "half": False, "te_version": "2.11.0.dev0+abc"})
    assert not resolve_packing(None, **{**gpu, "half": False, "te_version": "2.10.0"})
    assert resolve_packing(None, **{**gpu, "te_version": "2.10.0"})  # bf16 runs on flash attention
    cases = {
        "needs the Transformer Engine layer spec on CUDA": dict(gpu, te_on_cuda=False, te_version=None),
        "is not supported with parallel.context > 1": dict(gpu, context=2),
        r"with fp32 parameters needs Transformer Engine >= 2.11 \(found 2.9.1": dict(gpu, half=False, te_version="2.9.1"),
    }
    for message, where in cases.items():
        assert not resolve_packing(None, **where) and not resolve_packing(False, **where)
        with pytest.raises(ValueError, match=f"^pack_sequences=True {message}"):
            resolve_packing(True, **where)
    # Qwen3-Next's Gated DeltaNet takes packed sequences from megatron-core 0.19 on
    from gspo_megatron.actor.batching.packing import _mcore_version
    if _mcore_version().startswith("0.16"):
        assert not resolve_packing(None, **gpu, linear_attention=True)
        with pytest.raises(ValueError, match="for Gated DeltaNet layers .* megatron-core 0.16"):
            resolve_packing(True, **gpu, linear_attention=True)
    else:
        assert resolve_packing(None, **gpu, linear_attention=True)


def test_the_actor_refuses_packing_on_this_machine():
    """Before any process group or model exists: one line naming the setting."""
    from fixtures_models import tiny_model_dir
    from gspo_megatron.actor import Actor
    from gspo_megatron.actor.settings import MicroBatchSettings
    from gspo_megatron.parallel.layout import ParallelLayout
    with pytest.raises(ValueError, match="^pack_sequences=True needs the Transformer Engine layer spec on CUDA"):
        Actor(str(tiny_model_dir("qwen3_moe", 0)), ParallelLayout(),
              batching=MicroBatchSettings(pack_sequences=True))


def test_run_config_asking_for_packing_here_fails_at_start(capsys, tmp_path):
    from fixtures_models import tiny_model_dir
    from gspo_megatron.cli import main
    assert main(["train", "examples/tiny_moe_larger_digit.yaml", "--set",
                 f"model.hf_path={tiny_model_dir('qwen3_moe', 0)}", "--set",
                 f"checkpoint.dir={tmp_path / 'ck'}", "--set", "train.pack_sequences=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gspo-megatron: error: train.pack_sequences=True needs the Transformer Engine "
                              "layer spec on CUDA"), err[-1]
    assert not (tmp_path / "ck").exists()
