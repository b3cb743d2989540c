"""The importance-ratio probe of benchmarks/moe_stability.py: what one step's updates do to the
token-level and the sequence-level importance ratios, against response length. It does not need
the routing to move as much as the paper's (about 10% of the experts per update): it measures the
noise a ratio carries into the loss, whatever its source.

For a run that kept its last two checkpoints (steps N-1 and N: `checkpoint_sets`), both policies
are exported to HF and loaded in transformers. Responses are sampled from pi_{N-1} (the policy of
the last step's rollouts) at temperature 1 for the first prompts of the task, and each trained
token's log-ratio `l_t = log pi_N(y_t) - log pi_{N-1}(y_t)` is computed, each policy routing with
its own router (so a route change counts, as it does for GRPO without replay). Per response:

    token ratios  w_t = exp(l_t)              GRPO's, one per token; clipped outside [0.8, 1.27]
    sequence ratio s  = exp(mean_t l_t)       GSPO's (Eq. 7); clipped outside [1 - 3e-4, 1 + 4e-4]

The paper's argument (§3) is that token ratios are single samples of a per-token correction: their
variance does not shrink with length, while the sequence ratio's does (about 1/L for independent
l_t). `summarise` puts the two side by side per length bin.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

GRPO_CLIP = (0.2, 0.27)   # gspo_megatron/algorithms/registry.py: the paper's GRPO clip
GSPO_CLIP = (3e-4, 4e-4)  # the paper's GSPO clip
BINS = (1, 16, 32, 64, 128, 256)  # response length bins: [1, 16), [16, 32), ..., [256, inf)


def checkpoint_sets(ckpt: Path, steps: int) -> list[str]:
    """Overrides that keep exactly the checkpoints of steps N-1 and N (the trainer saves at every
    multiple of checkpoint.interval and at the last step)."""
    return [f"checkpoint.dir={ckpt}", f"checkpoint.interval={max(1, steps - 1)}", "checkpoint.keep=2"]


def probe(ckpt: Path, prompts: list[dict], *, seed: int, samples: int, max_new_tokens: int) -> list[list[float]]:
    """Per sampled response [L, sum l, sum l^2, sum w, sum w^2, tokens outside GRPO's clip] for the
    last two checkpoints under `ckpt`; the HF exports are made under `ckpt` and removed with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from gspo_megatron.checkpoint.export import convert_megatron_to_hf
    from gspo_megatron.run.expected_warnings import quiet_expected_warnings
    from rollout.prompts.dataset import chat_prompt_ids
    quiet_expected_warnings()
    steps = sorted(p for p in ckpt.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    if len(steps) < 2:
        raise SystemExit(f"[bench] ratio probe: {ckpt} holds {len(steps)} checkpoint(s), expected the last two")
    old_dir, new_dir = (convert_megatron_to_hf(s / "model", ckpt / f"hf_{s.name}") for s in steps[-2:])
    tok = AutoTokenizer.from_pretrained(str(old_dir))
    old = AutoModelForCausalLM.from_pretrained(str(old_dir), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(new_dir), dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos, int):
        raise ValueError(f"<|im_end|> is not one token of this tokenizer: {eos!r}")
    torch.manual_seed(seed)
    rows = []
    for rec in prompts:
        prompt = chat_prompt_ids(tok, rec)
        with torch.no_grad():
            out = old.generate(torch.tensor([prompt] * samples), attention_mask=torch.ones(samples, len(prompt), dtype=torch.long),
                               do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                               eos_token_id=eos, pad_token_id=eos)  # [samples, prompt + new]
            responses = [_trim(r[len(prompt):].tolist(), eos) for r in out]
            for resp in responses:
                ids = torch.tensor([prompt + resp])
                lo, ln = (_token_log_probs(m, ids, len(prompt)) for m in (old, new))
                l = (ln - lo).double()  # [L]
                w = l.exp()
                outside = ((w < 1 - GRPO_CLIP[0]) | (w > 1 + GRPO_CLIP[1])).sum().item()
                rows.append([len(resp), l.sum().item(), (l * l).sum().item(), w.sum().item(),
                             (w * w).sum().item(), outside])
    shutil.rmtree(old_dir)
    shutil.rmtree(new_dir)
    return rows


def _trim(ids: list[int], eos: int) -> list[int]:
    """The response up to and including its EOS (a trained token, as in the rollouts)."""
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _token_log_probs(model, ids, prompt_len: int):
    import torch
    logits = model(ids).logits[0, prompt_len - 1:-1].float()  # [L, vocab]: position p predicts p + 1
    return torch.log_softmax(logits, -1).gather(-1, ids[0, prompt_len:, None])[:, 0]


def save(rows: list[list[float]], path: Path) -> None:
    path.write_text(json.dumps(rows) + "\n")


def summarise(rows_by_arm: dict[str, list[list[float]]]) -> str:
    """Per arm and response length bin: responses, the std of the token ratio (over tokens) and of
    the sequence ratio (over responses), their quotient, and the share outside each loss's clip
    range (tokens outside GRPO's, responses outside GSPO's)."""
    lines = ["| arm | length | responses | tokens | std token ratio | std sequence ratio | token / sequence | "
             "tokens outside GRPO's clip | responses outside GSPO's clip |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, rows in rows_by_arm.items():
        for lo, hi in zip(BINS, BINS[1:] + (math.inf,)):
            sel = [r for r in rows if lo <= r[0] < hi]
            if len(sel) < 5:
                continue
            n_tok = sum(r[0] for r in sel)
            tok_mean = sum(r[3] for r in sel) / n_tok
            tok_std = max(sum(r[4] for r in sel) / n_tok - tok_mean ** 2, 0.0) ** 0.5
            seq = [math.exp(r[1] / r[0]) for r in sel]
            seq_mean = sum(seq) / len(seq)
            seq_std = (sum((s - seq_mean) ** 2 for s in seq) / max(len(seq) - 1, 1)) ** 0.5
            out_seq = sum(not (1 - GSPO_CLIP[0] <= s <= 1 + GSPO_CLIP[1]) for s in seq) / len(seq)
            quotient = f"{tok_std / seq_std:.1f}" if seq_std > 0 else "-"
            span = f"{lo}-{hi - 1}" if hi != math.inf else f"{lo}+"
            lines.append(f"| {arm} | {span} | {len(sel)} | {n_tok} | {tok_std:.3g} | {seq_std:.3g} | {quotient} | "
                         f"{sum(r[5] for r in sel) / n_tok:.4f} | {out_seq:.3f} |")
    return "\n".join(lines)
