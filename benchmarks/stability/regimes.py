"""The regimes and arms of benchmarks/moe_stability.py (docs/moe_stability.md says why each value).

A regime fixes everything but the loss: the task, the model, the warm start, the steps and the
optimizer settings, the arms it runs by default and its pilot seed (where its settings were
searched: never one of the reported seeds 0..N-1). An arm is the overrides that make one loss.
"""
from __future__ import annotations

import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GSPO_CLIP = (3e-4, 4e-4)  # gspo_megatron/algorithms/registry.py: the paper's


@dataclass(frozen=True)
class Regime:
    name: str
    summary: str
    config: str
    """The run config every arm starts from (examples/)."""
    task: Callable[[Path, int], None]
    """Writes the seed's task into a folder: train.jsonl (its order shuffled with the seed), then
    eval.jsonl (held out; its presence marks the folder done)."""
    layers: int
    experts: int
    """The tiny Qwen3-MoE's shape (tools/make_tiny_model.py, top-2), initialised with the seed."""
    steps: int
    warm_start_steps: int
    eval_interval: int
    """Held-out eval every N steps (0: none; N = steps: at the start and the end)."""
    sets: tuple[str, ...]
    """Overrides of every run of the regime (the warm start's and every arm's)."""
    arms: tuple[str, ...]
    pilot_seed: int
    probe: bool
    """Keep each run's last two checkpoints and measure the importance ratios (stability/ratios.py)."""
    max_new_tokens: int


def counting_task(folder: Path, seed: int) -> None:
    """The counting task (tools/make_counting_task.py): long worked-out responses, about 80 tokens."""
    from tools.make_counting_task import make_counting_task
    make_counting_task(folder, seed=seed)


def larger_digit_task(folder: Path, seed: int) -> None:
    """The main job's task (tools/make_larger_digit_task.py): its 360 training rows in an order
    shuffled with the seed, its 360 held-out rows (phrasings training never shows) as they are."""
    from tools.make_larger_digit_task import make_larger_digit_task
    paths = make_larger_digit_task(folder / "source")
    rows = paths["larger_digit_rl"].read_text().splitlines(keepends=True)
    random.Random(seed).shuffle(rows)
    (folder / "train.jsonl").write_text("".join(rows))
    paths["larger_digit_rl_eval"].replace(folder / "eval.jsonl")
    shutil.rmtree(folder / "source")


REGIMES = {r.name: r for r in (
    Regime("collapse", "the first experiment: lr 1e-3, where routing moves as in the paper and every arm "
           "degrades", config="examples/tiny_moe_counting.yaml", task=counting_task, layers=4, experts=16, steps=20,
           warm_start_steps=500, eval_interval=0, sets=(), arms=("gspo", "grpo", "grpo_r3", "gspo_token", "grpo_seqclip"),
           pilot_seed=100, probe=False, max_new_tokens=288),
    Regime("learn", "the second experiment: the main job's task (larger digit, held-out phrasings), model "
           "(2 layers x 4 experts) and learning rate (1e-3), where the policy learns",
           config="examples/tiny_moe_larger_digit.yaml", task=larger_digit_task, layers=2, experts=4, steps=50,
           warm_start_steps=80, eval_interval=50, sets=(),
           arms=("gspo", "grpo", "grpo_r3", "gspo_token", "dr_grpo", "rloo", "reinforce_pp", "gspo_clip3",
                 "gspo_clip10"),
           pilot_seed=100, probe=True, max_new_tokens=8),
)}

def clip_sets(scale: float) -> tuple[str, str]:
    """GSPO's clip range, the paper's times `scale`."""
    return f"loss.eps_low={GSPO_CLIP[0] * scale:.3g}", f"loss.eps_high={GSPO_CLIP[1] * scale:.3g}"


# arm -> (its overrides, what it is); "{seqclip}" and "{budget}" are filled by arm_sets
ARMS = {
    "gspo": (("loss.name=gspo",), "sequence ratio (Eq. 7), the paper's clip 3e-4 / 4e-4"),
    # the paper's clip was set for long answers, where a geometric mean of many token ratios moves
    # little; at a few tokens the same range clips a quarter of the sequences: the range scaled
    "gspo_clip3": (("loss.name=gspo", *clip_sets(3)), "GSPO, the paper's clip x3: 9e-4 / 1.2e-3"),
    "gspo_clip10": (("loss.name=gspo", *clip_sets(10)), "GSPO, the paper's clip x10: 3e-3 / 4e-3"),
    "grpo": (("loss.name=grpo",), "token ratios, the paper's clip 0.2 / 0.27"),
    "grpo_r3": (("loss.name=grpo", "moe.replay=true"), "GRPO, megatron routes every token to SGLang's experts"),
    "gspo_token": (("loss.name=gspo_token",), "GSPO's ratio per token (Eqs. 13-14)"),
    "grpo_seqclip": (("loss.name=grpo", "{seqclip}"), "GRPO, GSPO's clip x sqrt(mean response length)"),
    "dr_grpo": (("loss.name=grpo", "loss.advantage_estimator=dr_grpo", "loss.loss_agg_mode=seq-mean-token-sum-norm",
                 "{budget}"), "Dr. GRPO: group mean only, token sums over the response budget"),
    "rloo": (("loss.name=grpo", "loss.advantage_estimator=rloo"), "GRPO's loss, leave-one-out baseline (RLOO)"),
    "reinforce_pp": (("loss.name=grpo", "loss.advantage_estimator=reinforce_plus_plus"),
                     "GRPO's loss, REINFORCE++ advantages (batch-whitened returns)"),
    "reinforce_pp_baseline": (("loss.name=grpo", "loss.advantage_estimator=reinforce_plus_plus_baseline"),
                              "GRPO's loss, REINFORCE++-baseline advantages (group mean, batch-whitened)"),
    "reinforce": (("loss.name=grpo", "loss.advantage_estimator=reinforce"),
                  "GRPO's loss, plain REINFORCE: the return, no baseline, not whitened"),
}


def seqclip_sets(mean_length: float) -> list[str]:
    scale = math.sqrt(mean_length)
    return [f"loss.eps_low={GSPO_CLIP[0] * scale:.3g}", f"loss.eps_high={GSPO_CLIP[1] * scale:.3g}"]


def arm_sets(arm: str, *, mean_length: float, max_new_tokens: int) -> list[str]:
    """The overrides of one arm."""
    out = []
    for s in ARMS[arm][0]:
        if s == "{seqclip}":
            out += seqclip_sets(mean_length)
        elif s == "{budget}":
            out.append(f"loss.aggregation_args.token_sum_norm={max_new_tokens}")  # Dr. GRPO's constant: the generation budget
        else:
            out.append(s)
    return out
