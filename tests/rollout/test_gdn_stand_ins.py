"""The torch forms of sgl-kernel's Gated DeltaNet CPU ops (rollout/in_server/cpu_stand_ins/gdn_ops.py), which
SGLang's Qwen3-Next calls on a CPU, against transformers' torch reference of each, on a batch of
sequences of 5, 70, 1 and 130 tokens (past the 64-token chunk) in SGLang's state pool layout: the
outputs, the states written back to their slots, and a slot no sequence names left untouched.
The server end to end: tests/model_specs/test_qwen3_next_serving.py."""
from __future__ import annotations

import torch
from transformers.models.qwen3_next import modeling_qwen3_next as M

from rollout.in_server.cpu_stand_ins import gdn_ops as G

LENS = [5, 70, 1, 130]
TOL = 1e-5


def _batch():
    g = torch.Generator().manual_seed(0)
    H, HV, K, V, T = 2, 4, 16, 16, sum(LENS)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), a=r(T, HV), b=r(T, HV),
                A_log=r(HV) * 0.5, dt_bias=r(HV), cu=cu, pool=r(6, HV, V, K) * 0.1,
                idx=torch.tensor([3, 1, 5, 0], dtype=torch.int32))


def test_gating_and_the_delta_rule_equal_transformers_in_prefill_and_decode():
    x = _batch()
    g, beta = G.fused_gdn_gating_cpu(x["A_log"], x["a"], x["b"], x["dt_bias"])
    want_g = -x["A_log"].exp() * torch.nn.functional.softplus(x["a"] + x["dt_bias"])
    assert (g[0] - want_g).abs().max() < TOL and (beta[0] - x["b"].sigmoid()).abs().max() < TOL
    chunk_pool, step_pool = x["pool"].clone(), x["pool"].clone()
    out, _, _ = G.chunk_gated_delta_rule_cpu(x["q"], x["k"], x["v"], g, beta, initial_state=chunk_pool,
                                             initial_state_indices=x["idx"], cu_seqlens=x["cu"],
                                             use_qk_l2norm_in_kernel=True)
    stepped = G.fused_sigmoid_gating_delta_rule_update_cpu(
        x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], step_pool, x["idx"],
        cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=True)
    bounds = zip(x["cu"][:-1].tolist(), x["cu"][1:].tolist())
    for i, (s, e) in enumerate(bounds):
        q, k = (x[n][:, s:e].repeat_interleave(2, 2) for n in ("q", "k"))
        h0 = x["pool"][x["idx"][i]].transpose(-1, -2)[None]               # SGLang keeps [V, K]
        want, state = M.torch_recurrent_gated_delta_rule(
            q, k, x["v"][:, s:e], g[:, s:e], beta[:, s:e], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        for o, pool in ((out, chunk_pool), (stepped, step_pool)):
            assert (o[:, s:e] - want).abs().max() < TOL, (i, s, e)
            assert (pool[x["idx"][i]] - state[0].transpose(-1, -2)).abs().max() < TOL
    assert torch.equal(chunk_pool[2], x["pool"][2]) and torch.equal(step_pool[4], x["pool"][4])


def test_causal_conv_and_its_decode_step_equal_transformers():
    x, dim, width = _batch(), 24, 4
    g = torch.Generator().manual_seed(1)
    seq = torch.randn(sum(LENS), dim, generator=g)
    w, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    states = torch.randn(6, dim, width - 1, generator=g)
    before = states.clone()
    has_initial = torch.tensor([False, True, True, False])
    out = G.causal_conv1d_fn_cpu(seq.T, w, bias, conv_states=states, query_start_loc=x["cu"],
                                 seq_lens_cpu=LENS, cache_indices=x["idx"],
                                 has_initial_state=has_initial, activation="silu").T
    for i, (s, e) in enumerate(zip(x["cu"][:-1].tolist(), x["cu"][1:].tolist())):
        left = before[x["idx"][i]] if has_initial[i] else torch.zeros(dim, width - 1)
        full = torch.cat([left, seq[s:e].T], 1)
        want = torch.stack([(full[:, t:t + width] * w).sum(-1) + bias for t in range(e - s)], 1)
        assert (out[s:e].T - torch.nn.functional.silu(want)).abs().max() < TOL
        assert torch.equal(states[x["idx"][i]], full[:, -(width - 1):])
    token = torch.randn(4, dim, generator=g)
    stepped = states.clone()
    got = G.causal_conv1d_update_cpu(token, stepped, w, bias, "silu", conv_state_indices=x["idx"])
    mine = states[x["idx"].long()].clone()
    want = M.causal_conv1d_update(token.unsqueeze(-1), mine, w, bias, activation="silu").squeeze(-1)
    assert (got - want).abs().max() < TOL and torch.equal(stepped[x["idx"].long()], mine)


def test_gated_norm_equals_transformers():
    g = torch.Generator().manual_seed(2)
    x, z, w = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g), torch.randn(16, generator=g)
    norm = M.Qwen3NextRMSNormGated(16, eps=1e-6)
    norm.weight.data = w
    assert (G.rms_norm_gated(x, z, w, None, "silu", eps=1e-6) - norm(x, z)).abs().max() < TOL
