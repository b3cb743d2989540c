"""Token log-probs with the vocab split over a real gloo TP group: TP2 (two TP groups, DP2 x TP2 on
4 ranks, so a rank's index within its TP group differs from its global rank) against one dense
process. Targets fall in both shards."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from gspo_megatron.actor.logprobs import fused_token_logprobs, vocab_parallel_token_logprobs

pytestmark = pytest.mark.mcore019  # also run against megatron-core 0.19.2 (scripts/test.sh)

T, H, V = 23, 12, 2 * 37
CASES = [(1.0, 5), (0.6, 7), (1.3, 64)]  # (temperature, chunk_tokens): 5 and 7 do not divide 23


def inputs(dp_rank):
    g = torch.Generator().manual_seed(100 + dp_rank)  # each TP group its own data
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (T,), generator=g)
    targets[:3] = torch.tensor([0, V // 2 - 1, V // 2])  # shard edges
    upstream = torch.randn(T, generator=g)
    return hidden, weight, targets, upstream


def _tp2_rank(rank, world_size):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_rank, tp_rank = divmod(rank, 2)
    group = groups[dp_rank]
    hidden, weight, targets, upstream = inputs(dp_rank)
    shard = weight[tp_rank * V // 2:(tp_rank + 1) * V // 2]
    out = {}
    for temperature, chunk in CASES:
        h = hidden.clone().requires_grad_(True)
        w = shard.clone().requires_grad_(True)
        lp, ent = fused_token_logprobs(h, w, targets, temperature=temperature, chunk_tokens=chunk, tp_group=group)
        gh, gw = torch.autograd.grad((lp * upstream).sum(), (h, w))
        logits = (hidden @ shard.t()).requires_grad_(True)
        lp2, ent2 = vocab_parallel_token_logprobs(logits, targets, temperature=temperature, tp_group=group)
        (glogits,) = torch.autograd.grad((lp2 * upstream).sum(), logits)
        out[temperature] = dict(fused=(lp, ent, gh, gw), straight=(lp2, ent2, glogits))
    # numpy: pickled by value (torch tensors would travel as shared-memory handles, which die with
    # the rank's process before the parent unpickles them)
    return {k: {p: [x.detach().numpy() for x in v] for p, v in d.items()} for k, d in out.items()}


@pytest.mark.slow
def test_logprobs_tp2_matches_one_process():
    results = run_distributed(_tp2_rank, 4, timeout=240)
    for rank, out in enumerate(results):
        dp_rank, tp_rank = divmod(rank, 2)
        hidden, weight, targets, upstream = inputs(dp_rank)
        rows = slice(tp_rank * V // 2, (tp_rank + 1) * V // 2)
        for temperature, _ in CASES:
            h = hidden.double().requires_grad_(True)
            w = weight.double().requires_grad_(True)
            logits = (h @ w.t() / temperature)
            logits.retain_grad()
            log_softmax = torch.log_softmax(logits, -1)
            ref_lp = log_softmax.gather(1, targets[:, None]).squeeze(1)
            ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
            (ref_lp * upstream.double()).sum().backward()
            lp, ent, gh, gw = map(torch.from_numpy, out[temperature]["fused"])
            close = dict(atol=1e-5, rtol=0)
            torch.testing.assert_close(lp.double(), ref_lp.detach(), **close)
            torch.testing.assert_close(ent.double(), ref_ent.detach(), **close)
            torch.testing.assert_close(gh.double(), h.grad, **close)  # already all-reduced over TP
            torch.testing.assert_close(gw.double(), w.grad[rows], **close)
            lp2, ent2, glogits = map(torch.from_numpy, out[temperature]["straight"])
            torch.testing.assert_close(lp2.double(), ref_lp.detach(), **close)
            torch.testing.assert_close(ent2.double(), ref_ent.detach(), **close)
            # d/d raw logits = d/d (logits / T) / T
            torch.testing.assert_close(glogits.double(), logits.grad[:, rows] / temperature, **close)
