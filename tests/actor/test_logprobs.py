"""Token log-probs, one process (TP1): fused and straightforward paths against a dense log_softmax."""
import pytest
import torch

from gspo_megatron.actor.logprobs import fused_token_logprobs, vocab_parallel_token_logprobs


def make_inputs(t=23, h=16, v=61, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, targets


def dense_reference(hidden, weight, targets, temperature):
    """Full logits, log_softmax, gather: the straightforward computation, in fp64."""
    hidden = hidden.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    log_softmax = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    log_probs = log_softmax.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return hidden, weight, log_probs, entropy.detach()


def fused(hidden, weight, targets, temperature, chunk):
    return fused_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk)


def straightforward(hidden, weight, targets, temperature, chunk):
    return vocab_parallel_token_logprobs(hidden @ weight.t(), targets, temperature=temperature)


@pytest.mark.parametrize("path", [fused, straightforward])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", [1, 7, 23, 1024])  # 7 does not divide t = 23
def test_values_and_gradients_match_dense_fp32(path, temperature, chunk):
    hidden, weight, targets = make_inputs()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    log_probs, entropy = path(h, w, targets, temperature, chunk)
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == entropy.shape == (23,)
    assert not entropy.requires_grad
    ref_h, ref_w, ref_lp, ref_entropy = dense_reference(hidden, weight, targets, temperature)
    torch.testing.assert_close(log_probs.double(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    upstream = torch.randn(23, generator=torch.Generator().manual_seed(1))
    gh, gw = torch.autograd.grad((log_probs * upstream).sum(), (h, w))
    rgh, rgw = torch.autograd.grad((ref_lp * upstream.double()).sum(), (ref_h, ref_w))
    torch.testing.assert_close(gh.double(), rgh, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw.double(), rgw, atol=1e-5, rtol=0)


def test_fused_gradcheck_fp64():
    hidden, weight, targets = make_inputs(t=9, h=5, v=13, dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda h, w: fused_token_logprobs(h, w, targets, temperature=0.7, chunk_tokens=4)[0],
        (hidden.requires_grad_(True), weight.requires_grad_(True)))


def test_only_the_needed_gradient_is_computed():
    hidden, weight, targets = make_inputs()
    w = weight.clone().requires_grad_(True)
    fused_token_logprobs(hidden, w, targets, chunk_tokens=5)[0].sum().backward()
    _, ref_w, ref_lp, _ = dense_reference(hidden, weight, targets, 1.0)
    ref_lp.sum().backward()
    torch.testing.assert_close(w.grad.double(), ref_w.grad, atol=1e-5, rtol=0)
    h = hidden.clone().requires_grad_(True)
    fused_token_logprobs(h, weight, targets, chunk_tokens=5)[0].sum().backward()
    assert h.grad is not None and weight.grad is None


def test_bf16_inputs_fp32_outputs():
    hidden, weight, targets = make_inputs(t=40, h=32, v=64)
    hb = hidden.bfloat16().requires_grad_(True)
    wb = weight.bfloat16().requires_grad_(True)
    log_probs, entropy = fused_token_logprobs(hb, wb, targets, temperature=0.8, chunk_tokens=16)
    assert log_probs.dtype == entropy.dtype == torch.float32
    log_probs.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    # Same bf16 GEMM as the straightforward path, everything after it fp32: close to the fp64 answer
    # on the bf16-rounded inputs within the bf16 rounding of the logits.
    ref_h, ref_w, ref_lp, _ = dense_reference(hb, wb, targets, 0.8)
    torch.testing.assert_close(log_probs.double(), ref_lp.detach(), atol=0.1, rtol=0)
    ref_lp.sum().backward()
    torch.testing.assert_close(wb.grad.double(), ref_w.grad, atol=0.1, rtol=0.05)
    h2 = hb.detach().clone().requires_grad_(True)
    lp2, _ = vocab_parallel_token_logprobs(h2 @ wb.detach().t(), targets, temperature=0.8)
    torch.testing.assert_close(log_probs, lp2, atol=2e-2, rtol=0)


def test_fused_keeps_only_per_token_scalars_between_forward_and_backward():
    """What autograd holds for backward: the inputs themselves plus O(t) scalars, never logits."""
    hidden, weight, targets = make_inputs(t=300, h=8, v=500)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        log_probs, _ = fused_token_logprobs(h, w, targets, chunk_tokens=64)
    others = [x for x in saved if x.data_ptr() not in (h.data_ptr(), w.data_ptr())]
    assert all(x.numel() <= 300 for x in others), [tuple(x.shape) for x in others]
    assert sum(x.numel() for x in others) <= 3 * 300


def test_out_of_range_targets_are_finite_and_masked_away():
    hidden, weight, targets = make_inputs()
    targets[[0, 5]] = -100
    h = hidden.clone().requires_grad_(True)
    for path in (fused, straightforward):
        log_probs, entropy = path(h, weight, targets, 1.0, 4)
        assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
        keep = targets >= 0
        (g,) = torch.autograd.grad(torch.where(keep, log_probs, 0).sum(), h)
        ref_h, _, ref_lp, _ = dense_reference(hidden, weight, targets.clamp(min=0), 1.0)
        (rg,) = torch.autograd.grad(torch.where(keep, ref_lp, 0).sum(), ref_h)
        torch.testing.assert_close(g.double(), rg, atol=1e-5, rtol=0)


def test_zero_tokens():
    hidden, weight, targets = make_inputs(t=0)
    h = hidden.clone().requires_grad_(True)
    log_probs, entropy = fused_token_logprobs(h, weight, targets)
    assert log_probs.shape == entropy.shape == (0,)
    log_probs.sum().backward()
    assert h.grad.shape == (0, 16)


def test_bad_input_errors():
    hidden, weight, targets = make_inputs()
    with pytest.raises(ValueError, match=r"output_weight \[v/tp, h\], got \(23, 16\) and \(61, 8\)"):
        fused_token_logprobs(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match=r"targets have shape \(22,\), expected \(23,\)"):
        fused_token_logprobs(hidden, weight, targets[:22])
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        fused_token_logprobs(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        vocab_parallel_token_logprobs(hidden @ weight.t(), targets, temperature=0)
    with pytest.raises(ValueError, match="bfloat16"):
        fused_token_logprobs(hidden.bfloat16(), weight, targets)


def test_without_entropy_values_and_gradients_are_unchanged():
    """with_entropy=False (the train step after a recomputed pi_old) skips one pass per chunk:
    the same log-probs and gradients, zero entropies."""
    hidden, weight, targets = make_inputs()
    outs = []
    for with_entropy in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fused_token_logprobs(h, w, targets, temperature=0.8, chunk_tokens=7,
                                       with_entropy=with_entropy)
        (lp * torch.arange(lp.numel())).sum().backward()
        outs.append((lp.detach(), ent, h.grad, w.grad))
    (lp1, ent1, gh1, gw1), (lp2, ent2, gh2, gw2) = outs
    assert torch.equal(lp1, lp2) and torch.equal(gh1, gh2) and torch.equal(gw1, gw2)
    assert float(ent1.abs().min()) > 0 and not ent2.any()


def test_default_chunk_follows_the_memory_budget():
    from gspo_megatron.actor.logprobs import default_chunk_tokens
    assert default_chunk_tokens(151936, 1024) == (1024 << 20) // (151936 * 8)  # ~883 tokens
    assert default_chunk_tokens(151936 // 8, 1024) == (1024 << 20) // (18992 * 8)
    assert default_chunk_tokens(10 ** 9, 1) == 64  # never below 64 tokens
    hidden, weight, targets = make_inputs()
    a, _ = fused_token_logprobs(hidden, weight, targets, chunk_tokens=None, chunk_memory_mb=1)
    b, _ = fused_token_logprobs(hidden, weight, targets, chunk_tokens=5)
    assert float((a - b).abs().max()) < 1e-6
